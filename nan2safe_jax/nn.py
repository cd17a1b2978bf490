"""Flax NNX modules built on ``nan2safe_jax.ops``: every instance is a *site*.

A site has
- ``gear``: a ``SiteGear`` variable (int32; ``[L]`` when the module is stacked by ``nnx.vmap``)
  that the train step writes before each forward and the module reads with ``self.gear[...]``;
- ``site_name``: its module path, written by ``nan2safe_jax.site.name_sites(model)`` (the class
  name until then); the module's computation runs under ``site_scope(site_name)`` so every
  equation it produces, forward and backward, carries ``nan2safe[<site_name>]`` in its name
  stack;
- probes: ``Probe`` variables holding ``detector.stats`` of its high-risk tensors, declared in
  ``__init__`` (so they exist, stacked, under ``nnx.scan``) and overwritten on every call.

=========================  ================================================================
module                     probes (``Probe`` variables, f32[NUM_STATS] each)
=========================  ================================================================
``LayerNorm``, ``RMSNorm`` ``probe_output`` (row-sampled output), ``probe_inv_std`` (every
                           row's ``1/sqrt(var + eps)``: its max is ``1/sqrt(min var + eps)``)
``MultiHeadAttention``     ``probe_logits`` (every query row's max logit), ``probe_probs``
                           (every row's max probability)
``Router``                 ``probe_logits`` (all scores; ``[tokens, experts]`` is small)
``CrossEntropy``           ``probe_logits`` (row-sampled logits entering the loss)
``Linear``, ``Embed``      ``probe_output`` only with ``probe=True`` (``cheap_stats``: one
                           max-abs reduction)
=========================  ================================================================

Probes must cost almost nothing next to the op (docs/design.md, "Tier 1"), and a full
``detector.stats`` pass over a ``[batch, heads, q, k]`` tensor costs as much as the attention
itself on CPU. So the probes summarise per-row quantities the op computes anyway (the softmax's
row max and denominator, the norm's per-row variance), or a fixed-size sample of rows
(``sampled_stats``: at most ``PROBE_SAMPLE`` elements, evenly strided rows).

Constructors mirror the ``flax.nnx`` module of the same name (keyword-only ``rngs``, ``dtype``,
``param_dtype``; same parameter names), so a model can swap them in.

Fault injection: ``MultiHeadAttention.qk_scale`` and ``Router.logit_scale`` are ``Knob``
variables (f32 scalars, 1.0 by default, not trained) that multiply the attention logits / the
router scores. Raising one is the real mechanism of the write-up's overflows (a q·k scale that
grows until fp16 logits pass 65504), and because a knob is data, changing it never recompiles.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from nan2safe_jax import ops
from nan2safe_jax import probe as probe_lib
from nan2safe_jax.probe import cheap_stats, sampled_stats
from nan2safe_jax.site import Probe, SiteGear, site_scope

__all__ = [
    "CrossEntropy",
    "Embed",
    "Knob",
    "LayerNorm",
    "Linear",
    "MultiHeadAttention",
    "RMSNorm",
    "Router",
    "cheap_stats",
    "sampled_stats",
]


_default_kernel_init = nnx.initializers.lecun_normal()
_default_embed_init = nnx.initializers.variance_scaling(1.0, "fan_in", "normal", out_axis=0)
_zeros = nnx.initializers.zeros_init()
_ones = nnx.initializers.ones_init()


class Knob(nnx.Variable):
    """A non-trainable f32 multiplier (1.0 by default) for fault injection; data, not code."""


def _new_probe() -> Probe:
    return Probe(probe_lib.zeros())


def _compute_dtype(x: jax.Array, dtype, *params) -> jnp.dtype:
    """``dtype`` when given, else the promotion of ``x`` and the params (flax's rule)."""
    if dtype is not None:
        return jnp.dtype(dtype)
    dts = [x.dtype] + [p.dtype for p in params if p is not None]
    out = jnp.result_type(*dts)
    return out if jnp.issubdtype(out, jnp.floating) else jnp.dtype(jnp.float32)


def _value(v):
    return None if v is None else v[...]


class _Site(nnx.Module):
    """Adds the site attributes: ``gear``, ``site_name``."""

    def _init_site(self) -> None:
        self.gear = SiteGear(jnp.zeros((), jnp.int32))
        self.site_name = type(self).__name__

    @contextlib.contextmanager
    def _scope(self):
        """``site_scope(site_name)``, re-entered inside the ops' gear branches too."""
        with site_scope(self.site_name), ops.branch_site(self.site_name):
            yield


class Linear(_Site):
    """``nnx.Linear`` as a site: ``y = x @ kernel + bias`` through ``ops.linear``.

    Same constructor and parameters (``kernel [in, out]``, ``bias [out]``) as ``flax.nnx.Linear``;
    ``dot_general``, ``promote_dtype`` and ``preferred_element_type`` are accepted for
    compatibility (the gear decides the accumulation type; a non-default ``dot_general`` raises).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        use_bias: bool = True,
        dtype: Any = None,
        param_dtype: Any = jnp.float32,
        precision: Any = None,
        kernel_init: Any = _default_kernel_init,
        bias_init: Any = _zeros,
        dot_general: Any = None,
        promote_dtype: Any = None,
        preferred_element_type: Any = None,
        rngs: nnx.Rngs,
        kernel_metadata: Mapping[str, Any] = {},  # noqa: B006 - read-only, as in flax
        bias_metadata: Mapping[str, Any] = {},  # noqa: B006
        probe: bool = False,
    ):
        if dot_general not in (None, jax.lax.dot_general):
            raise ValueError(
                "nan2safe_jax.nn.Linear computes through ops.linear; a custom dot_general is not "
                f"supported, got {dot_general!r}"
            )
        del promote_dtype, preferred_element_type
        self.kernel = nnx.Param(
            kernel_init(rngs.params(), (in_features, out_features), param_dtype),
            **kernel_metadata,
        )
        if use_bias:
            self.bias = nnx.Param(
                bias_init(rngs.params(), (out_features,), param_dtype), **bias_metadata
            )
        else:
            self.bias = nnx.data(None)
        self.in_features, self.out_features, self.use_bias = in_features, out_features, use_bias
        self.dtype, self.param_dtype, self.precision = dtype, param_dtype, precision
        self._init_site()
        self.probe_output = _new_probe() if probe else nnx.data(None)

    def __call__(self, inputs: jax.Array) -> jax.Array:
        kernel, bias = self.kernel[...], _value(self.bias)
        x = jnp.asarray(inputs)
        x = x.astype(_compute_dtype(x, self.dtype, kernel, bias))
        with self._scope():
            y = ops.linear(x, kernel, bias, gear=self.gear[...], precision=self.precision)
            if self.probe_output is not None:
                self.probe_output[...] = cheap_stats(y)
        return y


class Embed(_Site):
    """``nnx.Embed`` as a site (``embedding [num_embeddings, features]``).

    The lookup is exact in every gear (no arithmetic); ``attend`` (tied output logits) goes
    through ``ops.linear`` and so is gear-switched.
    """

    def __init__(
        self,
        num_embeddings: int,
        features: int,
        *,
        dtype: Any = None,
        param_dtype: Any = jnp.float32,
        embedding_init: Any = _default_embed_init,
        promote_dtype: Any = None,
        rngs: nnx.Rngs,
        embedding_metadata: Mapping[str, Any] = {},  # noqa: B006
        probe: bool = False,
    ):
        del promote_dtype
        self.embedding = nnx.Param(
            embedding_init(rngs.params(), (num_embeddings, features), param_dtype),
            **embedding_metadata,
        )
        self.num_embeddings, self.features = num_embeddings, features
        self.dtype, self.param_dtype = dtype, param_dtype
        self._init_site()
        self.probe_output = _new_probe() if probe else nnx.data(None)

    def __call__(self, inputs: jax.Array) -> jax.Array:
        inputs = jnp.asarray(inputs)
        if not jnp.issubdtype(inputs.dtype, jnp.integer):
            raise ValueError(f"Embed: inputs must be integers, got {inputs.dtype}")
        emb = self.embedding[...]
        dt = jnp.dtype(self.dtype) if self.dtype is not None else emb.dtype
        with self._scope():
            y = jnp.take(emb, inputs, axis=0).astype(dt)
            if self.probe_output is not None:
                self.probe_output[...] = cheap_stats(y)
        return y

    def attend(self, query: jax.Array) -> jax.Array:
        """``query @ embedding.T``: logits over the embeddings (gear-switched)."""
        emb = self.embedding[...]
        q = jnp.asarray(query)
        q = q.astype(_compute_dtype(q, self.dtype, emb))
        with self._scope():
            return ops.linear(q, emb.T, None, gear=self.gear[...])


def _check_last_axis(reduction_axes, feature_axes, name):
    for arg, val in (("reduction_axes", reduction_axes), ("feature_axes", feature_axes)):
        if val not in (-1, (-1,)):
            raise ValueError(f"{name}: only the last axis is supported, got {arg}={val!r}")


class LayerNorm(_Site):
    """``nnx.LayerNorm`` (last axis) as a site, through ``ops.layer_norm``.

    Probes: ``probe_output`` (``sampled_stats`` of the output) and ``probe_inv_std`` (stats of
    every row's ``1/sqrt(var + eps)``: its max_abs rises as the smallest variance collapses).
    """

    def __init__(
        self,
        num_features: int,
        *,
        epsilon: float = 1e-6,
        dtype: Any = None,
        param_dtype: Any = jnp.float32,
        use_bias: bool = True,
        use_scale: bool = True,
        bias_init: Any = _zeros,
        scale_init: Any = _ones,
        reduction_axes: Any = -1,
        feature_axes: Any = -1,
        axis_name: str | None = None,
        axis_index_groups: Any = None,
        use_fast_variance: bool = True,
        promote_dtype: Any = None,
        rngs: nnx.Rngs,
        bias_metadata: Mapping[str, Any] = {},  # noqa: B006
        scale_metadata: Mapping[str, Any] = {},  # noqa: B006
    ):
        _check_last_axis(reduction_axes, feature_axes, "LayerNorm")
        if axis_name is not None:
            raise ValueError("LayerNorm: cross-device statistics (axis_name) are not supported")
        del axis_index_groups, use_fast_variance, promote_dtype
        shape = (num_features,)
        self.scale = (
            nnx.Param(scale_init(rngs.params(), shape, param_dtype), **scale_metadata)
            if use_scale
            else nnx.data(None)
        )
        self.bias = (
            nnx.Param(bias_init(rngs.params(), shape, param_dtype), **bias_metadata)
            if use_bias
            else nnx.data(None)
        )
        self.num_features, self.epsilon = num_features, epsilon
        self.dtype, self.param_dtype = dtype, param_dtype
        self.use_bias, self.use_scale = use_bias, use_scale
        self._init_site()
        self.probe_output = _new_probe()
        self.probe_inv_std = _new_probe()

    def __call__(self, x: jax.Array) -> jax.Array:
        scale, bias = _value(self.scale), _value(self.bias)
        x = jnp.asarray(x)
        x = x.astype(_compute_dtype(x, self.dtype, scale, bias))
        with self._scope():
            y, st = ops.layer_norm(
                x, scale, bias, self.epsilon, gear=self.gear[...], return_stats=True
            )
            self.probe_output[...] = sampled_stats(y)
            self.probe_inv_std[...] = st["inv_std"]
        return y


class RMSNorm(_Site):
    """``nnx.RMSNorm`` (last axis) as a site, through ``ops.rms_norm``; probes as LayerNorm."""

    def __init__(
        self,
        num_features: int,
        *,
        epsilon: float = 1e-6,
        dtype: Any = None,
        param_dtype: Any = jnp.float32,
        use_scale: bool = True,
        scale_init: Any = _ones,
        reduction_axes: Any = -1,
        feature_axes: Any = -1,
        axis_name: str | None = None,
        axis_index_groups: Any = None,
        use_fast_variance: bool = True,
        promote_dtype: Any = None,
        rngs: nnx.Rngs,
        scale_metadata: Mapping[str, Any] = {},  # noqa: B006
    ):
        _check_last_axis(reduction_axes, feature_axes, "RMSNorm")
        if axis_name is not None:
            raise ValueError("RMSNorm: cross-device statistics (axis_name) are not supported")
        del axis_index_groups, use_fast_variance, promote_dtype
        self.scale = (
            nnx.Param(scale_init(rngs.params(), (num_features,), param_dtype), **scale_metadata)
            if use_scale
            else nnx.data(None)
        )
        self.num_features, self.epsilon = num_features, epsilon
        self.dtype, self.param_dtype, self.use_scale = dtype, param_dtype, use_scale
        self._init_site()
        self.probe_output = _new_probe()
        self.probe_inv_std = _new_probe()

    def __call__(self, x: jax.Array) -> jax.Array:
        scale = _value(self.scale)
        x = jnp.asarray(x)
        x = x.astype(_compute_dtype(x, self.dtype, scale))
        with self._scope():
            y, st = ops.rms_norm(x, scale, self.epsilon, gear=self.gear[...], return_stats=True)
            self.probe_output[...] = sampled_stats(y)
            self.probe_inv_std[...] = st["inv_std"]
        return y


class MultiHeadAttention(_Site):
    """``nnx.MultiHeadAttention`` as a site; the core runs through ``ops.attention``.

    The constructor and ``__call__`` accept the ``flax.nnx`` arguments. Differences: the
    projections ``query``/``key``/``value``/``out`` are ``nan2safe_jax.nn.Linear`` sites with
    2-D kernels (``[in, heads*head_dim]``, ``[heads*head_dim, out]``) where flax's
    ``LinearGeneral`` has 3-D ones; ``decode``, attention dropout (``dropout_rate > 0``), grouped
    KV heads and a custom ``attention_fn`` are not supported (they raise).

    Probes: ``probe_logits`` (stats of every query row's max scaled q·k logit) and
    ``probe_probs`` (stats of every row's max probability); see ``ops.attention``. Knob:
    ``qk_scale`` multiplies the logits.
    """

    def __init__(
        self,
        num_heads: int,
        in_features: int,
        qkv_features: int | None = None,
        out_features: int | None = None,
        num_kv_heads: int | None = None,
        in_kv_features: int | None = None,
        *,
        dtype: Any = None,
        param_dtype: Any = jnp.float32,
        broadcast_dropout: bool = True,
        dropout_rate: float = 0.0,
        deterministic: bool | None = None,
        precision: Any = None,
        kernel_init: Any = _default_kernel_init,
        out_kernel_init: Any = None,
        bias_init: Any = _zeros,
        out_bias_init: Any = None,
        use_bias: bool = True,
        attention_fn: Any = None,
        decode: bool | None = None,
        normalize_qk: bool = False,
        rngs: nnx.Rngs,
        keep_rngs: bool = True,
        **unused: Any,
    ):
        del broadcast_dropout, keep_rngs, unused
        qkv_features = in_features if qkv_features is None else qkv_features
        out_features = in_features if out_features is None else out_features
        in_kv_features = in_features if in_kv_features is None else in_kv_features
        if qkv_features % num_heads:
            raise ValueError(
                f"MultiHeadAttention: qkv_features ({qkv_features}) must be divisible by "
                f"num_heads ({num_heads})"
            )
        if num_kv_heads not in (None, num_heads):
            raise ValueError(
                f"MultiHeadAttention: grouped KV heads are not supported, got num_kv_heads="
                f"{num_kv_heads} with num_heads={num_heads}"
            )
        if dropout_rate:
            raise ValueError(
                f"MultiHeadAttention: attention dropout is not supported, got dropout_rate="
                f"{dropout_rate}; use 0.0"
            )
        if decode:
            raise ValueError("MultiHeadAttention: decode=True (KV cache) is not supported")
        if attention_fn is not None:
            raise ValueError(
                "MultiHeadAttention: the attention core is ops.attention (gear-switched); a "
                "custom attention_fn is not supported"
            )
        self.num_heads, self.in_features = num_heads, in_features
        self.qkv_features, self.out_features = qkv_features, out_features
        self.head_dim = qkv_features // num_heads
        self.dtype, self.param_dtype, self.precision = dtype, param_dtype, precision
        self.deterministic, self.decode, self.normalize_qk = deterministic, False, normalize_qk
        lin = dict(
            dtype=dtype,
            param_dtype=param_dtype,
            precision=precision,
            bias_init=bias_init,
            use_bias=use_bias,
            rngs=rngs,
        )
        self.query = Linear(in_features, qkv_features, kernel_init=kernel_init, **lin)
        self.key = Linear(in_kv_features, qkv_features, kernel_init=kernel_init, **lin)
        self.value = Linear(in_kv_features, qkv_features, kernel_init=kernel_init, **lin)
        self.out = Linear(
            qkv_features,
            out_features,
            **{
                **lin,
                "kernel_init": out_kernel_init or kernel_init,
                "bias_init": out_bias_init or bias_init,
            },
        )
        if normalize_qk:
            ln = dict(use_bias=False, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
            self.query_ln = LayerNorm(self.head_dim, **ln)
            self.key_ln = LayerNorm(self.head_dim, **ln)
        else:
            self.query_ln = nnx.data(None)
            self.key_ln = nnx.data(None)
        self._init_site()
        self.qk_scale = Knob(jnp.ones((), jnp.float32))
        self.probe_logits = _new_probe()
        self.probe_probs = _new_probe()

    def __call__(
        self,
        inputs_q: jax.Array,
        inputs_k: jax.Array | None = None,
        inputs_v: jax.Array | None = None,
        *,
        mask: jax.Array | None = None,
        deterministic: bool | None = None,
        rngs: Any = None,
        sow_weights: bool = False,
        decode: bool | None = None,
        is_causal: bool = False,
        **unused: Any,
    ) -> jax.Array:
        """Self-attention when only ``inputs_q`` is given (flax's rule for missing k/v).

        Args:
          inputs_q: ``[batch, q_len, features]`` (or ``[q_len, features]``).
          inputs_k, inputs_v: ``[batch, kv_len, features]``; default ``inputs_q`` / ``inputs_k``.
          mask: bool, broadcastable to ``[batch, num_heads, q_len, kv_len]``; True = attend.
          is_causal: also apply a causal mask (built inside the op, never materialised).
        """
        del deterministic, rngs, sow_weights, unused
        if decode:
            raise ValueError("MultiHeadAttention: decode=True (KV cache) is not supported")
        if inputs_k is None:
            if inputs_v is not None:
                raise ValueError("MultiHeadAttention: inputs_v given without inputs_k")
            inputs_k = inputs_q
        if inputs_v is None:
            inputs_v = inputs_k
        unbatched = jnp.ndim(inputs_q) == 2
        if unbatched:
            inputs_q, inputs_k, inputs_v = (a[None] for a in (inputs_q, inputs_k, inputs_v))
            if mask is not None and jnp.ndim(mask) == 4:
                raise ValueError("MultiHeadAttention: a 4-D mask needs batched inputs")
        h, d = self.num_heads, self.head_dim
        with self._scope():
            q = self.query(inputs_q)
            k = self.key(inputs_k)
            v = self.value(inputs_v)
            q = q.reshape(q.shape[:-1] + (h, d))
            k = k.reshape(k.shape[:-1] + (h, d))
            v = v.reshape(v.shape[:-1] + (h, d))
            if self.normalize_qk:
                q, k = self.query_ln(q), self.key_ln(k)
            scale = self.qk_scale[...].astype(jnp.float32) / math.sqrt(d)
            y, st = ops.attention(
                q,
                k,
                v,
                mask=mask,
                causal=is_causal,
                gear=self.gear[...],
                scale=scale,
                return_stats=True,
            )
            self.probe_logits[...] = st["logits"]
            self.probe_probs[...] = st["probs"]
            out = self.out(y.reshape(y.shape[:-2] + (h * d,)))
        return out[0] if unbatched else out


class Router(_Site):
    """MoE top-k gate as a site: scores ``x @ kernel`` → softmax → top-k → renormalise.

    ``Router(in_features, num_experts, top_k, *, rngs)``; parameter ``kernel
    [in_features, num_experts]``. Returns ``ops.Routing(gates, indices, probs)``.
    Probe: ``probe_logits`` (stats of the scores). Knob: ``logit_scale`` multiplies the kernel
    (growing router weights: the write-up's fp16 router overflow).
    """

    def __init__(
        self,
        in_features: int,
        num_experts: int,
        top_k: int,
        *,
        dtype: Any = None,
        param_dtype: Any = jnp.float32,
        kernel_init: Any = _default_kernel_init,
        rngs: nnx.Rngs,
    ):
        if not 1 <= top_k <= num_experts:
            raise ValueError(
                f"Router: top_k must be in [1, num_experts={num_experts}], got {top_k}"
            )
        self.kernel = nnx.Param(kernel_init(rngs.params(), (in_features, num_experts), param_dtype))
        self.in_features, self.num_experts, self.top_k = in_features, num_experts, top_k
        self.dtype, self.param_dtype = dtype, param_dtype
        self._init_site()
        self.logit_scale = Knob(jnp.ones((), jnp.float32))
        self.probe_logits = _new_probe()

    def __call__(self, x: jax.Array) -> ops.Routing:
        kernel = self.kernel[...]
        x = jnp.asarray(x)
        x = x.astype(_compute_dtype(x, self.dtype, kernel))
        with self._scope():
            kernel = kernel * self.logit_scale[...].astype(kernel.dtype)
            r, st = ops.router(x, kernel, self.top_k, gear=self.gear[...], return_stats=True)
            self.probe_logits[...] = st["logits"]
        return r


class CrossEntropy(_Site):
    """The loss as a site: mean next-token cross-entropy through ``ops.cross_entropy`` (f32).

    Not a ``flax.nnx`` module (flax has none); it gives the loss its own gear and name so the
    localizer and the gear state treat it like any other site. Probe: ``probe_logits``.
    """

    def __init__(self, *, rngs: nnx.Rngs | None = None):
        del rngs
        self._init_site()
        self.probe_logits = _new_probe()

    def __call__(
        self, logits: jax.Array, labels: jax.Array, mask: jax.Array | None = None
    ) -> jax.Array:
        with self._scope():
            self.probe_logits[...] = sampled_stats(logits)
            return ops.cross_entropy(logits, labels, self.gear[...], mask=mask)
