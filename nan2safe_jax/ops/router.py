"""MoE top-k router with FAST / STABLE / SAFE paths and a logits probe."""

from __future__ import annotations

import functools
import operator
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from nan2safe_jax import probe
from nan2safe_jax.ops._numerics import (
    _F32,
    _HIGHEST,
    _float_dtype,
    _kernels,
    _pow2,
    _range_exponent,
    _saturate,
    _scale_back,
    _times_pow2_saturated,
)
from nan2safe_jax.ops.dispatch import switch
from nan2safe_jax.ops.linear import _dot_last


class Routing(NamedTuple):
    """The output of ``router``."""

    gates: jax.Array  # [..., top_k] renormalised weights of the chosen experts (x.dtype)
    indices: jax.Array  # i32[..., top_k] chosen experts, best first
    probs: jax.Array  # [..., num_experts] the first softmax (for a load-balancing loss)


def _router_fast(x, kernel, *, top_k, stats):
    # the write-up's router in x.dtype: scores -> softmax -> top-k -> renormalise. In fp16 a
    # score past 65504 is inf, and the softmax turns it into inf - inf = NaN
    logits = _dot_last(x, kernel.astype(x.dtype))
    probs = jax.nn.softmax(logits, axis=-1)
    top_p, idx = lax.top_k(probs, top_k)
    gates = top_p / jnp.sum(top_p, axis=-1, keepdims=True)
    return Routing(gates, idx.astype(jnp.int32), probs), (
        {"logits": probe.op_stats(logits)} if stats else None
    )


def _router_stable(x, kernel, *, top_k, stats):
    dt = x.dtype
    logits = _dot_last(x, kernel.astype(dt), preferred_element_type=_F32)
    probs = jax.nn.softmax(logits, axis=-1)
    top_p, idx = lax.top_k(probs, top_k)
    gates = top_p / jnp.sum(top_p, axis=-1, keepdims=True)
    out = Routing(gates.astype(dt), idx.astype(jnp.int32), probs.astype(dt))
    return out, ({"logits": probe.op_stats(logits)} if stats else None)


def _router_safe(x, kernel, *, top_k, stats):
    dt = x.dtype
    xf, kf = x.astype(_F32), kernel.astype(_F32)
    ex = _range_exponent(xf, axis=-1, keepdims=True)  # per token
    ek = _range_exponent(kf)
    lc = _dot_last(xf * _pow2(-ex), kf * _pow2(-ek), precision=_HIGHEST)  # |lc| <= in_features
    mx = lax.stop_gradient(jnp.max(lc, axis=-1, keepdims=True))
    mx = jnp.where(jnp.isfinite(mx), mx, 0.0)
    d = _scale_back(lc - mx, ex, ek)  # shifted true logits: max exactly 0, others may be -inf
    probs = _kernels().safe_softmax(d, axis=-1)
    top_p, idx = lax.top_k(probs, top_k)
    denom = jnp.sum(top_p, axis=-1, keepdims=True)  # >= the top-1 prob >= 1/num_experts
    ok = denom > 0
    gates = jnp.where(ok, top_p / jnp.where(ok, denom, 1.0), 1.0 / top_k)
    out = Routing(_saturate(gates, dt), idx.astype(jnp.int32), _saturate(probs, dt))
    st = {"logits": probe.op_stats(_times_pow2_saturated(lc, ex, ek))} if stats else None
    return out, st


def router(
    x: jax.typing.ArrayLike,
    kernel: jax.typing.ArrayLike,
    top_k: int,
    gear: Any = 0,
    *,
    return_stats: bool = False,
):
    """MoE top-k gate: scores ``x @ kernel`` → softmax → top-k → renormalise.

    FAST: the write-up's router, in ``x.dtype``: softmax, top-k, and the chosen probabilities
    renormalised (the write-up's "two softmaxes": the renormalisation is a softmax over the
    chosen scores; dividing by their sum is the same number). In fp16 a score past 65504 is
    inf, and the softmax turns it into NaN (inf - inf). STABLE: scores accumulated in f32, both
    steps in f32. SAFE: f32 operands compressed by powers
    of two (scores cannot overflow), the shift by the max applied before the compression is
    undone, ``kernels.safe_softmax``; gates and probabilities finite with finite gradients.

    Args:
      x: ``[..., in_features]`` token representations.
      kernel: ``[in_features, num_experts]``.
      top_k: experts per token (static).
      gear: FAST/STABLE/SAFE.
      return_stats: also return ``{"logits": detector.stats(scores)}``.

    Returns:
      ``Routing(gates [..., top_k], indices i32[..., top_k], probs [..., num_experts])``; with
      ``return_stats`` a tuple ``(routing, stats)``.
    """
    x, kernel = jnp.asarray(x), jnp.asarray(kernel)
    x = x.astype(_float_dtype(x))
    if kernel.ndim != 2 or kernel.shape[0] != x.shape[-1]:
        raise ValueError(
            f"router: x [..., {x.shape[-1]}] needs a kernel [{x.shape[-1]}, num_experts], "
            f"got {kernel.shape}"
        )
    top_k = operator.index(top_k)
    if not 1 <= top_k <= kernel.shape[1]:
        raise ValueError(f"router: top_k must be in [1, {kernel.shape[1]}], got {top_k}")
    kw = dict(top_k=top_k, stats=bool(return_stats))
    branches = [functools.partial(f, **kw) for f in (_router_fast, _router_stable, _router_safe)]
    out, st = switch(gear, branches, x, kernel)
    return (out, st) if return_stats else out
