"""Scaled dot-product attention with FAST / STABLE / SAFE paths and logits / probs probes.

FAST is exactly what ``flax.nnx.MultiHeadAttention`` computes (docs/design.md, "Gears"), and
flax has two formulations, chosen by its ``dot_product_attention``:

- **fused** (no dropout, no ``sow_weights``; flax then calls ``jax.nn.dot_product_attention``,
  XLA implementation): q·k accumulated in ``promote(dtype, f32)``, logits *multiplied* by
  ``1/sqrt(head_dim)``, masked logits set to ``-0.7 * finfo(f32).max``, softmax in f32,
  probabilities cast back to the input dtype for the second matmul. Grouped KV heads go through
  the same ``vmap`` over groups as JAX's.
- **explicit** (dropout or ``sow_weights``: flax's ``dot_product_attention_weights``): q
  *divided* by ``sqrt(head_dim)`` in the input dtype, logits in the input dtype (fp16 logits
  past 65504 overflow here), masked logits set to ``finfo(dtype).min``, softmax in the input
  dtype, then dropout.

In both a fully-masked query row is finite (every logit equals the fill value, so the row is
a uniform average of the values), as in Flax. The causal mask is ``tril(ones(q_len, k_len))``
(aligned at the start), as in Flax and JAX.

STABLE: both matmuls accumulate in f32, logits, fill and softmax in f32, output cast back with
saturation. SAFE: f32, q and k compressed by exact powers of two, ``kernels.safe_softmax``; a
fully-masked row is defined as zeros (no key to attend to) with zero gradients.

Every branch returns the output in the input dtype (``lax.switch`` needs one output type), the
probes in f32 and, when asked, the attention weights in the input dtype.
"""

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
    _scale_back,
    _times_pow2_saturated,
)
from nan2safe_jax.ops.dispatch import switch


def _causal_mask(q_len: int, k_len: int) -> jax.Array:
    """``tril(ones(q_len, k_len))`` as bool: query i sees keys j <= i (flax / JAX)."""
    qi = lax.broadcasted_iota(jnp.int32, (q_len, k_len), 0)
    kj = lax.broadcasted_iota(jnp.int32, (q_len, k_len), 1)
    return kj <= qi


def _attention_mask(mask, causal: bool, q_len: int, k_len: int):
    """Combines a user mask and a causal mask (None when neither); True = attend."""
    m = None if mask is None else jnp.asarray(mask, bool)
    if causal:
        c = _causal_mask(q_len, k_len)
        m = c if m is None else jnp.logical_and(m, c)
    return m


def _large_negative(dtype) -> jax.Array:
    """JAX's mask fill for ``jax.nn.dot_product_attention``: ``-0.7 * finfo.max`` (f32-capped)."""
    big = min(float(jnp.finfo(dtype).max), float(jnp.finfo(_F32).max))
    return jnp.asarray(-0.7 * big, dtype=dtype)


ATTN_STATS = ("logits", "probs")


def _row_probe(padded, fill, probs, want=ATTN_STATS):
    """Per-row probe values: the max attended logit (0 on a fully-masked row, whose max is the
    fill value: an intentional mask is not a logit) and the max probability; None for a value
    not in ``want`` (not traced: the probability's max is a pass over ``[b, h, q, k]``)."""
    rm = None
    if "logits" in want:
        rm = jnp.max(padded, axis=-1)
        rm = jnp.where(rm <= fill, jnp.zeros((), rm.dtype), rm)
    return rm, (jnp.max(probs, axis=-1) if "probs" in want else None)


def _attn_stats(row_max, pmax):
    """Probe statistics of per-row values (cheap: ``[b, h, q]``, not ``[b, h, q, k]``); only
    the values given (not None)."""
    vals = {"logits": row_max, "probs": pmax}
    return {k: probe.op_stats(v) for k, v in vals.items() if v is not None}


def _dpa_precision(dtype):
    """The dot algorithm ``jax.nn.dot_product_attention`` uses for the logits matmul.

    JAX asks for ``F16_F16_F32`` / ``BF16_BF16_F32`` and falls back to the default algorithm
    when the platform rejects the preset at trace time. Under ``jit`` the rejection comes only
    at lowering (JAX 0.10 on CPU: fp16 flax attention fails to compile there), so the preset
    is chosen here from the backend: fp16 keeps it on GPU only (TPU lacks it too).
    """
    if dtype == jnp.bfloat16:
        return lax.DotAlgorithmPreset.BF16_BF16_F32
    if dtype == jnp.float16 and jax.default_backend() == "gpu":
        return lax.DotAlgorithmPreset.F16_F16_F32
    return None


