"""A small decoder-only transformer (dense or MoE), on stock ``flax.nnx`` layers or on
``nan2safe_jax.nn`` sites.

Demo / benchmark size (``TransformerConfig()``): 4 layers, d_model 256, 4 heads, seq 128,
vocab 256 (char-level), batch 8.

    from examples.transformer import Transformer, TransformerConfig, lm_loss
    model = Transformer(TransformerConfig(dtype=jnp.float16, scan_layers=True), rngs=nnx.Rngs(0))
    loss = lm_loss(model, {"tokens": tokens, "mask": mask})   # mask: True = real token

``layers`` picks the layer set, the one switch between the arms of the demo and the fault zoo:
``"flax"`` is what a user has (``nnx.Linear``, ``nnx.Embed``, ``nnx.LayerNorm``/``RMSNorm``,
``nnx.MultiHeadAttention``, a hand-written MoE router and optax's cross-entropy); ``"nan2safe"``
swaps in the ``nan2safe.nn`` counterparts, every one a site with its own gear and probes
(``nan2safe_jax.site.name_sites(model)`` names them by path, e.g. ``blocks.attn``; with
``scan_layers`` a block's sites are stacked ``[num_layers]``). Both build the same parameter
tree from the same seed, and at FAST both compute the same thing; the model's own code (below)
is identical in both.

``attention="user"`` replaces ``MultiHeadAttention`` by ``UserAttention``: attention written by
hand in the model's own code, as many GPT implementations do (fp16 logits, masked logits filled
with ``-inf``). That formulation is fragile where flax's is not (a fully masked row is
``-inf - -inf = NaN``); it is user code, so it is the same in both layer sets (its projections are
the layer set's ``LinearGeneral``). ``attention="user_site"`` is what a user does after tier 2
named that core: on nan2safe layers the core becomes ``nan2safe.nn.Site(user_attention_core,
safe=user_attention_core_safe)``, a site of its own (``blocks.N.attn.core``, no parameters) that
SAFE can repair; on flax layers it stays the plain function.

Fault injection without editing the model (``Knob`` variables of the model's own code; data:
changing them never recompiles):
- ``set_knob(model, "qk_gain", 300.0, layer=1)``: multiplies the q·k logits of one layer (a head
  whose q/k norms blow up): the attention's query and key inputs are scaled by its square root;
  in fp16 the logits overflow past 65504 wherever they are kept in fp16 (flax's explicit
  attention path, taken when dropout is configured, or ``UserAttention``);
- ``set_knob(model, "logit_scale", 1e4)``: multiplies the router kernel of every MoE block
  (growing router weights: fp16 scores overflow through the router's two softmaxes);
- ``set_knob(model, "head_scale", 1e3)``: multiplies the LM logits (huge logits into the loss);
- ``set_knob(model, "embed_scale", 1e4)``: multiplies the embeddings entering the residual
  stream (activations that grow until an fp16 residual add overflows).
``set_knob`` also sets a ``nan2safe.nn`` site's own knobs (``qk_scale`` of its attention).
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from nan2safe_jax import nn
from nan2safe_jax import ops as nan2safe_ops
from nan2safe_jax.gear import Gear

__all__ = [
    "Block",
    "Knob",
    "MLP",
    "MoE",
    "Transformer",
    "TransformerConfig",
    "UserAttention",
    "UserRouter",
    "attention_mask",
    "lm_loss",
    "make_batch",
    "set_knob",
]


class Knob(nnx.Variable):
    """A non-trainable f32 multiplier (1.0 by default) for fault injection; data, not code."""


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
    """Model options. ``dtype`` is the compute dtype; parameters are ``param_dtype`` (f32)."""

    num_layers: int = 4
    d_model: int = 256
    num_heads: int = 4
    seq_len: int = 128
    vocab: int = 256
    d_ff: int | None = None  # default 4 * d_model
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32
    scan_layers: bool = False  # blocks built with nnx.vmap, run with nnx.scan
    remat: bool = False  # nnx.remat around each block
    norm: str = "layer"  # "layer" or "rms"
    num_experts: int = 0  # > 0: an MoE MLP with a Router in every block
    top_k: int = 2
    epsilon: float = 1e-6
    # "self": a query always sees itself, so padding never makes a fully-masked row.
    # "keys": the common key-padding mask alone; with causal attention and left padding a
    # padding query sees only padding keys: its row is fully masked (finite in flax's attention,
    # which fills with the dtype's minimum; NaN in UserAttention's -inf fill).
    pad_mask: str = "self"
    # > 0: the attention is configured with dropout, as many GPT-style configs are. flax.nnx then
    # takes its explicit-weights path (q / sqrt(d), logits kept in the compute dtype, here fp16)
    # even when run deterministic, so growing q·k logits overflow fp16 in a stock flax.nnx model
    # (and in nan2safe.nn at FAST). The blocks run deterministic (no dropout masks drawn): all
    # arms see identical numerics.
    attn_dropout: float = 0.0
    layers: str = "nan2safe"  # "flax": stock flax.nnx layers; "nan2safe": nan2safe.nn sites
    # "mha": the layer set's MultiHeadAttention; "user": UserAttention; "user_site": UserAttention
    # whose core is a ``nan2safe.nn.Site`` on nan2safe layers (what an incident in the hand-written
    # core suggests; the same plain function on flax layers)
    attention: str = "mha"
    # The fault-injection ``Knob``s (``qk_gain``, ``head_scale``, ``embed_scale``); False builds
    # the model without them (``set_knob`` then finds none): the math of a plain flax twin, for
    # benchmarks that compare the two (a knob is a multiply by a runtime scalar, in every kernel
    # that reads the value it scales).
    knobs: bool = True

    def __post_init__(self):
        for name in ("num_layers", "d_model", "num_heads", "seq_len", "vocab"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)!r}")
        if self.d_model % self.num_heads:
            raise ValueError(
                f"d_model ({self.d_model}) must be divisible by num_heads ({self.num_heads})"
            )
        if not 0.0 <= self.attn_dropout < 1.0:
            raise ValueError(f"attn_dropout must be in [0, 1), got {self.attn_dropout!r}")
        if self.pad_mask not in ("self", "keys"):
            raise ValueError(f"pad_mask must be 'self' or 'keys', got {self.pad_mask!r}")
        if self.layers not in ("flax", "nan2safe"):
            raise ValueError(f"layers must be 'flax' or 'nan2safe', got {self.layers!r}")
        if self.attention not in ("mha", "user", "user_site"):
            raise ValueError(
                f"attention must be 'mha', 'user' or 'user_site', got {self.attention!r}"
            )
        if self.norm not in ("layer", "rms"):
            raise ValueError(f"norm must be 'layer' or 'rms', got {self.norm!r}")
        if self.num_experts and not 1 <= self.top_k <= self.num_experts:
            raise ValueError(
                f"top_k must be in [1, num_experts={self.num_experts}], got {self.top_k}"
            )
        dts = (jnp.float32, jnp.bfloat16, jnp.float16)
        if jnp.dtype(self.dtype) not in [jnp.dtype(d) for d in dts]:
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {self.dtype!r}")

    @property
    def ff(self) -> int:
        return self.d_ff or 4 * self.d_model


def _lib(cfg: TransformerConfig):
    """The layer set: the ``flax.nnx`` module or ``nan2safe_jax.nn`` (same names, same API)."""
    return nnx if cfg.layers == "flax" else nn


def _norm(cfg: TransformerConfig, rngs: nnx.Rngs):
    lib = _lib(cfg)
    kw = dict(epsilon=cfg.epsilon, dtype=cfg.dtype, param_dtype=cfg.param_dtype, rngs=rngs)
    norm = lib.LayerNorm if cfg.norm == "layer" else lib.RMSNorm
    return norm(cfg.d_model, **kw)


class MLP(nnx.Module):
    """``Linear(d, ff) -> gelu -> Linear(ff, d)``."""

    def __init__(self, cfg: TransformerConfig, *, rngs: nnx.Rngs):
        kw = dict(dtype=cfg.dtype, param_dtype=cfg.param_dtype, rngs=rngs)
        self.fc1 = _lib(cfg).Linear(cfg.d_model, cfg.ff, **kw)
        self.fc2 = _lib(cfg).Linear(cfg.ff, cfg.d_model, **kw)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.fc2(jax.nn.gelu(self.fc1(x)))


class Routing(NamedTuple):
    """``UserRouter``'s output (the fields of ``nan2safe.ops.Routing``)."""

    gates: jax.Array  # [..., top_k] renormalised weights of the chosen experts
    indices: jax.Array  # i32[..., top_k] chosen experts, best first
    probs: jax.Array  # [..., num_experts] the first softmax


