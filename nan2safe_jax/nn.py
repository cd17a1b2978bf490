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
                           row's ``1/sqrt(var + eps)``: its max is ``1/sqrt(min var + eps)``),
                           ``probe_input`` (every row's ``sqrt(E[x²])``: the input's scale)
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

Drop-in: constructors, call arguments, parameter trees and initialisation order are those of
the ``flax.nnx`` module of the same name, and at FAST each module computes exactly what flax
computes (tests/test_nn_flax_compat.py compares against the real classes), so swapping them in
changes nothing until a gear changes. A model built with ``nnx.eval_shape`` and given only its
``Param``s (a params-only checkpoint restored the orbax way) holds abstract gears, knobs and
probes: ``TrainState.create`` fills them with their defaults, and so does ``fill_defaults(model)``
(call it once before a ``jit`` or ``nnx.scan`` of your own; an unstacked layer called eagerly
fills its own on first use).

Fault injection: ``MultiHeadAttention.qk_scale`` and ``Router.logit_scale`` are ``Knob``
variables (f32 scalars, 1.0 by default, not trained) that multiply the attention logits / the
router scores; at 1.0 they change no bit. Because a knob is data, changing it never recompiles.
flax's default attention takes even fp16 logits in f32 (``jax.nn.dot_product_attention``), so
``qk_scale`` overflows fp16 only on flax's explicit path (dropout or ``sow_weights``).
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx.nn import attention as flax_attention
from flax.nnx.nn import dtypes as flax_dtypes
from flax.nnx.nn import linear as flax_linear
from jax import lax

from nan2safe_jax import ops
from nan2safe_jax import probe as probe_lib
from nan2safe_jax.probe import cheap_stats, probe_enabled, sampled_stats
from nan2safe_jax.site import Probe, SiteGear, fill_default, fill_defaults, site_scope
from nan2safe_jax.site import write_probe as _write

__all__ = [
    "Conv",
    "CrossEntropy",
    "Embed",
    "Knob",
    "LayerNorm",
    "Linear",
    "LinearGeneral",
    "MultiHeadAttention",
    "RMSNorm",
    "BatchNorm",
    "Router",
    "cheap_stats",
    "fill_defaults",
    "sampled_stats",
]


_default_kernel_init = nnx.initializers.lecun_normal()
_default_embed_init = nnx.initializers.variance_scaling(1.0, "fan_in", "normal", out_axis=0)
_zeros = nnx.initializers.zeros_init()
_ones = nnx.initializers.ones_init()
_promote = flax_dtypes.promote_dtype


class Knob(nnx.Variable):
    """A non-trainable f32 multiplier (1.0 by default) for fault injection; data, not code."""

    default = 1.0


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


def _read(var: nnx.Variable) -> jax.Array:
    """The variable's value; an abstract one (``nnx.eval_shape``, then only the ``Param``s
    filled in) first gets its default (``site.fill_default``), so an abstractly built model
    runs."""
    fill_default(var)
    return var[...]


def _write_if(var: nnx.Variable, st: Mapping[str, jax.Array], key: str, kind: str) -> None:
    """Writes ``st[key]`` into probe ``var`` when probe kind ``kind`` is on in this trace."""
    if probe_enabled(kind):
        _write(var, st[key])


def _no_sharding(name: str, out_sharding) -> None:
    if out_sharding is not None:
        raise ValueError(f"{name}: out_sharding is not supported (explicit sharding mode)")


class _Site(nnx.Module):
    """Adds the site attributes: ``gear``, ``site_name``; ``probe_kinds`` maps each ``Probe``
    attribute to its kind in ``probe.PROBE_KINDS`` (``Config.probes`` selects kinds)."""

    probe_kinds: Mapping[str, str] = MappingProxyType({})

    def _init_site(self) -> None:
        self.gear = SiteGear(jnp.zeros((), jnp.int32))
        self.site_name = type(self).__name__

    def _gear(self) -> jax.Array:
        return _read(self.gear)

    @contextlib.contextmanager
    def _scope(self):
        """``site_scope(site_name)``, re-entered inside the ops' gear branches too."""
        with site_scope(self.site_name), ops.branch_site(self.site_name):
            yield


class Linear(_Site):
    """``nnx.Linear`` as a site: ``y = x @ kernel + bias`` through ``ops.linear``.

    Same constructor, parameters (``kernel [in, out]``, ``bias [out]``, same initialisation
    order) and FAST math as ``flax.nnx.Linear``: operands promoted by ``promote_dtype``, then
    ``dot_general`` with ``precision`` and ``preferred_element_type``, then ``+ bias``. Every
    gear returns FAST's dtype (see ``ops.linear``). A custom ``dot_general`` raises (the gears
    need to own the matmul).
    """

    probe_kinds = MappingProxyType({"probe_output": "linear_output"})

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
        dot_general: Any = lax.dot_general,
        promote_dtype: Any = _promote,
        preferred_element_type: Any = None,
        rngs: nnx.Rngs,
        kernel_metadata: Mapping[str, Any] = MappingProxyType({}),
        bias_metadata: Mapping[str, Any] = MappingProxyType({}),
        probe: bool = False,
    ):
        if dot_general not in (None, lax.dot_general):
            raise ValueError(
                "nan2safe_jax.nn.Linear computes through ops.linear; a custom dot_general is not "
                f"supported, got {dot_general!r}"
            )
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
        self.promote_dtype, self.preferred_element_type = promote_dtype, preferred_element_type
        self._init_site()
        self.probe_output = _new_probe() if probe else nnx.data(None)

    def __call__(self, inputs: jax.Array, out_sharding: Any = None) -> jax.Array:
        _no_sharding("Linear", out_sharding)
        with self._scope():  # the promotion's casts are the site's (tier 2 names it)
            inputs, kernel, bias, dtype = _promoted(
                self.promote_dtype, inputs, self.kernel[...], _value(self.bias), self.dtype
            )
            y = ops.linear(
                inputs,
                kernel,
                bias,
                gear=self._gear(),
                precision=self.precision,
                preferred_element_type=self.preferred_element_type,
                dtype=dtype,
            )
            if self.probe_output is not None and probe_enabled("linear_output"):
                _write(self.probe_output, cheap_stats(y))
        return y


