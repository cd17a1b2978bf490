"""A compact Gemma-style decoder in plain ``flax.nnx``, adopted with ``nan2safe.nn``.

Source: a condensed re-write of the Flax repository's NNX Gemma example
(https://github.com/google/flax, ``examples/gemma/modules.py``, ``layers.py``,
``transformer.py``; Apache-2.0): the same module structure and parameter names (``Embedder``
with ``input_embedding``, ``Einsum`` with ``w``, ``RMSNorm`` with a ``(1 + scale)`` gain,
``Attention`` with ``qkv_einsum``/``attn_vec_einsum`` and rotary embeddings, ``FeedForward``
with ``gate_proj``/``up_proj``/``down_proj`` ``nnx.Linear`` layers), its mask fill
``K_MASK = -2.3819763e38``, ``make_causal_attn_mask`` and ``build_positions_from_mask``.
Left out: KV cache, sliding windows, soft caps, sow hooks, GQA, post-norms. Changed: a compute
``dtype`` (parameters stay f32) and default (not zero) initialisers for the feed-forward, so it
trains from scratch.

The fault is the model's own: ``K_MASK`` is finite in f32/bf16 but ``-inf`` once cast to
float16, so with fp16 compute a left-padded sequence (whose padding queries see only padding
keys under the causal mask) has fully masked rows and ``jax.nn.softmax`` gives 0/0 = NaN.

Adopting nan2safe takes two steps, shown by ``build``:

1. ``nan2safe.nn.convert(model)``: the ``nnx.Linear`` layers become sites (same ``Param``s);
   the hand-written ``Einsum``, ``RMSNorm``, ``Embedder`` and ``Attention`` are reported as left
   alone (their own code is in no site).
2. the attention core (``attend``: logits, mask fill, softmax, weighted sum) becomes a user
   site, ``nan2safe.nn.Site(attend, safe=attend_safe)``: ``Config(core_site=True)``. That is the
   one line of model code to change; tier 2 can then put one layer's core in SAFE.

Run it: ``python -m examples.gemma_nnx`` from the repository root (a ``Trainer`` through the
fault, every step printed); ``pytest -m slow tests/test_adopt_examples.py`` checks it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

import nan2safe_jax as nan2safe
from nan2safe_jax.gear import Gear

K_MASK = -2.3819763e38  # the Gemma example's mask fill: -inf in float16

__all__ = [
    "Config",
    "Transformer",
    "attend",
    "attend_safe",
    "build",
    "loss_fn",
    "make_batch",
]


@dataclasses.dataclass(frozen=True)
class Config:
    """Model size (tiny by default) and adoption switch."""

    num_layers: int = 2
    num_embed: int = 32
    embed_dim: int = 16
    hidden_dim: int = 32
    num_heads: int = 2
    head_dim: int = 8
    dtype: Any = jnp.float16
    core_site: bool = False  # the attention core as a nan2safe.nn.Site


class Einsum(nnx.Module):
    """Parameterised einsum (``w`` of ``shape``), cast to the input's dtype."""

    def __init__(self, einsum_str: str, shape, *, rngs: nnx.Rngs):
        self.einsum_str = einsum_str
        self.w = nnx.Param(nnx.initializers.normal()(rngs.params(), shape))

    def __call__(self, x):
        return jnp.einsum(self.einsum_str, x, self.w[...].astype(x.dtype))


class RMSNorm(nnx.Module):
    """Gemma's RMSNorm: ``x / sqrt(mean(x^2) + 1e-6) * (1 + scale)`` (``scale`` starts at 0)."""

    def __init__(self, dim: int, *, rngs: nnx.Rngs):
        self.scale = nnx.Param(nnx.initializers.zeros_init()(rngs.params(), (dim,)))

    def __call__(self, x):
        var = jnp.mean(jnp.square(x.astype(jnp.float32)), axis=-1, keepdims=True)
        normed = x.astype(jnp.float32) * jax.lax.rsqrt(var + 1e-6)
        return (normed * (1 + self.scale[...])).astype(x.dtype)