class UserRouter(nnx.Module):
    """The MoE top-k gate a flax user writes (flax has none): ``x @ kernel`` -> softmax ->
    top-k -> renormalise, in the compute dtype (the write-up's router; ``nn.Router`` at FAST).

    Parameter ``kernel [in_features, num_experts]`` (``nn.Router``'s). Knob ``logit_scale``
    multiplies the kernel (growing router weights).
    """

    def __init__(self, in_features, num_experts, top_k, *, dtype, param_dtype, rngs):
        init = nnx.initializers.lecun_normal()
        self.kernel = nnx.Param(init(rngs.params(), (in_features, num_experts), param_dtype))
        self.top_k, self.dtype = top_k, dtype
        self.logit_scale = Knob(jnp.ones((), jnp.float32))

    def __call__(self, x: jax.Array) -> Routing:
        kernel = self.kernel[...] * self.logit_scale[...].astype(self.kernel.dtype)
        x = x.astype(self.dtype)
        logits = jax.lax.dot_general(x, kernel.astype(x.dtype), (((x.ndim - 1,), (0,)), ((), ())))
        probs = jax.nn.softmax(logits, axis=-1)
        top_p, idx = jax.lax.top_k(probs, self.top_k)
        gates = top_p / jnp.sum(top_p, axis=-1, keepdims=True)
        return Routing(gates, idx.astype(jnp.int32), probs)