def _promoted(promote, inputs, kernel, bias, dtype):
    """``(*promote((inputs, kernel, bias), dtype=dtype), compute dtype)``, except that with
    flax's own ``promote_dtype`` a float input and the weights come back as given, with the
    dtype ``promote_dtype`` would cast them to: ``ops.linear(..., dtype=)`` (and
    ``ops.layer_norm`` / ``ops.rms_norm``) cast them to it in FAST and STABLE, and to f32 in
    SAFE, so SAFE computes an fp16 layer from its f32 weights and f32 inputs, not from their
    casts (inf past 65504). A custom
    ``promote_dtype`` gives its own operands to every gear (compute dtype None)."""
    if promote is not _promote:
        return (*promote((jnp.asarray(inputs), kernel, bias), dtype=dtype), None)
    dtype = flax_dtypes.canonicalize_dtype(inputs, kernel, bias, dtype=dtype)
    inputs = jnp.asarray(inputs)
    if not jnp.issubdtype(inputs.dtype, jnp.floating):
        inputs = inputs.astype(dtype)
    return inputs, kernel, bias, dtype


class Conv(_Site, nnx.Conv):
    """``nnx.Conv`` as a site: flax's constructor and preprocessing (batch axes flattened,
    ``CIRCULAR`` / ``REFLECT`` / ``CAUSAL`` padding, the kernel mask), then the convolution and
    bias through ``ops.conv``. FAST is flax's math; every gear returns FAST's dtype. A
    subclass of ``nnx.Conv`` (type checks, ``nnx.view`` and flax's attributes see a Conv).
    A custom ``conv_general_dilated`` raises (the gears own the convolution); no probe (a
    CNN's tier 1 is its ``BatchNorm``'s).
    """

    def __init__(self, *args, **kwargs):
        custom = kwargs.get("conv_general_dilated", lax.conv_general_dilated)
        if custom is not lax.conv_general_dilated:
            raise ValueError(
                "nan2safe_jax.nn.Conv computes through ops.conv; a custom conv_general_dilated "
                "is not supported"
            )
        super().__init__(*args, **kwargs)
        self._init_site()

    def __call__(self, inputs: jax.Array, out_sharding: Any = None) -> jax.Array:
        _no_sharding("Conv", out_sharding)
        ks = self.kernel_size
        inputs = jnp.asarray(inputs)
        batch_dims = inputs.ndim - (len(ks) + 1)
        if batch_dims != 1:
            batch_shape = inputs.shape[:batch_dims]
            inputs = jnp.reshape(inputs, (-1,) + inputs.shape[batch_dims:])
        each = functools.partial(_per_spatial_axis, n=len(ks))
        dilation = each(self.kernel_dilation)
        padding = flax_linear.canonicalize_padding(self.padding, len(ks))
        if padding in ("CIRCULAR", "REFLECT"):
            dilated = [(k - 1) * d + 1 for k, d in zip(ks, dilation, strict=True)]
            pads = [(0, 0)] + [((k - 1) // 2, k // 2) for k in dilated] + [(0, 0)]
            mode = {"CIRCULAR": "wrap", "REFLECT": "reflect"}[padding]
            inputs, padding = jnp.pad(inputs, pads, mode=mode), "VALID"
        elif padding == "CAUSAL":
            if len(ks) != 1:
                raise ValueError("Causal padding is only implemented for 1D convolutions.")
            pads = [(0, 0), (dilation[0] * (ks[0] - 1), 0), (0, 0)]
            inputs, padding = jnp.pad(inputs, pads), "VALID"
        if self.mask is not None and self.mask.shape != self.kernel_shape:
            raise ValueError(
                "Mask needs to have the same shape as weights. "
                f"Shapes are: {self.mask.shape}, {self.kernel_shape}"
            )
        kernel = self.kernel[...]
        if self.mask is not None:
            kernel = kernel * self.mask
        with self._scope():
            x, kernel, bias, cdtype = _promoted(
                self.promote_dtype, inputs, kernel, _value(self.bias), self.dtype
            )
            y = ops.conv(
                x,
                kernel,
                bias if self.use_bias else None,
                gear=self._gear(),
                strides=each(self.strides),
                padding=padding,
                lhs_dilation=each(self.input_dilation),
                rhs_dilation=dilation,
                dimension_numbers=flax_linear._conv_dimension_numbers(inputs.shape),
                feature_group_count=self.feature_group_count,
                precision=self.precision,
                preferred_element_type=self.preferred_element_type,
                dtype=cdtype,
            )
        if batch_dims != 1:
            y = jnp.reshape(y, batch_shape + y.shape[1:])
        return y


def _per_spatial_axis(v, n: int) -> tuple[int, ...]:
    """flax's ``maybe_broadcast`` in ``Conv``: None is 1, an int is itself on all ``n`` axes."""
    if v is None:
        v = 1
    return (v,) * n if isinstance(v, int) else tuple(v)


def _tuple(x) -> tuple[int, ...]:
    return tuple(x) if isinstance(x, (tuple, list)) else (int(x),)


class LinearGeneral(_Site):
    """``nnx.LinearGeneral`` over trailing axes, as a site (``MultiHeadAttention``'s
    projections): ``kernel [*in_features, *out_features]``, ``bias [*out_features]``,
    initialised flat and reshaped as flax does. ``axis`` must name the last
    ``len(in_features)`` axes; ``batch_axis`` and a custom ``dot_general`` raise.
    """

    def __init__(
        self,
        in_features: Any,
        out_features: Any,
        *,
        axis: Any = -1,
        batch_axis: Mapping[Any, Any] = MappingProxyType({}),
        use_bias: bool = True,
        dtype: Any = None,
        param_dtype: Any = jnp.float32,
        kernel_init: Any = _default_kernel_init,
        bias_init: Any = _zeros,
        precision: Any = None,
        promote_dtype: Any = _promote,
        dot_general: Any = None,
        dot_general_cls: Any = None,
        preferred_element_type: Any = None,
        rngs: nnx.Rngs,
        kernel_metadata: Mapping[str, Any] = MappingProxyType({}),
        bias_metadata: Mapping[str, Any] = MappingProxyType({}),
    ):
        self.in_features, self.out_features = _tuple(in_features), _tuple(out_features)
        n = len(self.in_features)
        if tuple(_tuple(axis)) != tuple(range(-n, 0)):
            raise ValueError(
                f"LinearGeneral: axis must be the last {n} axes {tuple(range(-n, 0))}, got {axis}"
            )
        if batch_axis or dot_general not in (None, lax.dot_general) or dot_general_cls:
            raise ValueError("LinearGeneral: batch_axis and a custom dot_general are not supported")
        flat = (math.prod(self.in_features), math.prod(self.out_features))
        kernel = kernel_init(rngs.params(), flat, param_dtype)
        self.kernel = nnx.Param(
            jnp.reshape(kernel, self.in_features + self.out_features), **kernel_metadata
        )
        if use_bias:
            b = bias_init(rngs.params(), (flat[1],), param_dtype)
            self.bias = nnx.Param(jnp.reshape(b, self.out_features), **bias_metadata)
        else:
            self.bias = nnx.data(None)
        self.axis, self.use_bias = tuple(range(-n, 0)), use_bias
        self.dtype, self.param_dtype, self.precision = dtype, param_dtype, precision
        self.promote_dtype, self.preferred_element_type = promote_dtype, preferred_element_type
        self._init_site()

    def __call__(self, inputs: jax.Array, out_sharding: Any = None) -> jax.Array:
        _no_sharding("LinearGeneral", out_sharding)
        with self._scope():  # the promotion's casts are the site's (tier 2 names it)
            inputs, kernel, bias, dtype = _promoted(
                self.promote_dtype, inputs, self.kernel[...], _value(self.bias), self.dtype
            )
            return ops.linear(
                inputs,
                kernel,
                bias,
                gear=self._gear(),
                precision=self.precision,
                preferred_element_type=self.preferred_element_type,
                contract=len(self.in_features),
                dtype=dtype,
            )


class Embed(_Site):
    """``nnx.Embed`` as a site (``embedding [num_embeddings, features]``).

    The lookup is flax's in every gear (no arithmetic): ``jnp.take``, so an index past the
    table gives NaN, and with ``num_embeddings == 1`` the single row is broadcast whatever the
    index. ``attend`` (tied output logits) goes through ``ops.linear`` and so is gear-switched.
    """

    probe_kinds = MappingProxyType({"probe_output": "linear_output"})

    def __init__(
        self,
        num_embeddings: int,
        features: int,
        *,
        dtype: Any = None,
        param_dtype: Any = jnp.float32,
        embedding_init: Any = _default_embed_init,
        promote_dtype: Any = _promote,
        rngs: nnx.Rngs,
        embedding_metadata: Mapping[str, Any] = MappingProxyType({}),
        probe: bool = False,
    ):
        self.embedding = nnx.Param(
            embedding_init(rngs.params(), (num_embeddings, features), param_dtype),
            **embedding_metadata,
        )
        self.num_embeddings, self.features = num_embeddings, features
        self.dtype = dtype or self.embedding.dtype
        self.param_dtype, self.promote_dtype = param_dtype, promote_dtype
        self._init_site()
        self.probe_output = _new_probe() if probe else nnx.data(None)

    def __call__(self, inputs: jax.Array, out_sharding: Any = None) -> jax.Array:
        _no_sharding("Embed", out_sharding)
        inputs = jnp.asarray(inputs)
        if not jnp.issubdtype(inputs.dtype, jnp.integer):
            raise ValueError(f"Embed: inputs must be integers, got {inputs.dtype}")
        with self._scope():
            (emb,) = self.promote_dtype((self.embedding[...],), dtype=self.dtype, inexact=False)
            if self.num_embeddings == 1:
                y = jnp.broadcast_to(emb, inputs.shape + (self.features,))
            else:
                y = jnp.take(emb, inputs, axis=0)
            if self.probe_output is not None and probe_enabled("linear_output"):
                _write(self.probe_output, cheap_stats(y))
        return y

    def attend(self, query: jax.Array, out_sharding: Any = None) -> jax.Array:
        """``query @ embedding.T``: logits over the embeddings (gear-switched)."""
        _no_sharding("Embed.attend", out_sharding)
        with self._scope():
            q, emb, _, dtype = _promoted(
                self.promote_dtype, query, self.embedding[...], None, self.dtype
            )
            return ops.linear(q, emb.T, None, gear=self._gear(), dtype=dtype)


def _check_last_axis(reduction_axes, feature_axes, name):
    for arg, val in (("reduction_axes", reduction_axes), ("feature_axes", feature_axes)):
        if val not in (-1, (-1,)):
            raise ValueError(f"{name}: only the last axis is supported, got {arg}={val!r}")


class LayerNorm(_Site):
    """``nnx.LayerNorm`` (last axis) as a site, through ``ops.layer_norm``.

    FAST is flax's math (statistics in f32, ``use_fast_variance``, ``mask=``). Probes:
    ``probe_output`` (``sampled_stats`` of the output), ``probe_inv_std`` (stats of every
    row's ``1/sqrt(var + eps)``: its max_abs rises as the smallest variance collapses) and
    ``probe_input`` (stats of every row's ``sqrt(E[x²])`` in the input's dtype: its max_abs
    rises as the activations entering the norm grow).
    """

    probe_kinds = MappingProxyType(
        {
            "probe_output": "norm_output",
            "probe_inv_std": "norm_inv_std",
            "probe_input": "norm_input",
        }
    )

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
        promote_dtype: Any = _promote,
        rngs: nnx.Rngs,
        bias_metadata: Mapping[str, Any] = MappingProxyType({}),
        scale_metadata: Mapping[str, Any] = MappingProxyType({}),
    ):
        _check_last_axis(reduction_axes, feature_axes, "LayerNorm")
        if axis_name is not None:
            raise ValueError("LayerNorm: cross-device statistics (axis_name) are not supported")
        del axis_index_groups
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
        self.reduction_axes, self.feature_axes = reduction_axes, feature_axes
        self.use_fast_variance, self.promote_dtype = use_fast_variance, promote_dtype
        self._init_site()
        self.probe_output = _new_probe()
        self.probe_inv_std = _new_probe()
        self.probe_input = _new_probe()

    def __call__(self, x: jax.Array, *, mask: jax.Array | None = None) -> jax.Array:
        with self._scope():
            x, scale, bias, cdtype = _promoted(
                self.promote_dtype, x, _value(self.scale), _value(self.bias), self.dtype
            )
            y, st = ops.layer_norm(
                x,
                scale,
                bias,
                self.epsilon,
                gear=self._gear(),
                mask=mask,
                use_fast_variance=self.use_fast_variance,
                return_stats=True,
                stats=_norm_stats(),
                dtype=cdtype,
            )
            _write_norm_probes(self, st)
        return y


_NORM_KINDS = (("output", "norm_output"), ("inv_std", "norm_inv_std"), ("input_rms", "norm_input"))


def _norm_stats() -> tuple[str, ...]:
    """The statistics a norm op computes for the probe kinds on in this trace."""
    return tuple(s for s, kind in _NORM_KINDS if probe_enabled(kind))


def _write_norm_probes(norm, st) -> None:
    """A norm site's probes, from the op: its output's sampled rows, its inverse std and its
    input's row scale."""
    _write_if(norm.probe_output, st, "output", "norm_output")
    _write_if(norm.probe_inv_std, st, "inv_std", "norm_inv_std")
    _write_if(norm.probe_input, st, "input_rms", "norm_input")


class RMSNorm(_Site):
    """``nnx.RMSNorm`` (last axis) as a site, through ``ops.rms_norm``; probes as LayerNorm."""

    probe_kinds = MappingProxyType(
        {
            "probe_output": "norm_output",
            "probe_inv_std": "norm_inv_std",
            "probe_input": "norm_input",
        }
    )

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
        promote_dtype: Any = _promote,
        rngs: nnx.Rngs,
        scale_metadata: Mapping[str, Any] = MappingProxyType({}),
    ):
        _check_last_axis(reduction_axes, feature_axes, "RMSNorm")
        if axis_name is not None:
            raise ValueError("RMSNorm: cross-device statistics (axis_name) are not supported")
        del axis_index_groups
        self.scale = (
            nnx.Param(scale_init(rngs.params(), (num_features,), param_dtype), **scale_metadata)
            if use_scale
            else nnx.data(None)
        )
        self.num_features, self.epsilon = num_features, epsilon
        self.dtype, self.param_dtype, self.use_scale = dtype, param_dtype, use_scale
        self.reduction_axes, self.feature_axes = reduction_axes, feature_axes
        self.use_fast_variance, self.promote_dtype = use_fast_variance, promote_dtype
        self._init_site()
        self.probe_output = _new_probe()
        self.probe_inv_std = _new_probe()
        self.probe_input = _new_probe()

    def __call__(self, x: jax.Array, mask: jax.Array | None = None) -> jax.Array:
        with self._scope():
            if self.promote_dtype is _promote:
                x, scale, _, cdtype = _promoted(_promote, x, _value(self.scale), None, self.dtype)
            else:  # a custom one gets the pair flax's RMSNorm gives it
                x, scale = self.promote_dtype(
                    (jnp.asarray(x), _value(self.scale)), dtype=self.dtype
                )
                cdtype = None
            y, st = ops.rms_norm(
                x,
                scale,
                self.epsilon,
                gear=self._gear(),
                mask=mask,
                use_fast_variance=self.use_fast_variance,
                return_stats=True,
                stats=_norm_stats(),
                dtype=cdtype,
            )
            _write_norm_probes(self, st)
        return y


