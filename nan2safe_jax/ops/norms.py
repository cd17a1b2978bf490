"""LayerNorm and RMSNorm with FAST / STABLE / SAFE paths and an ``inv_std`` probe."""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from nan2safe_jax import probe
from nan2safe_jax.ops._numerics import (
    _F32,
    _float_dtype,
    _kernels,
    _pow2,
    _range_exponent,
    _saturate,
)
from nan2safe_jax.ops.dispatch import _FastVJP, _switch_fast_vjp


def _affine(y, scale, bias):
    if scale is not None:
        y = y * scale
    if bias is not None:
        y = y + bias
    return y


def _ln_fast(x, scale, bias, eps, *, stats):
    # flax.nnx.LayerNorm's formulation (fast variance E[x²] - E[x]², clamped at 0) in x.dtype:
    # a constant row with eps=0 is 0 * rsqrt(0) = 0 * inf = NaN; fp16 x² overflows past 256.
    mean = jnp.mean(x, -1, keepdims=True)
    mean2 = jnp.mean(jnp.square(x), -1, keepdims=True)
    var = jnp.maximum(0.0, mean2 - jnp.square(mean))
    inv = lax.rsqrt(var + jnp.asarray(eps, x.dtype))
    mul = inv if scale is None else inv * scale.astype(x.dtype)
    y = (x - mean) * mul
    if bias is not None:
        y = y + bias.astype(x.dtype)
    return y, ({"inv_std": probe.op_stats(inv)} if stats else None)


def _ln_fast_fwd(x, scale, bias, eps, *, stats):
    out = _ln_fast(x, scale, bias, eps, stats=stats)
    mean = jnp.mean(x, -1, keepdims=True)  # CSE'd with the forward's by XLA
    var = jnp.maximum(0.0, jnp.mean(jnp.square(x), -1, keepdims=True) - jnp.square(mean))
    return out, (mean, lax.rsqrt(var + jnp.asarray(eps, x.dtype)))


def _norm_bwd(x, scale, mean, inv, g, center):
    """VJP of ``y = (x - mean) * inv * scale + bias`` (mean = 0 for RMSNorm), in x.dtype."""
    xhat = (x - mean) * inv if center else x * inv
    dxhat = g if scale is None else g * scale.astype(x.dtype)
    proj = jnp.mean(dxhat * xhat, -1, keepdims=True)
    inner = dxhat - xhat * proj
    if center:
        inner = inner - jnp.mean(dxhat, -1, keepdims=True)
    dx = inv * inner
    lead = tuple(range(x.ndim - 1))
    dscale = None if scale is None else jnp.sum(g * xhat, lead).astype(scale.dtype)
    return dx.astype(x.dtype), dscale


def _ln_fast_vjp(eps):
    def fwd(x, scale, bias):
        (y, st), res = _ln_fast_fwd(x, scale, bias, eps, stats=True)
        return (y, st), res

    def bwd(args, res, ct):
        x, scale, bias = args
        mean, inv = res
        g = ct[0]
        dx, dscale = _norm_bwd(x, scale, mean, inv, g, center=True)
        dbias = None if bias is None else jnp.sum(g, tuple(range(x.ndim - 1))).astype(bias.dtype)
        return dx, dscale, dbias

    def zeros(x, scale, bias):
        z = jnp.zeros(x.shape[:-1] + (1,), x.dtype)
        return z, z

    return fwd, bwd, zeros


def _ln_stable(x, scale, bias, eps, *, stats):
    xf = x.astype(_F32)
    mean = jnp.mean(xf, -1, keepdims=True)
    xc = xf - mean
    var = jnp.mean(jnp.square(xc), -1, keepdims=True)  # two-pass, f32
    inv = lax.rsqrt(var + eps)
    y = _affine(xc * inv, _f32(scale), _f32(bias))
    return y.astype(x.dtype), ({"inv_std": probe.op_stats(inv)} if stats else None)


def _safe_inv_std(xc, eps):
    """Per-row ``1/sqrt(var + eps)`` of centred rows; 0 where ``var + eps`` is 0 (degenerate)."""
    var = jnp.mean(jnp.square(xc), -1, keepdims=True)
    d = var + eps
    ok = d > 0
    return jnp.where(ok, lax.rsqrt(jnp.where(ok, d, 1.0)), 0.0)


def _safe_probe_inv_std(xf, eps, center):
    """Probe of the per-row inverse std the SAFE path uses (0 on degenerate rows).

    Computed on power-of-two compressed rows (``x·s``, ``eps·s²``), then scaled back by ``s``.
    """
    e = _range_exponent(xf, axis=-1, keepdims=True)
    xs = xf * _pow2(-e)
    if center:
        xs = xs - jnp.mean(xs, -1, keepdims=True)
    return probe.op_stats(_safe_inv_std(xs, eps * _pow2(-2 * e)) * _pow2(-e))


def _ln_safe(x, scale, bias, eps, *, stats):
    xf = x.astype(_F32)
    # the kernel compresses each row by a power of two (LN(x; eps) == LN(x·s; eps·s²)),
    # sums with compensation, and defines a zero-variance row with eps=0 as 0 (then + bias)
    y = _kernels().safe_layer_norm(xf, _f32(scale), _f32(bias), eps=eps)
    st = {"inv_std": _safe_probe_inv_std(xf, eps, True)} if stats else None
    return _saturate(y, x.dtype), st