class MoE(nnx.Module):
    """Top-k mixture of ``MLP`` experts behind a router (``nn.Router``, or ``UserRouter`` on
    flax layers; dense dispatch: every expert runs on every token and the router's gates weight
    the chosen ones; fine at demo size)."""

    def __init__(self, cfg: TransformerConfig, *, rngs: nnx.Rngs):
        router = nn.Router if cfg.layers == "nan2safe" else UserRouter
        self.router = router(
            cfg.d_model,
            cfg.num_experts,
            cfg.top_k,
            dtype=cfg.dtype,
            param_dtype=cfg.param_dtype,
            rngs=rngs,
        )
        self.experts = nnx.List([MLP(cfg, rngs=rngs) for _ in range(cfg.num_experts)])

    def __call__(self, x: jax.Array) -> jax.Array:
        r = self.router(x)
        n = len(self.experts)
        combine = jnp.sum(r.gates[..., None] * jax.nn.one_hot(r.indices, n, dtype=x.dtype), -2)
        y = jnp.zeros_like(x)
        for e, expert in enumerate(self.experts):
            y = y + expert(x) * combine[..., e : e + 1]
        return y


class UserAttention(nnx.Module):
    """Causal self-attention written by hand, as many GPT implementations do.

    The parameter tree of ``MultiHeadAttention`` (``query``/``key``/``value``/``out``
    ``LinearGeneral`` projections of the layer set), but its own core: ``q / sqrt(d)``, the
    logits in the compute dtype, masked logits filled with ``-inf``, ``jax.nn.softmax``. A row
    with no visible key is then ``-inf - -inf = NaN`` (flax fills with the dtype's minimum
    instead and gives such a row a finite output), and fp16 logits past 65504 are inf.
    """

    def __init__(self, cfg: TransformerConfig, *, rngs: nnx.Rngs):
        lib = _lib(cfg)
        self.head_dim = cfg.d_model // cfg.num_heads
        kw = dict(dtype=cfg.dtype, param_dtype=cfg.param_dtype, rngs=rngs)
        proj = (cfg.num_heads, self.head_dim)
        self.query = lib.LinearGeneral(cfg.d_model, proj, **kw)
        self.key = lib.LinearGeneral(cfg.d_model, proj, **kw)
        self.value = lib.LinearGeneral(cfg.d_model, proj, **kw)
        self.out = lib.LinearGeneral(proj, cfg.d_model, axis=(-2, -1), **kw)
        site = cfg.attention == "user_site" and cfg.layers == "nan2safe"
        self.core = nn.Site(user_attention_core, safe=user_attention_core_safe) if site else None

    def __call__(
        self,
        inputs_q: jax.Array,
        inputs_k: jax.Array,
        inputs_v: jax.Array,
        *,
        mask: jax.Array | None = None,
    ) -> jax.Array:
        """``MultiHeadAttention``'s call (``[batch, T, d]`` in and out; ``mask`` True = see)."""
        q, k, v = self.query(inputs_q), self.key(inputs_k), self.value(inputs_v)
        q = q / jnp.sqrt(self.head_dim).astype(q.dtype)
        if self.core is None:
            return self.out(user_attention_core(q, k, v, mask))
        return self.out(self.core(q, k, v, mask))