def _fused_core(q, k, v, mask, scale, causal, want=ATTN_STATS):
    """``jax.nn.dot_product_attention``'s XLA core for one query group (``[B, T, K, H]``)."""
    logits_dtype = jnp.promote_types(q.dtype, _F32)
    logits = jnp.einsum(
        "BTNH,BSNH->BNTS",
        q,
        k,
        precision=_dpa_precision(q.dtype),
        preferred_element_type=logits_dtype,
    )
    logits = logits * scale.astype(logits.dtype)
    fill = _large_negative(logits.dtype)
    if mask is not None or causal:
        combined = jnp.ones_like(logits, dtype=bool)
        if mask is not None:
            combined = jnp.logical_and(combined, mask)
        if causal:
            combined = jnp.logical_and(combined, _causal_mask(*logits.shape[2:])[None, None])
        logits = jnp.where(combined, logits, fill)
    padded = logits.astype(_F32)
    probs = jax.nn.softmax(padded, axis=-1)
    out = jnp.einsum("BNTS,BSNH->BTNH", probs.astype(k.dtype), v)
    row_max, pmax = _row_probe(padded, fill.astype(_F32), probs, want)
    return out, lax.stop_gradient(row_max), lax.stop_gradient(pmax)


def _fast_fused(q, k, v, mask, mult, scale, *, causal, precision, weights, want=ATTN_STATS):
    """FAST, fused: flax without dropout / sow = ``jax.nn.dot_product_attention`` (XLA)."""
    del mult, precision, weights  # no dropout and no weights on this path
    b, t, n, h = q.shape
    kh = k.shape[2]
    g = n // kh
    qg = jnp.reshape(q, (b, t, kh, g, h))
    if mask is not None:
        mb, mn, mt, ms = mask.shape
        if mn == 1:
            mask = jnp.broadcast_to(mask[:, :, None], (mb, mn, g, mt, ms))
        else:
            mask = jnp.reshape(mask, (mb, kh, g, mt, ms))
    core = functools.partial(_fused_core, causal=causal, want=want)
    out, row_max, pmax = jax.vmap(
        core, in_axes=(3, None, None, None if mask is None else 2, None), out_axes=(3, 2, 2)
    )(qg, k, v, mask, scale)
    return jnp.reshape(out, (b, t, n, v.shape[-1])), _attn_stats(row_max, pmax), None