class BatchNorm(_Site, nnx.BatchNorm):
    """``nnx.BatchNorm`` as a site (a subclass: flax's constructor, attributes and variables),
    through ``ops.batch_norm``.

    FAST is flax's math (``promote_dtype`` of the input, running statistics and affine
    parameters; statistics in f32; ``use_fast_variance``; ``mask=``), and the running
    averages ``mean`` / ``var`` (``nnx.BatchStat``) are updated in training as flax updates
    them, from their stored values. Probes, per feature: ``probe_inv_std`` (``1/sqrt(var +
    eps)``: rises as a feature's variance collapses) and ``probe_input`` (``sqrt(E[x²])`` in the
    compute dtype: rises as the activations grow); in inference, of the running averages.
    ``use_running_average`` is an attribute, as flax's (``nnx.view(model,
    use_running_average=True)`` and ``model.eval()`` set it). Cross-device statistics
    (``axis_name``, for ``pmap`` or ``shard_map``) are not supported (a ValueError): under
    ``jit`` with sharding the statistics are global. A custom ``promote_dtype`` gives its
    input, scale and bias to every gear, and the output is in the input's promoted dtype.
    """

    probe_kinds = MappingProxyType({"probe_inv_std": "norm_inv_std", "probe_input": "norm_input"})

    def __init__(self, *args, **kwargs):
        if kwargs.get("axis_name") is not None:
            raise ValueError(
                "BatchNorm: cross-device statistics (axis_name) are not supported; under jit "
                "with sharding the batch statistics are global already"
            )
        super().__init__(*args, **kwargs)
        self._init_site()
        self.probe_inv_std = _new_probe()
        self.probe_input = _new_probe()

    def __call__(
        self,
        x: jax.Array,
        use_running_average: bool | None = None,
        *,
        mask: jax.Array | None = None,
    ) -> jax.Array:
        running = _first_from(
            use_running_average,
            self.use_running_average,
            error_msg="BatchNorm: no use_running_average, neither given nor set on the layer",
        )
        with self._scope():
            x, mean, var = jnp.asarray(x), _read(self.mean), _read(self.var)
            scale, bias = _value(self.scale), _value(self.bias)
            if self.promote_dtype is _promote:  # each gear casts (SAFE: to f32, from these)
                cdtype = flax_dtypes.canonicalize_dtype(x, mean, var, scale, bias, dtype=self.dtype)
            else:  # a custom one promotes the operands; the running averages stay as stored
                x, _, _, scale, bias = self.promote_dtype(
                    (x, mean, var, scale, bias), dtype=self.dtype
                )
                cdtype = x.dtype
            y, (new_mean, new_var), st = ops.batch_norm(
                x,
                scale,
                bias,
                mean,
                var,
                self.epsilon,
                gear=self._gear(),
                axis=self.axis,
                momentum=self.momentum,
                use_running_average=running,
                mask=mask,
                use_fast_variance=self.use_fast_variance,
                return_stats=True,
                stats=tuple(s for s, kind in _BATCH_NORM_KINDS if probe_enabled(kind)),
                dtype=cdtype,
            )
            if not running:
                self.mean[...] = new_mean
                self.var[...] = new_var
            _write_if(self.probe_inv_std, st, "inv_std", "norm_inv_std")
            _write_if(self.probe_input, st, "input_rms", "norm_input")
        return y