def user_attention_core(q, k, v, mask=None):
    """``UserAttention``'s core as written: logits, ``-inf`` fill, ``jax.nn.softmax``, values."""
    logits = jnp.einsum("...qhd,...khd->...hqk", q, k)
    if mask is not None:
        logits = jnp.where(mask, logits, -jnp.inf)
    weights = jax.nn.softmax(logits, axis=-1)
    return jnp.einsum("...hqk,...khd->...qhd", weights, v)


def user_attention_core_safe(q, k, v, mask=None):
    """The core's SAFE path: f32 logits and ``nan2safe.ops.softmax`` at SAFE, so a fully masked
    row gives zeros (with finite gradients) instead of ``-inf - -inf = NaN``."""
    logits = jnp.einsum("...qhd,...khd->...hqk", q.astype(jnp.float32), k.astype(jnp.float32))
    weights = nan2safe_ops.softmax(logits, axis=-1, where=mask, gear=Gear.SAFE)
    out = jnp.einsum("...hqk,...khd->...qhd", weights, v.astype(jnp.float32))
    return out.astype(v.dtype)


class Block(nnx.Module):
    """Pre-norm decoder block: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``.

    Knob ``qk_gain`` multiplies the layer's q·k logits: the attention's query and key inputs
    are scaled by its square root (1.0 changes no bit).
    """

    def __init__(self, cfg: TransformerConfig, *, rngs: nnx.Rngs):
        self.ln1 = _norm(cfg, rngs)
        if cfg.attention in ("user", "user_site"):
            self.attn = UserAttention(cfg, rngs=rngs)
        else:
            self.attn = _lib(cfg).MultiHeadAttention(
                cfg.num_heads,
                cfg.d_model,
                dtype=cfg.dtype,
                param_dtype=cfg.param_dtype,
                dropout_rate=cfg.attn_dropout,
                deterministic=True,
                decode=False,
                rngs=rngs,
            )
        self.ln2 = _norm(cfg, rngs)
        self.mlp = MoE(cfg, rngs=rngs) if cfg.num_experts else MLP(cfg, rngs=rngs)
        self.qk_gain = Knob(jnp.ones((), jnp.float32)) if cfg.knobs else None

    def __call__(self, x: jax.Array, mask: jax.Array) -> jax.Array:
        h = self.ln1(x)
        if self.qk_gain is None:
            x = x + self.attn(h, h, h, mask=mask)
        else:
            qk = h * jnp.sqrt(self.qk_gain[...]).astype(h.dtype)
            x = x + self.attn(qk, qk, h, mask=mask)
        return x + self.mlp(self.ln2(x))


