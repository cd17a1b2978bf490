"""Scaled dot-product attention with FAST / STABLE / SAFE paths and logits / probs probes."""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from nan2safe_jax import probe
from nan2safe_jax.ops._numerics import (
    _F32,
    _HIGHEST,
    _check_rank,
    _float_dtype,
    _kernels,
    _pow2,
    _range_exponent,
    _saturate,
)
from nan2safe_jax.ops.dispatch import _FastVJP, _switch_fast_vjp


def _attention_mask(mask, causal: bool, q_len: int, k_len: int):
    """Combines a user mask and a causal mask (None when neither); True = attend."""
    m = None if mask is None else jnp.asarray(mask, bool)
    if causal:
        # query i sees keys j <= i + (k_len - q_len): aligned at the end, as in decoding
        qi = lax.broadcasted_iota(jnp.int32, (q_len, k_len), 0)
        kj = lax.broadcasted_iota(jnp.int32, (q_len, k_len), 1)
        c = kj <= qi + (k_len - q_len)
        m = c if m is None else jnp.logical_and(m, c)
    return m


def _softmax_parts(masked):
    """``(probs, row_max, row_sum)`` of a softmax over the last axis, in ``masked.dtype``.

    The ordinary max-shifted formulation (``jax.nn.softmax``'s math), spelled out so the row
    max and the denominator are available to the probes for free. A fully-masked row (all
    -inf) is exp(-inf - -inf) = NaN, as in the write-up.
    """
    m = jnp.max(masked, axis=-1, keepdims=True)
    e = jnp.exp(masked - lax.stop_gradient(m))
    den = jnp.sum(e, axis=-1, keepdims=True)
    return e / den, m, den


def _attn_stats(row_max, den):
    """Per-row probe statistics (cheap: ``[b, h, q]`` values, not ``[b, h, q, k]``).

    ``logits``: stats of each row's max logit (over attended keys; -inf for a fully-masked
    row, +inf for an overflowed one). ``probs``: stats of each row's max probability
    ``1/denominator`` (1 = attention collapsed onto one key; NaN for a 0/0 row).
    """
    return {"logits": probe.op_stats(row_max), "probs": probe.op_stats(1.0 / den)}


def _attn_fast(q, k, v, mask, scale, *, causal, stats):
    dt = q.dtype
    logits = jnp.einsum("bqhd,bkhd->bhqk", q * scale.astype(dt), k)  # in dt: fp16 can overflow
    m = _attention_mask(mask, causal, q.shape[1], k.shape[1])
    masked = logits if m is None else jnp.where(m, logits, -jnp.inf)
    probs, row_max, den = _softmax_parts(masked)
    out = jnp.einsum("bhqk,bkhd->bqhd", probs, v)
    return out, (_attn_stats(row_max, den) if stats else None)


def _attn_fast_vjp(causal):
    """FAST attention with flax's residual (the probabilities) and a hand-written backward."""

    def fwd(q, k, v, mask, scale):
        dt = q.dtype
        qs = q * scale.astype(dt)
        logits = jnp.einsum("bqhd,bkhd->bhqk", qs, k)
        m = _attention_mask(mask, causal, q.shape[1], k.shape[1])
        masked = logits if m is None else jnp.where(m, logits, -jnp.inf)
        probs, row_max, den = _softmax_parts(masked)
        out = jnp.einsum("bhqk,bkhd->bqhd", probs, v)
        return (out, _attn_stats(row_max, den)), (probs,)

    def bwd(args, res, ct):
        q, k, v, mask, scale = args
        (probs,) = res
        g = ct[0]
        dt = q.dtype
        qs = q * scale.astype(dt)
        dv = jnp.einsum("bhqk,bqhd->bkhd", probs, g)
        dp = jnp.einsum("bqhd,bkhd->bhqk", g, v)
        dlogits = probs * (dp - jnp.sum(dp * probs, axis=-1, keepdims=True))
        dqs = jnp.einsum("bhqk,bkhd->bqhd", dlogits, k)
        dk = jnp.einsum("bhqk,bqhd->bkhd", dlogits, qs)
        dq = dqs * scale.astype(dt)
        dscale = jnp.sum((dqs * q).astype(_F32)).astype(scale.dtype)
        dmask = None if mask is None else np.zeros(mask.shape, jax.dtypes.float0)
        return dq, dk, dv, dmask, dscale

    def zeros(q, k, v, mask, scale):
        shape = (q.shape[0], q.shape[2], q.shape[1], k.shape[1])
        return (jnp.zeros(shape, q.dtype),)

    return fwd, bwd, zeros


def _attn_stable(q, k, v, mask, scale, *, causal, stats):
    dt = q.dtype
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=_F32) * scale
    m = _attention_mask(mask, causal, q.shape[1], k.shape[1])
    masked = logits if m is None else jnp.where(m, logits, -jnp.inf)
    probs, row_max, den = _softmax_parts(masked)
    out = jnp.einsum("bhqk,bkhd->bqhd", probs.astype(v.dtype), v, preferred_element_type=_F32)
    return out.astype(dt), (_attn_stats(row_max, den) if stats else None)