_BATCH_NORM_KINDS = (("inv_std", "norm_inv_std"), ("input_rms", "norm_input"))


def _first_from(*args, error_msg: str):
    for a in args:
        if a is not None:
            return a
    raise ValueError(error_msg)


class MultiHeadAttention(_Site):
    """``nnx.MultiHeadAttention`` as a site; the core runs through ``ops.attention``.

    Constructor, call arguments, parameter tree (``query``/``key``/``value`` kernels
    ``[in, heads, head_dim]`` with biases ``[heads, head_dim]``, ``out`` kernel
    ``[heads, head_dim, out]``), initialisation order, KV cache (``decode``, ``init_cache``,
    ``cached_key``/``cached_value``/``cache_index``), dropout (``rngs``, ``keep_rngs``),
    grouped-query attention (``num_kv_heads``), ``sow_weights`` and the metadata arguments
    are flax's, so a flax state loads into it and back. At FAST it computes what flax does:
    ``jax.nn.dot_product_attention``'s math, or flax's explicit attention weights when
    dropout is configured or ``sow_weights`` is set (see ``ops.attention``). Its projections
    are ``LinearGeneral`` sites and ``query_ln``/``key_ln`` are ``LayerNorm`` sites.
    Differences: a custom ``attention_fn`` or ``dot_general`` raises (the gears own the core),
    and ``out_sharding``/``qkv_sharding`` are not supported.

    Probes: ``probe_logits`` (stats of every query row's max attended logit) and
    ``probe_probs`` (stats of every row's max probability). Knob: ``qk_scale`` multiplies the
    logits (1.0 changes no bit).
    """

    probe_kinds = MappingProxyType({"probe_logits": "attn_logits", "probe_probs": "attn_probs"})

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
        qkv_promote_dtype: Any = _promote,
        out_promote_dtype: Any = _promote,
        ln_promote_dtype: Any = _promote,
        qkv_dot_general: Any = None,
        out_dot_general: Any = None,
        qkv_dot_general_cls: Any = None,
        out_dot_general_cls: Any = None,
        rngs: nnx.Rngs,
        keep_rngs: bool = True,
        kernel_metadata: Mapping[str, Any] = MappingProxyType({}),
        out_kernel_metadata: Mapping[str, Any] = MappingProxyType({}),
        bias_metadata: Mapping[str, Any] = MappingProxyType({}),
        out_bias_metadata: Mapping[str, Any] = MappingProxyType({}),
        query_ln_scale_metadata: Mapping[str, Any] = MappingProxyType({}),
        key_ln_scale_metadata: Mapping[str, Any] = MappingProxyType({}),
    ):
        if attention_fn not in (None, flax_attention.dot_product_attention):
            raise ValueError(
                "MultiHeadAttention: the attention core is ops.attention (gear-switched); a "
                "custom attention_fn is not supported"
            )
        self.num_heads, self.in_features = num_heads, in_features
        self.qkv_features = in_features if qkv_features is None else qkv_features
        self.out_features = in_features if out_features is None else out_features
        self.in_kv_features = in_features if in_kv_features is None else in_kv_features
        self.num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"MultiHeadAttention: num_heads ({num_heads}) must be divisible by "
                f"num_kv_heads ({self.num_kv_heads})"
            )
        if self.qkv_features % num_heads:
            raise ValueError(
                f"MultiHeadAttention: qkv_features ({self.qkv_features}) must be divisible by "
                f"num_heads ({num_heads})"
            )
        self.dtype, self.param_dtype, self.precision = dtype, param_dtype, precision
        self.broadcast_dropout, self.dropout_rate = broadcast_dropout, dropout_rate
        self.deterministic, self.use_bias = deterministic, use_bias
        self.decode, self.normalize_qk = decode, normalize_qk
        self.head_dim = self.qkv_features // num_heads
        lin = dict(
            dtype=dtype,
            param_dtype=param_dtype,
            kernel_init=kernel_init,
            bias_init=bias_init,
            use_bias=use_bias,
            precision=precision,
            promote_dtype=qkv_promote_dtype,
            dot_general=qkv_dot_general,
            dot_general_cls=qkv_dot_general_cls,
            kernel_metadata=kernel_metadata,
            bias_metadata=bias_metadata,
            rngs=rngs,
        )
        kv_out = (self.num_kv_heads, self.head_dim)
        self.query = LinearGeneral(in_features, (num_heads, self.head_dim), **lin)
        self.key = LinearGeneral(self.in_kv_features, kv_out, **lin)
        self.value = LinearGeneral(self.in_kv_features, kv_out, **lin)
        if normalize_qk:
            ln = dict(
                use_bias=False,
                dtype=dtype,
                param_dtype=param_dtype,
                promote_dtype=ln_promote_dtype,
                rngs=rngs,
            )
            self.query_ln = LayerNorm(self.head_dim, scale_metadata=query_ln_scale_metadata, **ln)
            self.key_ln = LayerNorm(self.head_dim, scale_metadata=key_ln_scale_metadata, **ln)
        else:
            self.query_ln = nnx.data(None)
            self.key_ln = nnx.data(None)
        self.out = LinearGeneral(
            (num_heads, self.head_dim),
            self.out_features,
            axis=(-2, -1),
            kernel_init=out_kernel_init or kernel_init,
            bias_init=out_bias_init or bias_init,
            use_bias=use_bias,
            dtype=dtype,
            param_dtype=param_dtype,
            precision=precision,
            promote_dtype=out_promote_dtype,
            dot_general=out_dot_general,
            dot_general_cls=out_dot_general_cls,
            rngs=rngs,
            kernel_metadata=out_kernel_metadata or kernel_metadata,
            bias_metadata=out_bias_metadata or bias_metadata,
        )
        self.rngs = rngs.dropout.fork() if keep_rngs and dropout_rate > 0 else None
        self.cached_key = nnx.data(None)
        self.cached_value = nnx.data(None)
        self.cache_index = nnx.data(None)
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
        out_sharding: Any = None,
        qkv_sharding: Any = None,
    ) -> jax.Array:
        """flax's ``MultiHeadAttention.__call__`` (same arguments, same rules).

        Args:
          inputs_q: ``[batch..., q_len, features]``.
          inputs_k, inputs_v: default ``inputs_q`` / ``inputs_k`` (self-attention).
          mask: broadcastable to ``[batch..., num_heads, q_len, kv_len]``; nonzero = attend.
          deterministic, rngs: dropout control (call arguments take precedence).
          sow_weights: sow the attention weights into ``nnx.Intermediate``.
          decode: use the KV cache (``init_cache`` first; one token per call).
          is_causal: overlay ``tril(ones(q_len, kv_len))``.

        Returns:
          ``[batch..., q_len, out_features]``.
        """
        _no_sharding("MultiHeadAttention", out_sharding)
        _no_sharding("MultiHeadAttention", qkv_sharding)
        if rngs is None:
            rngs = self.rngs
        elif isinstance(rngs, nnx.Rngs):
            rngs = rngs.dropout
        if inputs_k is None:
            if inputs_v is not None:
                raise ValueError(
                    "MultiHeadAttention: inputs_k cannot be None if inputs_v is not None"
                )
            inputs_k = inputs_q
        if inputs_v is None:
            inputs_v = inputs_k
        if inputs_q.shape[-1] != self.in_features:
            raise ValueError(
                f"MultiHeadAttention: incompatible input dimension, got {inputs_q.shape[-1]} "
                f"but the module expects {self.in_features}"
            )
        with self._scope():
            query = self.query(inputs_q)
            key = self.key(inputs_k)
            value = self.value(inputs_v)
            if self.normalize_qk:
                query, key = self.query_ln(query), self.key_ln(key)
            # flax raises when decode is set nowhere; None means False here (a superset)
            decode = bool(_first_from(decode, self.decode, False, error_msg=""))
            if decode:
                key, value, mask = self._update_cache(key, value, mask)
            dropout_rng, deterministic = self._dropout_rng(deterministic, rngs)
            y = self._attend(
                query, key, value, mask, dropout_rng, deterministic, sow_weights, is_causal
            )
            return self.out(y)

    def _update_cache(self, key, value, mask):
        if self.cached_key is None or self.cached_value is None or self.cache_index is None:
            raise ValueError("Autoregressive cache not initialized, call ``init_cache`` first.")
        *batch_dims, max_length, num_kv_heads, depth = self.cached_key.shape
        expected = tuple(batch_dims) + (1, num_kv_heads, depth)
        if expected != key.shape:
            raise ValueError(
                f"Autoregressive cache shape error, expected key shape {expected} instead got "
                f"{key.shape}."
            )
        cur = self.cache_index[...]
        zero = jnp.array(0, dtype=lax.dtype(cur.dtype))
        idx = (zero,) * len(batch_dims) + (cur, zero, zero)
        key = lax.dynamic_update_slice(self.cached_key[...], key, idx)
        value = lax.dynamic_update_slice(self.cached_value[...], value, idx)
        self.cached_key[...] = key
        self.cached_value[...] = value
        self.cache_index[...] += 1
        seen = jnp.broadcast_to(
            jnp.arange(max_length) <= cur, tuple(batch_dims) + (1, 1, max_length)
        )
        return key, value, nnx.combine_masks(mask, seen)

    def _dropout_rng(self, deterministic, rngs):
        if self.dropout_rate > 0.0:
            deterministic = _first_from(
                deterministic,
                self.deterministic,
                error_msg="MultiHeadAttention: no deterministic argument in __call__ or the "
                "module (needed with dropout_rate > 0)",
            )
            if not deterministic:
                if rngs is None:
                    raise ValueError(
                        "'rngs' must be provided to __call__ method if MultiHeadAttention "
                        "instance is defined with keep_rngs=False."
                    )
                return rngs(), deterministic
            return None, deterministic
        return None, True

    def _attend(self, query, key, value, mask, dropout_rng, deterministic, sow_weights, is_causal):
        query, key, value = self.qkv_promote(query, key, value)
        dtype = query.dtype
        batch = query.shape[:-3]
        q_len, kv_len = query.shape[-3], key.shape[-3]
        flat = lambda a: jnp.reshape(a, (math.prod(batch),) + a.shape[-3:])  # noqa: E731
        q4, k4, v4 = flat(query), flat(key), flat(value)
        m4 = None
        if mask is not None:
            nb = len(batch)
            mask = jnp.asarray(mask)
            if mask.ndim > nb + 3:
                raise ValueError(
                    f"MultiHeadAttention: mask {mask.shape} does not broadcast to "
                    f"[batch..., heads, q_len, kv_len] = {batch + (self.num_heads, q_len, kv_len)}"
                )
            mask = jnp.reshape(mask, (1,) * (nb + 3 - mask.ndim) + mask.shape)
            if math.prod(mask.shape[:nb]) != 1:
                mask = jnp.broadcast_to(mask, batch + mask.shape[nb:])
            m4 = jnp.reshape(mask, (-1,) + mask.shape[nb:])
        explicit = self.dropout_rate != 0.0 or sow_weights
        mult = None
        if not deterministic and self.dropout_rate > 0.0:
            keep_prob = 1.0 - self.dropout_rate
            ndim_base = key.ndim
            if self.broadcast_dropout:
                shape = (1,) * (ndim_base - 2) + (q_len, kv_len)
            else:
                shape = batch + (self.num_heads, q_len, kv_len)
            keep = jax.random.bernoulli(dropout_rng, keep_prob, shape)
            mult = keep.astype(dtype) / jnp.asarray(keep_prob, dtype=dtype)
            mult = jnp.reshape(mult, (-1,) + mult.shape[-3:])
        res = ops.attention(
            q4,
            k4,
            v4,
            mask=m4,
            causal=is_causal,
            gear=self._gear(),
            logit_scale=_read(self.qk_scale),
            explicit=explicit,
            dropout_multiplier=mult,
            precision=self.precision,
            return_stats=True,
            return_weights=sow_weights,
            stats=tuple(
                s
                for s, k in (("logits", "attn_logits"), ("probs", "attn_probs"))
                if probe_enabled(k)
            ),
        )
        y, st = res[0], res[1]
        _write_if(self.probe_logits, st, "logits", "attn_logits")
        _write_if(self.probe_probs, st, "probs", "attn_probs")
        if sow_weights:
            w = res[2]
            self.sow(nnx.Intermediate, "attention_weights", jnp.reshape(w, batch + w.shape[1:]))
        return jnp.reshape(y, batch + y.shape[1:])

    def qkv_promote(self, query, key, value):
        """flax's ``promote_dtype((query, key, value), dtype=self.dtype)`` of the core."""
        return _promote((query, key, value), dtype=self.dtype)

    def init_cache(self, input_shape: Any, dtype: Any = jnp.float32) -> None:
        """Creates the KV cache for ``decode=True`` (flax's ``init_cache``): one token per call.

        Args:
          input_shape: ``[batch..., max_length, features]``.
          dtype: the cache's dtype.
        """
        cache_shape = (*input_shape[:-1], self.num_kv_heads, self.head_dim)
        self.cached_key = nnx.Cache(jnp.zeros(cache_shape, dtype))
        self.cached_value = nnx.Cache(jnp.zeros(cache_shape, dtype))
        self.cache_index = nnx.Cache(jnp.array(0, dtype=jnp.int32))

    def set_view(
        self,
        deterministic: bool | None = None,
        decode: bool | None = None,
        batch_size: Any = None,
        max_length: int | None = None,
    ) -> None:
        """flax's ``set_view``: sets ``deterministic`` / ``decode``; creates the cache if needed."""
        if deterministic is not None:
            self.deterministic = deterministic
        if decode is not None:
            self.decode = decode
            if self.cached_key is None or self.cached_value is None or self.cache_index is None:
                if batch_size is None:
                    raise TypeError("'batch_size' must be provided when initializing cache.")
                if max_length is None:
                    raise TypeError("'max_length' must be provided when initializing cache.")
                if isinstance(batch_size, int):
                    batch_size = (batch_size,)
                shape = (*batch_size, max_length, self.num_kv_heads, self.head_dim)
                self.cached_key = nnx.Cache(jnp.zeros(shape, self.dtype))
                self.cached_value = nnx.Cache(jnp.zeros(shape, self.dtype))
                self.cache_index = nnx.Cache(jnp.array(0, dtype=jnp.int32))