def attention_mask(
    mask: jax.Array | None, pad_mask: str = "self", seq_len: int | None = None
) -> jax.Array:
    """Padding mask ``bool[B, T]`` (True = real) -> causal attention mask ``bool[B, 1, T, T]``.

    Keys that are padding are masked. With ``pad_mask="self"`` every query also sees itself,
    so no row is fully masked. With ``pad_mask="keys"`` only keys are masked: under the causal
    mask a left-padded sequence then has fully-masked rows (finite in flax's attention, NaN in
    ``UserAttention``). The causal part is in the mask itself (``bool[1, 1, T, T]`` when ``mask``
    is None, then ``seq_len`` is needed): flax's explicit attention path cannot broadcast its
    own ``is_causal`` mask against a ``[B, 1, 1, T]`` padding mask.
    """
    t = seq_len if mask is None else mask.shape[-1]
    causal = jnp.tril(jnp.ones((t, t), bool))[None, None]
    if mask is None:
        return causal
    mask = jnp.asarray(mask, bool)
    keys = mask[:, None, None, :]
    if pad_mask == "self":
        keys = keys | jnp.eye(t, dtype=bool)[None, None]
    return keys & causal


class OptaxCrossEntropy(nnx.Module):
    """The loss a flax user writes: ``optax.softmax_cross_entropy_with_integer_labels`` on the
    logits as they come, averaged over the real tokens in f32 (``nn.CrossEntropy``'s call)."""

    def __call__(
        self, logits: jax.Array, labels: jax.Array, mask: jax.Array | None = None
    ) -> jax.Array:
        nll = optax.softmax_cross_entropy_with_integer_labels(logits, labels).astype(jnp.float32)
        if mask is None:
            return jnp.mean(nll)
        return jnp.sum(jnp.where(mask, nll, 0.0)) / jnp.sum(mask, dtype=jnp.float32)