class Embedder(nnx.Module):
    """Token embedding (``encode``, scaled by ``sqrt(dim)``) tied with the output (``decode``)."""

    def __init__(self, vocab_size: int, embed_dim: int, dtype, *, rngs: nnx.Rngs):
        init = nnx.initializers.normal()
        self.input_embedding = nnx.Param(init(rngs.params(), (vocab_size, embed_dim)))
        self.dtype = dtype

    def encode(self, x):
        x = self.input_embedding[...][(x,)]
        return (x * jnp.sqrt(x.shape[-1])).astype(self.dtype)

    def decode(self, x):
        return jnp.dot(x, self.input_embedding[...].T.astype(x.dtype))


def apply_rope(x, positions, max_wavelength: int = 10_000):
    """Rotary embedding over the last axis of ``x [B, T, N, H]`` at ``positions [B, T]``."""
    half = x.shape[-1] // 2
    freq = max_wavelength ** (2 * jnp.arange(half) / x.shape[-1])
    angle = (positions[..., None] / freq)[..., None, :]
    sin, cos = jnp.sin(angle).astype(x.dtype), jnp.cos(angle).astype(x.dtype)
    first, second = x[..., :half], x[..., half:]
    return jnp.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)


def attend(query_scaled, key_proj, value_proj, attn_mask):
    """The Gemma example's attention core, unchanged: ``K_MASK`` fill, then softmax."""
    logits = jnp.einsum("BTNH,BSNH->BTNS", query_scaled, key_proj)
    padded_logits = jnp.where(jnp.expand_dims(attn_mask, -2), logits, K_MASK)
    probs = jax.nn.softmax(padded_logits, axis=-1).astype(key_proj.dtype)
    return jnp.einsum("BTNS,BSNH->BTNH", probs, value_proj)


def attend_safe(query_scaled, key_proj, value_proj, attn_mask):
    """SAFE core: f32 logits and ``nan2safe.ops.softmax`` in SAFE (a fully masked row gives
    zeros, with finite gradients), back to the input dtype."""
    f32 = jnp.float32
    logits = jnp.einsum("BTNH,BSNH->BTNS", query_scaled.astype(f32), key_proj.astype(f32))
    where = jnp.broadcast_to(jnp.expand_dims(attn_mask, -2), logits.shape)
    probs = nan2safe.ops.softmax(logits, where=where, gear=Gear.SAFE)
    return jnp.einsum("BTNS,BSNH->BTNH", probs, value_proj.astype(f32)).astype(value_proj.dtype)


class Attention(nnx.Module):
    def __init__(self, cfg: Config, *, rngs: nnx.Rngs):
        n, d, h = cfg.num_heads, cfg.embed_dim, cfg.head_dim
        self.qkv_einsum = Einsum("BTD,SNDH->SBTNH", (3, n, d, h), rngs=rngs)
        self.attn_vec_einsum = Einsum("BTNH,NHD->BTD", (n, h, d), rngs=rngs)
        self.head_dim = h
        self.core = nan2safe.nn.Site(attend, safe=attend_safe) if cfg.core_site else None

    def __call__(self, x, segment_pos, attn_mask):
        query_proj, key_proj, value_proj = self.qkv_einsum(x)
        query_scaled = apply_rope(query_proj, segment_pos) * self.head_dim**-0.5
        key_proj = apply_rope(key_proj, segment_pos)
        core = attend if self.core is None else self.core
        return self.attn_vec_einsum(core(query_scaled, key_proj, value_proj, attn_mask))


class FeedForward(nnx.Module):
    def __init__(self, cfg: Config, *, rngs: nnx.Rngs):
        kw = dict(use_bias=False, dtype=cfg.dtype, rngs=rngs)
        self.gate_proj = nnx.Linear(cfg.embed_dim, cfg.hidden_dim, **kw)
        self.up_proj = nnx.Linear(cfg.embed_dim, cfg.hidden_dim, **kw)
        self.down_proj = nnx.Linear(cfg.hidden_dim, cfg.embed_dim, **kw)

    def __call__(self, x):
        return self.down_proj(nnx.gelu(self.gate_proj(x)) * self.up_proj(x))