def _fast_explicit(q, k, v, mask, mult, scale, *, causal, precision, weights, want=ATTN_STATS):
    """FAST, explicit: flax's ``dot_product_attention_weights`` and weighted sum (dropout /
    ``sow_weights``). ``scale`` is the fault-injection multiplier only (1.0: exact no-op)."""
    dtype = q.dtype
    n, kh, depth = q.shape[-2], k.shape[-2], q.shape[-1]
    gqa = n != kh
    if gqa:
        qq = q.reshape(q.shape[:-2] + (kh, n // kh, depth))
        kk = jnp.expand_dims(k, axis=-2)
        spec = "...qhgd,...kh1d->...hgqk"
    else:
        qq, kk, spec = q, k, "...qhd,...khd->...hqk"
    qq = qq / jnp.sqrt(depth).astype(dtype)
    w = jnp.einsum(spec, qq, kk, precision=precision)
    if gqa:
        w = w.reshape(w.shape[:-4] + (n, w.shape[-2], w.shape[-1]))
    w = w * scale.astype(dtype)
    fill = jnp.finfo(dtype).min
    if mask is not None or causal:
        masks = [] if mask is None else [mask]
        if causal:
            masks.append(_causal_mask(*w.shape[-2:]))
        combined = masks[0]
        for other in masks[1:]:
            combined = jnp.logical_and(combined, other)  # broadcasts, as flax's combine_masks
        w = jnp.where(jnp.broadcast_to(combined, w.shape), w, fill)
    masked = w
    w = jax.nn.softmax(w).astype(dtype)
    row_max, pmax = _row_probe(masked, fill, w, want)
    sown = w if weights else None
    if mult is not None:
        w = w * mult
    if gqa:
        w5 = w.reshape(w.shape[:-3] + (kh, n // kh) + w.shape[-2:])
        out = jnp.einsum(
            "...hgqk,...kh1d->...qhgd", w5, jnp.expand_dims(v, -2), precision=precision
        )
        out = out.reshape(out.shape[:-3] + (n, out.shape[-1]))
    else:
        out = jnp.einsum("...hqk,...khd->...qhd", w, v, precision=precision)
    return out, _attn_stats(lax.stop_gradient(row_max), lax.stop_gradient(pmax)), sown


def _repeat_kv(q, k, v):
    """Grouped KV heads expanded to one per query head (head n reads KV head n // group)."""
    g = q.shape[2] // k.shape[2]
    if g == 1:
        return k, v
    return jnp.repeat(k, g, axis=2), jnp.repeat(v, g, axis=2)


def _attn_stable(q, k, v, mask, mult, scale, *, causal, base_scale, weights, want=ATTN_STATS):
    dt = q.dtype
    k, v = _repeat_kv(q, k, v)
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=_F32)
    logits = logits * (jnp.float32(base_scale) * scale)
    m = _attention_mask(mask, causal, q.shape[1], k.shape[1])
    fill = _large_negative(_F32)
    padded = logits if m is None else jnp.where(m, logits, fill)
    probs = jax.nn.softmax(padded, axis=-1)
    row_max, pmax = _row_probe(padded, fill, probs, want)
    sown = probs.astype(dt) if weights else None
    if mult is not None:
        probs = probs * mult.astype(_F32)
    out = jnp.einsum("bhqk,bkhd->bqhd", probs.astype(v.dtype), v, preferred_element_type=_F32)
    st = _attn_stats(lax.stop_gradient(row_max), lax.stop_gradient(pmax))
    return _saturate(out, dt), st, sown


def _attn_safe(q, k, v, mask, mult, scale, *, causal, base_scale, weights, want=ATTN_STATS):
    dt = q.dtype
    k, v = _repeat_kv(q, k, v)
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
    sc = jnp.float32(base_scale) * scale
    d = _scale_back(d, eqt, ekt) * sc
    probs = _kernels().safe_softmax(d, axis=-1, where=valid)
    sown = probs.astype(dt) if weights else None
    p = probs if mult is None else probs * mult.astype(_F32)
    out = jnp.einsum("bhqk,bkhd->bqhd", p, vf, precision=_HIGHEST)
    row_max = _times_pow2_saturated(mx * sc, eqt, ekt)[..., 0] if "logits" in want else None
    pmax = jnp.max(probs, axis=-1) if "probs" in want else None  # 0 on a fully-masked row
    st = _attn_stats(lax.stop_gradient(row_max), lax.stop_gradient(pmax))
    return _saturate(out, dt), st, sown


def _as_mask(mask):
    """A bool mask with 4 dims (leading 1s prepended: the same broadcast)."""
    if mask is None:
        return None
    mask = jnp.asarray(mask, bool)
    if mask.ndim > 4:
        raise ValueError(f"attention: mask must broadcast to [b, h, q, k], got {mask.shape}")
    return jnp.reshape(mask, (1,) * (4 - mask.ndim) + mask.shape)


def attention(
    q: jax.typing.ArrayLike,
    k: jax.typing.ArrayLike,
    v: jax.typing.ArrayLike,
    mask: jax.typing.ArrayLike | None = None,
    causal: bool = False,
    gear: Any = 0,
    *,
    scale: float | None = None,
    logit_scale: jax.typing.ArrayLike | None = None,
    explicit: bool = False,
    dropout_multiplier: jax.typing.ArrayLike | None = None,
    precision: Any = None,
    return_stats: bool = False,
    return_weights: bool = False,
    stats: tuple[str, ...] = ATTN_STATS,
):
    """Dot-product attention: ``softmax(scale · q·kᵀ, masked) · v``; see the module docstring.

    Args:
      q: ``[batch, q_len, heads, head_dim]``.
      k: ``[batch, k_len, kv_heads, head_dim]``; ``heads`` must be a multiple of ``kv_heads``
        (grouped-query attention: query head ``n`` reads KV head ``n // (heads // kv_heads)``).
      v: ``[batch, k_len, kv_heads, v_dim]``.
      mask: bool, broadcastable to ``[batch, heads, q_len, k_len]``; True = attend.
      causal: also mask keys after the query (``tril``: query i sees keys j <= i).
      gear: FAST/STABLE/SAFE, a Python int or a (traced) int32 scalar.
      scale: a Python float; default ``1/sqrt(head_dim)``. The explicit FAST path divides q by
        ``sqrt(head_dim)`` as flax does, so a non-default ``scale`` needs ``explicit=False``.
      logit_scale: an extra (traced) f32 logit multiplier, 1.0 by default: fault injection
        (``MultiHeadAttention.qk_scale``). At 1.0 it changes no bit.
      explicit: FAST follows flax's ``dot_product_attention_weights`` (the path flax takes with
        dropout or ``sow_weights``) instead of ``jax.nn.dot_product_attention``.
      dropout_multiplier: ``keep / keep_prob`` in the input dtype, broadcastable to
        ``[batch, heads, q_len, k_len]``, applied to the weights (needs ``explicit=True``).
      precision: ``lax.Precision`` of the explicit path's einsums (flax's ``precision``).
      return_stats: also return ``{"logits": stats, "probs": stats}``: ``detector.stats`` of
        each query row's max attended logit (0 for a fully-masked row) and of each row's max
        probability, as the selected gear computed them. Per-row values keep the probes cheap
        while still showing logit growth toward the dtype's max and attention collapse.
      return_weights: also return the attention weights ``[batch, heads, q_len, k_len]``
        (before dropout; flax's ``sow_weights``; needs ``explicit=True``).
      stats: which of ``"logits"``, ``"probs"`` ``return_stats`` computes (a statistic left
        out is not traced; the probabilities' max costs a pass over the weights).

    Returns:
      ``[batch, q_len, heads, v_dim]`` in the inputs' float dtype; then the stats and/or the
      weights when asked, as a tuple ``(out, stats?, weights?)``.

    Raises:
      ValueError: inconsistent shapes, a mask of rank > 4, or ``dropout_multiplier`` /
        ``return_weights`` without ``explicit``.
    """
    q, k, v = jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)
    dt = jnp.result_type(_float_dtype(q), _float_dtype(k), _float_dtype(v))
    q, k, v = q.astype(dt), k.astype(dt), v.astype(dt)
    for name, a in (("q", q), ("k", k), ("v", v)):
        _check_rank(a, 4, name, "attention")
    if (
        k.shape[:3] != v.shape[:3]
        or q.shape[0] != k.shape[0]
        or q.shape[3] != k.shape[3]
        or q.shape[2] % k.shape[2]
    ):
        raise ValueError(
            "attention: expected q [b, q_len, h, d], k [b, k_len, kv_h, d], "
            f"v [b, k_len, kv_h, dv] with h a multiple of kv_h; got q {q.shape}, k {k.shape}, "
            f"v {v.shape}"
        )
    want = tuple(s for s in ATTN_STATS if s in stats) if return_stats else ()
    if set(stats) - set(ATTN_STATS):
        raise ValueError(f"attention: stats must be among {ATTN_STATS}, got {stats!r}")
    if (dropout_multiplier is not None or return_weights) and not explicit:
        raise ValueError("attention: dropout_multiplier / return_weights need explicit=True")
    default_scale = float(np.float32(1.0 / np.sqrt(q.shape[-1])))
    base_scale = default_scale if scale is None else float(scale)
    if explicit and base_scale != default_scale:
        raise ValueError(
            f"attention: explicit=True divides q by sqrt(head_dim) as flax does; got scale={scale}"
        )
    knob = jnp.ones((), _F32) if logit_scale is None else jnp.asarray(logit_scale, _F32)
    mask = _as_mask(mask)
    mult = None if dropout_multiplier is None else jnp.asarray(dropout_multiplier, dt)
    causal = bool(causal)
    if explicit:
        fast = functools.partial(
            _fast_explicit, causal=causal, precision=precision, weights=return_weights, want=want
        )
        fast_args = lambda q, k, v, m, d, s: fast(q, k, v, m, d, s)  # noqa: E731
    else:
        fused = functools.partial(
            _fast_fused, causal=causal, precision=None, weights=False, want=want
        )
        fast_args = lambda q, k, v, m, d, s: fused(  # noqa: E731
            q, k, v, m, d, jnp.float32(base_scale) * s
        )
    kw = dict(causal=causal, base_scale=base_scale, weights=return_weights, want=want)
    stable = functools.partial(_attn_stable, **kw)
    if not explicit and dt == _F32:
        # flax's fused path already takes f32 logits, mask fill and softmax: at f32 it is
        # STABLE's math, so the two gears share one compiled path
        stable = fast_args
    branches = [fast_args, stable, functools.partial(_attn_safe, **kw)]
    out, st, w = switch(gear, branches, q, k, v, mask, mult, knob)
    res = (out,) + ((st,) if return_stats else ()) + ((w,) if return_weights else ())
    return res[0] if len(res) == 1 else res
