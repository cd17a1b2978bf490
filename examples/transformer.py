"""A small decoder-only transformer built from ``nan2safe_jax.nn`` sites (dense or MoE).

Demo / benchmark size (``TransformerConfig()``): 4 layers, d_model 256, 4 heads, seq 128,
vocab 256 (char-level), batch 8.

    from examples.transformer import Transformer, TransformerConfig, lm_loss
    model = Transformer(TransformerConfig(dtype=jnp.float16, scan_layers=True), rngs=nnx.Rngs(0))
    loss = lm_loss(model, {"tokens": tokens, "mask": mask})   # mask: True = real token

Every norm, attention, linear, embedding, router and the loss is a site with its own gear and
probes (``nan2safe_jax.site.name_sites(model)`` names them by path, e.g. ``blocks.attn``; with
``scan_layers`` a block's sites are stacked ``[num_layers]``).

Fault injection without editing the model (all are data: changing them never recompiles):
- ``set_knob(model, "qk_scale", 300.0, layer=2)``: multiplies the q·k logits of one layer's
  attention (a growing q/k scale: fp16 logits overflow past 65504);
- ``set_knob(model, "logit_scale", 1e4)``: the router scores of every MoE block (fp16 scores
  overflow through the router's two softmaxes);
- ``set_knob(model, "head_scale", 1e3)``: multiplies the LM logits (huge logits into the loss).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from nan2safe_jax import nn

__all__ = [
    "Block",
    "MLP",
    "MoE",
    "Transformer",
    "TransformerConfig",
    "attention_mask",
    "lm_loss",
    "make_batch",
    "set_knob",
]


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
    # padding query sees only padding keys, its row is fully masked and FAST softmax is 0/0.
    pad_mask: str = "self"
    # > 0: the attention is configured with dropout, as many GPT-style configs are. flax.nnx then
    # takes its explicit-weights path (q / sqrt(d), logits kept in the compute dtype, here fp16)
    # even when run deterministic, so growing q·k logits overflow fp16 at FAST exactly as in a
    # stock flax.nnx model. The blocks run deterministic (no dropout masks drawn): both demo arms
    # see identical numerics.
    attn_dropout: float = 0.0

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


def _norm(cfg: TransformerConfig, rngs: nnx.Rngs):
    kw = dict(epsilon=cfg.epsilon, dtype=cfg.dtype, param_dtype=cfg.param_dtype, rngs=rngs)
    return nn.LayerNorm(cfg.d_model, **kw) if cfg.norm == "layer" else nn.RMSNorm(cfg.d_model, **kw)


class MLP(nnx.Module):
    """``Linear(d, ff) -> gelu -> Linear(ff, d)``."""

    def __init__(self, cfg: TransformerConfig, *, rngs: nnx.Rngs):
        kw = dict(dtype=cfg.dtype, param_dtype=cfg.param_dtype, rngs=rngs)
        self.fc1 = nn.Linear(cfg.d_model, cfg.ff, **kw)
        self.fc2 = nn.Linear(cfg.ff, cfg.d_model, **kw)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.fc2(jax.nn.gelu(self.fc1(x)))


class MoE(nnx.Module):
    """Top-k mixture of ``MLP`` experts behind an ``nn.Router`` (dense dispatch: every expert
    runs on every token and the router's gates weight the chosen ones; fine at demo size)."""

    def __init__(self, cfg: TransformerConfig, *, rngs: nnx.Rngs):
        self.router = nn.Router(
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


class Block(nnx.Module):
    """Pre-norm decoder block: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``."""

    def __init__(self, cfg: TransformerConfig, *, rngs: nnx.Rngs):
        self.ln1 = _norm(cfg, rngs)
        self.attn = nn.MultiHeadAttention(
            cfg.num_heads,
            cfg.d_model,
            dtype=cfg.dtype,
            param_dtype=cfg.param_dtype,
            dropout_rate=cfg.attn_dropout,
            deterministic=True,
            rngs=rngs,
        )
        self.ln2 = _norm(cfg, rngs)
        self.mlp = MoE(cfg, rngs=rngs) if cfg.num_experts else MLP(cfg, rngs=rngs)

    def __call__(self, x: jax.Array, mask: jax.Array | None) -> jax.Array:
        x = x + self.attn(self.ln1(x), mask=mask, is_causal=True)
        return x + self.mlp(self.ln2(x))


def attention_mask(mask: jax.Array | None, pad_mask: str = "self") -> jax.Array | None:
    """Padding mask ``bool[B, T]`` (True = real token) -> attention mask ``bool[B, 1, T, T]``.

    Keys that are padding are masked. With ``pad_mask="self"`` every query also sees itself,
    so no row is fully masked (a fully padded sequence stays finite in FAST; its loss is
    masked anyway). With ``pad_mask="keys"`` only keys are masked: under the causal mask a
    left-padded sequence then has fully-masked rows (the write-up's 0/0). The causal part is
    applied inside ``ops.attention`` (``is_causal=True``).
    """
    if mask is None:
        return None
    mask = jnp.asarray(mask, bool)
    keys = mask[:, None, None, :]
    if pad_mask == "keys":
        return keys
    t = mask.shape[-1]
    return keys | jnp.eye(t, dtype=bool)[None, None]


class Transformer(nnx.Module):
    """Decoder-only LM: token + learned position embeddings, blocks, final norm, LM head.

    Attributes (sites): ``embed``, ``pos``, ``blocks`` (an ``nnx.List``, or one stacked
    ``Block`` with ``scan_layers``), ``norm``, ``head``, ``loss`` (an ``nn.CrossEntropy``).
    ``head_scale`` is a ``Knob`` multiplying the LM logits (fault injection).
    """

    def __init__(self, cfg: TransformerConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        kw = dict(dtype=cfg.dtype, param_dtype=cfg.param_dtype, rngs=rngs)
        self.embed = nn.Embed(cfg.vocab, cfg.d_model, **kw)
        self.pos = nn.Embed(cfg.seq_len, cfg.d_model, **kw)
        if cfg.scan_layers:

            @nnx.split_rngs(splits=cfg.num_layers)
            @nnx.vmap(in_axes=(0,), out_axes=0)
            def make_blocks(rngs: nnx.Rngs) -> Block:
                return Block(cfg, rngs=rngs)

            self.blocks = make_blocks(rngs)
        else:
            self.blocks = nnx.List([Block(cfg, rngs=rngs) for _ in range(cfg.num_layers)])
        self.norm = _norm(cfg, rngs)
        self.head = nn.Linear(cfg.d_model, cfg.vocab, **kw)
        self.loss = nn.CrossEntropy()
        self.head_scale = nn.Knob(jnp.ones((), jnp.float32))

    def __call__(self, tokens: jax.Array, mask: jax.Array | None = None) -> jax.Array:
        """``tokens i32[B, T]`` (T <= seq_len), ``mask bool[B, T]`` -> logits ``[B, T, vocab]``."""
        cfg = self.cfg
        t = tokens.shape[-1]
        if t > cfg.seq_len:
            raise ValueError(f"sequence length {t} exceeds seq_len={cfg.seq_len}")
        x = self.embed(tokens) + self.pos(jnp.arange(t))
        amask = attention_mask(mask, cfg.pad_mask)

        def run(block: Block, x: jax.Array, amask: jax.Array | None) -> jax.Array:
            return block(x, amask)

        if cfg.remat:
            run = nnx.remat(run)
        if cfg.scan_layers:

            @nnx.scan(in_axes=(0, nnx.Carry, None), out_axes=nnx.Carry)
            def scan_blocks(block: Block, x: jax.Array, amask: jax.Array | None) -> jax.Array:
                return run(block, x, amask)

            x = scan_blocks(self.blocks, x, amask)
        else:
            for block in self.blocks:
                x = run(block, x, amask)
        logits = self.head(self.norm(x))
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
    """Sets every ``Knob`` called ``name`` (``qk_scale``, ``logit_scale``) in ``model``.

    ``layer`` selects one layer of a stacked (``scan_layers``) knob, or the ``layer``-th block
    of an unstacked model; None sets all.
    """
    found = False
    for path, node in nnx.iter_graph(model):
        if not (isinstance(node, nn.Knob) and path and path[-1] == name):
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