class Block(nnx.Module):
    def __init__(self, cfg: Config, *, rngs: nnx.Rngs):
        self.pre_attention_norm = RMSNorm(cfg.embed_dim, rngs=rngs)
        self.attn = Attention(cfg, rngs=rngs)
        self.pre_ffw_norm = RMSNorm(cfg.embed_dim, rngs=rngs)
        self.mlp = FeedForward(cfg, rngs=rngs)

    def __call__(self, x, segment_pos, attn_mask):
        x = x + self.attn(self.pre_attention_norm(x), segment_pos, attn_mask)
        return x + self.mlp(self.pre_ffw_norm(x))


class Transformer(nnx.Module):
    """``tokens [B, T]``, ``positions [B, T]``, ``attention_mask [B, T, T]`` -> logits."""

    def __init__(self, cfg: Config, *, rngs: nnx.Rngs):
        self.embedder = Embedder(cfg.num_embed, cfg.embed_dim, cfg.dtype, rngs=rngs)
        self.layers = nnx.List([Block(cfg, rngs=rngs) for _ in range(cfg.num_layers)])
        self.final_norm = RMSNorm(cfg.embed_dim, rngs=rngs)

    def __call__(self, tokens, positions, attention_mask):
        x = self.embedder.encode(tokens)
        for layer in self.layers:
            x = layer(x, positions, attention_mask)
        return self.embedder.decode(self.final_norm(x))


def make_causal_attn_mask(input_mask):
    """``[B, T]`` token mask (True = real) -> ``[B, T, T]``: causal and key padding."""
    t = input_mask.shape[-1]
    return input_mask[..., None, :] & jnp.tril(jnp.ones((t, t), bool))[None]


def build_positions_from_mask(input_mask):
    positions = jnp.cumsum(input_mask, axis=-1)
    return positions - (positions >= 1)


def loss_fn(model: Transformer, batch) -> jax.Array:
    """Next-token cross-entropy over real tokens (f32)."""
    tokens, mask = batch["tokens"], batch["mask"]
    logits = model(tokens, build_positions_from_mask(mask), make_causal_attn_mask(mask))
    ce = optax.softmax_cross_entropy_with_integer_labels(
        logits[:, :-1].astype(jnp.float32), tokens[:, 1:]
    )
    w = mask[:, 1:].astype(jnp.float32)
    return jnp.sum(ce * w) / jnp.maximum(jnp.sum(w), 1.0)


def make_batch(key, cfg: Config, batch: int = 4, seq: int = 8, left_pad: int = 0):
    """Random tokens; the last row left-padded by ``left_pad`` tokens (fully masked rows in
    its padding queries, under the causal mask)."""
    tokens = jax.random.randint(key, (batch, seq), 1, cfg.num_embed, dtype=jnp.int32)
    mask = jnp.ones((batch, seq), bool)
    if left_pad:
        mask = mask.at[-1, :left_pad].set(False)
    return {"tokens": jnp.where(mask, tokens, 0), "mask": mask}


def build(cfg: Config | None = None, *, seed: int = 0):
    """The adopted model: ``Transformer(core_site=True)`` converted. Returns ``(model, report)``."""
    cfg = cfg or Config(core_site=True)
    return nan2safe.nn.convert(Transformer(cfg, rngs=nnx.Rngs(seed)), return_report=True)


if __name__ == "__main__":  # python -m examples.gemma_nnx (from the repository root)
    from examples._fit import fit_through_the_fault

    model, report = build()
    batches = [
        make_batch(jax.random.key(i), Config(), left_pad=3 * (i in (1, 3))) for i in range(6)
    ]
    fit_through_the_fault(model, loss_fn, batches, report)