class Router(_Site):
    """MoE top-k gate as a site: scores ``x @ kernel`` → softmax → top-k → renormalise.

    ``Router(in_features, num_experts, top_k, *, rngs)``; parameter ``kernel
    [in_features, num_experts]``. Returns ``ops.Routing(gates, indices, probs)``.
    Probe: ``probe_logits`` (stats of the scores). Knob: ``logit_scale`` multiplies the kernel
    (growing router weights: the write-up's fp16 router overflow).
    """

    probe_kinds = MappingProxyType({"probe_logits": "router_logits"})

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
        with self._scope():
            x = jnp.asarray(x)
            x = x.astype(_compute_dtype(x, self.dtype, kernel))
            kernel = kernel * _read(self.logit_scale).astype(kernel.dtype)
            r, st = ops.router(x, kernel, self.top_k, gear=self._gear(), return_stats=True)
            _write_if(self.probe_logits, st, "logits", "router_logits")
        return r


class CrossEntropy(_Site):
    """The loss as a site: mean next-token cross-entropy through ``ops.cross_entropy`` (f32).

    Not a ``flax.nnx`` module (flax has none); it gives the loss its own gear and name so the
    localizer and the gear state treat it like any other site. FAST computes what a flax user's
    loss does, bit for bit: ``optax.softmax_cross_entropy_with_integer_labels``, then the mean
    over the (masked) tokens in f32. Probe: ``probe_logits``.
    """

    probe_kinds = MappingProxyType({"probe_logits": "loss_logits"})

    def __init__(self, *, rngs: nnx.Rngs | None = None):
        del rngs
        self._init_site()
        self.probe_logits = _new_probe()

    def __call__(
        self, logits: jax.Array, labels: jax.Array, mask: jax.Array | None = None
    ) -> jax.Array:
        with self._scope():
            if probe_enabled("loss_logits"):
                _write(self.probe_logits, sampled_stats(logits))
            return ops.cross_entropy(logits, labels, self._gear(), mask=mask)


# --- adopting existing flax.nnx models (nan2safe_jax.convert) and user-code sites -------------
# Imported last: those modules build on the classes above.
from nan2safe_jax.convert import ConvertReport, convert  # noqa: E402
from nan2safe_jax.user_site import Site  # noqa: E402

__all__ += ["ConvertReport", "Site", "convert"]