def _f32(a):
    return None if a is None else a.astype(_F32)


def layer_norm(
    x: jax.typing.ArrayLike,
    scale: jax.typing.ArrayLike | None,
    bias: jax.typing.ArrayLike | None,
    eps: float = 1e-6,
    gear: Any = 0,
    *,
    return_stats: bool = False,
):
    """LayerNorm over the last axis: ``(x - mean) / sqrt(var + eps) * scale + bias``.

    FAST: ``flax.nnx.LayerNorm``'s math (fast variance ``E[x²] - E[x]²``) in ``x.dtype``; a
    constant row with ``eps=0`` gives 0·inf = NaN. STABLE: f32 two-pass statistics. SAFE:
    ``kernels.safe_layer_norm`` in f32 (per-row power-of-two range compression, compensated
    two-pass statistics; a zero-variance row with ``eps=0`` gives ``bias`` (0 before the
    affine) with finite gradients).

    Args:
      x: ``[..., features]``.
      scale: ``[features]`` or None.
      bias: ``[features]`` or None.
      eps: added to the variance (a Python float).
      gear: FAST/STABLE/SAFE.
      return_stats: also return ``{"inv_std": stats}``: ``detector.stats`` of the per-row
        ``1/sqrt(var + eps)``; its ``max_abs`` is ``1/sqrt(min var + eps)``, the precursor of a
        collapsing variance (inf when a row is degenerate in FAST/STABLE).

    Returns:
      ``x``'s float dtype, same shape; with ``return_stats`` a tuple ``(y, stats)``.
    """
    x = jnp.asarray(x)
    x = x.astype(_float_dtype(x))
    scale = None if scale is None else jnp.asarray(scale)
    bias = None if bias is None else jnp.asarray(bias)
    eps = float(eps)
    branches = [
        functools.partial(lambda f, x, s, b: f(x, s, b, eps, stats=True), f)
        for f in (_ln_fast, _ln_stable, _ln_safe)
    ]
    y, st = _switch_fast_vjp(gear, branches, _FastVJP(*_ln_fast_vjp(eps)), x, scale, bias)
    return (y, st) if return_stats else y


def _rms_fast(x, scale, eps, *, stats):
    # flax.nnx.RMSNorm's math in x.dtype: an all-zero row with eps=0 is 0 * inf = NaN.
    ms = jnp.mean(jnp.square(x), -1, keepdims=True)
    inv = lax.rsqrt(ms + jnp.asarray(eps, x.dtype))
    mul = inv if scale is None else inv * scale.astype(x.dtype)
    return x * mul, ({"inv_std": probe.op_stats(inv)} if stats else None)


def _rms_fast_vjp(eps):
    def fwd(x, scale):
        out = _rms_fast(x, scale, eps, stats=True)
        inv = lax.rsqrt(jnp.mean(jnp.square(x), -1, keepdims=True) + jnp.asarray(eps, x.dtype))
        return out, (inv,)

    def bwd(args, res, ct):
        x, scale = args
        (inv,) = res
        return _norm_bwd(x, scale, None, inv, ct[0], center=False)

    def zeros(x, scale):
        return (jnp.zeros(x.shape[:-1] + (1,), x.dtype),)

    return fwd, bwd, zeros


def _rms_stable(x, scale, eps, *, stats):
    xf = x.astype(_F32)
    inv = lax.rsqrt(jnp.mean(jnp.square(xf), -1, keepdims=True) + eps)
    y = _affine(xf * inv, _f32(scale), None)
    return y.astype(x.dtype), ({"inv_std": probe.op_stats(inv)} if stats else None)


def _rms_safe(x, scale, eps, *, stats):
    xf = x.astype(_F32)
    y = _kernels().safe_rms_norm(xf, _f32(scale), eps=eps)
    st = {"inv_std": _safe_probe_inv_std(xf, eps, False)} if stats else None
    return _saturate(y, x.dtype), st


def rms_norm(
    x: jax.typing.ArrayLike,
    scale: jax.typing.ArrayLike | None,
    eps: float = 1e-6,
    gear: Any = 0,
    *,
    return_stats: bool = False,
):
    """RMSNorm over the last axis: ``x / sqrt(mean(x²) + eps) * scale``.

    FAST: ``flax.nnx.RMSNorm``'s math in ``x.dtype`` (an all-zero row with ``eps=0`` gives NaN;
    fp16 ``x²`` overflows past 256, silently zeroing the row). STABLE: f32 statistics. SAFE:
    ``kernels.safe_rms_norm`` in f32 (per-row range compression, compensated sum of squares; a
    zero row gives 0, finite gradients).

    Returns:
      ``x``'s float dtype; with ``return_stats`` a tuple ``(y, {"inv_std": stats})`` (see
      ``layer_norm``).
    """
    x = jnp.asarray(x)
    x = x.astype(_float_dtype(x))
    scale = None if scale is None else jnp.asarray(scale)
    eps = float(eps)
    branches = [
        functools.partial(lambda f, x, s: f(x, s, eps, stats=True), f)
        for f in (_rms_fast, _rms_stable, _rms_safe)
    ]
    y, st = _switch_fast_vjp(gear, branches, _FastVJP(*_rms_fast_vjp(eps)), x, scale)
    return (y, st) if return_stats else y