def _attn_safe(q, k, v, mask, scale, *, causal, stats):
    dt = q.dtype
    qf, kf, vf = q.astype(_F32), k.astype(_F32), v.astype(_F32)
    # dynamic range compression: |q'|, |k'| < 1 per (batch, head), so |q'·k'| <= head_dim
    eq = _range_exponent(qf, axis=(1, 3), keepdims=True)  # [b, 1, h, 1]
    ek = _range_exponent(kf, axis=(1, 3), keepdims=True)
    lc = jnp.einsum(
        "bqhd,bkhd->bhqk", qf * _pow2(-eq), kf * _pow2(-ek), precision=_HIGHEST
    )  # compressed logits
    m = _attention_mask(mask, causal, q.shape[1], k.shape[1])
    valid = jnp.ones(lc.shape, bool) if m is None else jnp.broadcast_to(m, lc.shape)
    mx = jnp.max(jnp.where(valid, lc, -jnp.inf), axis=-1, keepdims=True)
    mx = lax.stop_gradient(jnp.where(jnp.isfinite(mx), mx, 0.0))  # softmax is shift-invariant
    d = jnp.where(valid, lc - mx, 0.0)  # <= 0 on valid entries; masked entries kept finite
    # undo the compression on the shifted logits, one exact power of two at a time: the max
    # entry stays exactly 0, an entry far below it may go to -inf (exp -> 0, gradient 0)
    eqt = jnp.transpose(eq, (0, 2, 1, 3))  # [b, h, 1, 1]
    ekt = jnp.transpose(ek, (0, 2, 1, 3))
    sc = jnp.asarray(scale, _F32)
    d = d * _pow2(eqt) * _pow2(ekt) * sc
    probs = _kernels().safe_softmax(d, axis=-1, where=valid)
    out = jnp.einsum("bhqk,bkhd->bqhd", probs, vf, precision=_HIGHEST)
    st = None
    if stats:
        row_max = mx * _pow2(eqt) * _pow2(ekt) * sc  # the true max logit (f32)
        pmax = jnp.max(probs, axis=-1, keepdims=True)
        den = jnp.where(pmax > 0, 1.0 / jnp.where(pmax > 0, pmax, 1.0), jnp.inf)  # row: 0 -> inf
        st = _attn_stats(row_max, den)
    return _saturate(out, dt), st


def attention(
    q: jax.typing.ArrayLike,
    k: jax.typing.ArrayLike,
    v: jax.typing.ArrayLike,
    mask: jax.typing.ArrayLike | None = None,
    causal: bool = False,
    gear: Any = 0,
    *,
    scale: jax.typing.ArrayLike | None = None,
    return_stats: bool = False,
):
    """Dot-product attention: ``softmax(scale · q·kᵀ, masked) · v``.

    FAST: logits ``einsum`` in the input dtype (q scaled first, as ``flax.nnx`` does), masked
    entries set to -inf, ``jax.nn.softmax`` and the weighted sum in the input dtype: fp16 logits
    past 65504 overflow to inf (then inf - inf = NaN), a fully-masked row is 0/0 = NaN.
    STABLE: both matmuls accumulate in f32 (``preferred_element_type``), the scale and the
    softmax in f32; probabilities cast to ``v.dtype`` for the second matmul.
    SAFE: f32 inputs; q and k compressed by exact powers of two per (batch, head) so the logits
    matmul cannot overflow, the softmax taken on the max-shifted logits with the compression
    undone after the shift (so even logits beyond f32 range give the right probabilities);
    ``kernels.safe_softmax`` (compensated denominator, fully-masked row -> zeros, finite
    gradients); output cast with saturation.

    Args:
      q: ``[batch, q_len, heads, head_dim]``.
      k: ``[batch, k_len, heads, head_dim]``.
      v: ``[batch, k_len, heads, v_dim]``.
      mask: bool, broadcastable to ``[batch, heads, q_len, k_len]``; True = attend.
      causal: also mask keys after the query (aligned at the end when ``q_len < k_len``).
      gear: FAST/STABLE/SAFE, a Python int or a (traced) int32 scalar.
      scale: logit multiplier (may be traced); default ``1/sqrt(head_dim)``.
      return_stats: also return ``{"logits": stats, "probs": stats}``: ``detector.stats`` of
        each query row's max logit (over attended keys) and of each row's max probability, as
        the selected gear computed them. Per-row values keep the probes cheap (the logits
        are ``[b, h, q, k]``; these are ``[b, h, q]``) while still showing logit growth toward
        the dtype's max (headroom), attention collapse (max probability -> 1), and 0/0 rows
        (non-finite; in SAFE a fully-masked row reports max logit 0 and max probability 0).

    Returns:
      ``[batch, q_len, heads, v_dim]`` in q's float dtype; with ``return_stats`` a tuple
      ``(out, stats)``.
    """
    q, k, v = jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)
    dt = jnp.result_type(_float_dtype(q), _float_dtype(k), _float_dtype(v))
    q, k, v = q.astype(dt), k.astype(dt), v.astype(dt)
    for name, a in (("q", q), ("k", k), ("v", v)):
        _check_rank(a, 4, name, "attention")
    if k.shape[:3] != v.shape[:3] or q.shape[0] != k.shape[0] or q.shape[2:] != k.shape[2:]:
        raise ValueError(
            "attention: expected q [b, q_len, h, d], k [b, k_len, h, d], v [b, k_len, h, dv]; "
            f"got q {q.shape}, k {k.shape}, v {v.shape}"
        )
    if scale is None:
        scale = 1.0 / float(q.shape[-1]) ** 0.5
    scale = jnp.asarray(scale, _F32)
    if mask is not None:
        mask = jnp.asarray(mask, bool)
        if mask.ndim > 4:
            raise ValueError(f"attention: mask must broadcast to [b, h, q, k], got {mask.shape}")
    kw = dict(causal=bool(causal), stats=True)
    branches = [functools.partial(f, **kw) for f in (_attn_fast, _attn_stable, _attn_safe)]
    fast = _FastVJP(*_attn_fast_vjp(bool(causal)))
    out, st = _switch_fast_vjp(gear, branches, fast, q, k, v, mask, scale)
    return (out, st) if return_stats else out