class Transformer(nnx.Module):
    """Decoder-only LM: token + learned position embeddings, blocks, final norm, LM head.

    Attributes (sites with ``layers="nan2safe"``): ``embed``, ``pos``, ``blocks`` (an
    ``nnx.List``, or one stacked ``Block`` with ``scan_layers``), ``norm``, ``head``, ``loss``
    (an ``nn.CrossEntropy``, or ``OptaxCrossEntropy`` on flax layers). ``head_scale`` and
    ``embed_scale`` are ``Knob``s multiplying the LM logits and the embeddings (fault injection;
    1.0 changes no bit).
    """

    def __init__(self, cfg: TransformerConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        lib = _lib(cfg)
        kw = dict(dtype=cfg.dtype, param_dtype=cfg.param_dtype, rngs=rngs)
        self.embed = lib.Embed(cfg.vocab, cfg.d_model, **kw)
        self.pos = lib.Embed(cfg.seq_len, cfg.d_model, **kw)
        if cfg.scan_layers:

            @nnx.split_rngs(splits=cfg.num_layers)
            @nnx.vmap(in_axes=(0,), out_axes=0)
            def make_blocks(rngs: nnx.Rngs) -> Block:
                return Block(cfg, rngs=rngs)

            self.blocks = make_blocks(rngs)
        else:
            self.blocks = nnx.List([Block(cfg, rngs=rngs) for _ in range(cfg.num_layers)])
        self.norm = _norm(cfg, rngs)
        self.head = lib.Linear(cfg.d_model, cfg.vocab, **kw)
        self.loss = nn.CrossEntropy() if cfg.layers == "nan2safe" else OptaxCrossEntropy()
        self.head_scale = Knob(jnp.ones((), jnp.float32)) if cfg.knobs else None
        self.embed_scale = Knob(jnp.ones((), jnp.float32)) if cfg.knobs else None

    def __call__(self, tokens: jax.Array, mask: jax.Array | None = None) -> jax.Array:
        """``tokens i32[B, T]`` (T <= seq_len), ``mask bool[B, T]`` -> logits ``[B, T, vocab]``."""
        cfg = self.cfg
        t = tokens.shape[-1]
        if t > cfg.seq_len:
            raise ValueError(f"sequence length {t} exceeds seq_len={cfg.seq_len}")
        x = self.embed(tokens) + self.pos(jnp.arange(t))
        if self.embed_scale is not None:
            # scaled in f32, so the first value to overflow is the grown activation, not the knob
            x = (x.astype(jnp.float32) * self.embed_scale[...]).astype(x.dtype)
        amask = attention_mask(mask, cfg.pad_mask, t)

        def run(block: Block, x: jax.Array, amask: jax.Array) -> jax.Array:
            return block(x, amask)

        if cfg.remat:
            run = nnx.remat(run)
        if cfg.scan_layers:

            @nnx.scan(in_axes=(0, nnx.Carry, None), out_axes=nnx.Carry)
            def scan_blocks(block: Block, x: jax.Array, amask: jax.Array) -> jax.Array:
                return run(block, x, amask)

            x = scan_blocks(self.blocks, x, amask)
        else:
            for block in self.blocks:
                x = run(block, x, amask)
        logits = self.head(self.norm(x))
        if self.head_scale is None:
            return logits
        return logits * self.head_scale[...].astype(logits.dtype)


def lm_loss(model: Transformer, batch: dict[str, jax.Array]) -> jax.Array:
    """Next-token cross-entropy (f32 scalar) through the model's ``loss`` site.

    Args:
      model: a ``Transformer``.
      batch: ``{"tokens": int32[B, T], "mask": bool[B, T]}`` (mask optional; True = real).
    """
    tokens = batch["tokens"]
    mask = batch.get("mask")
    logits = model(tokens, mask)
    target_mask = None if mask is None else mask[:, 1:]
    return model.loss(logits[:, :-1], tokens[:, 1:], target_mask)


def set_knob(model: nnx.Module, name: str, value: float, *, layer: int | None = None) -> None:
    """Sets every knob (``Knob`` or ``nn.Knob``) called ``name`` in ``model``.

    ``layer`` selects one layer of a stacked (``scan_layers``) knob, or the ``layer``-th block
    of an unstacked model; None sets all.
    """
    found = False
    for path, node in nnx.iter_graph(model):
        if not (isinstance(node, (Knob, nn.Knob)) and path and path[-1] == name):
            continue
        in_blocks = "blocks" in path
        idx = path.index("blocks") + 1 if in_blocks else None
        stacked = jnp.ndim(node[...]) > 0
        if layer is not None and in_blocks and not stacked and path[idx] != layer:
            continue
        if layer is not None and stacked:
            node[...] = node[...].at[layer].set(value)
        else:
            node[...] = jnp.full(jnp.shape(node[...]), value, jnp.float32)
        found = True
    if not found:
        raise ValueError(f"no Knob named {name!r} in the model (layer={layer!r})")


def make_batch(
    key: jax.Array, cfg: TransformerConfig, batch_size: int = 8, *, pad: bool = True
) -> dict[str, jax.Array]:
    """A random char-level batch; with ``pad``, each row is right-padded after a random length."""
    k1, k2 = jax.random.split(key)
    tokens = jax.random.randint(k1, (batch_size, cfg.seq_len), 0, cfg.vocab, dtype=jnp.int32)
    if not pad:
        return {"tokens": tokens, "mask": jnp.ones(tokens.shape, bool)}
    lengths = jax.random.randint(k2, (batch_size, 1), cfg.seq_len // 2, cfg.seq_len + 1)
    mask = jnp.arange(cfg.seq_len)[None, :] < lengths
    return {"tokens": jnp.where(mask, tokens, 0), "mask": mask}
