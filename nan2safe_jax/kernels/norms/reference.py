"""Pure-jnp safe layer norm / RMS norm: the XLA fallback and the oracle of the Pallas kernels.

Statistics (shared with the kernels):
  * dynamic range compression: each row is multiplied by an exact power of two ``sc`` that
    puts its largest |x| in [1, 4), so neither ``x - mean`` nor ``x**2`` can overflow (bf16 and
    f32 inputs near their max) or underflow (tiny rows with eps = 0); the result is unchanged
    because ``(x*sc - mean*sc) / sqrt(var*sc**2 + eps*sc**2)`` is the same number;
  * compensated sums (TwoSum tree here, Neumaier lanes in the kernel);
  * layer norm: corrected two-pass variance ``mean(d**2) - mean(d)**2`` with
    ``d = x - mean`` (Chan, Golub & LeVeque 1983), clamped at 0; a constant row normalises to
    exactly 0, not to the rounding residue of its mean;
  * degenerate rows are finite: ``var + eps == 0`` (a constant row with eps = 0) gives a
    normalised output of 0 for layer norm (so ``y = bias``); an all-zero row with eps = 0 gives
    0 for RMS norm. Double-where keeps the gradient finite there;
  * a row holding a non-finite input gives a NaN row (propagated, never created); the
    non-finite inputs are counted.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from nan2safe_jax.kernels import _common


def inv_std(v: jax.Array, eps: float, sc: jax.Array) -> jax.Array:
    """``1 / sqrt(v)`` for ``v = var*sc**2 + eps*sc**2 >= 0``; 0 where v == 0.

    When ``eps * sc**2`` overflows (tiny rows), the variance term is negligible and the value
    is ``1 / (sqrt(eps) * sc)``, computed without the overflow.
    """
    ok = v > 0
    inv = jnp.where(ok, lax.rsqrt(jnp.where(ok, v, 1)), 0)
    if eps:
        inv = jnp.where(_common.isfinite(v), inv, (1.0 / sc) * float(eps) ** -0.5)
    return inv.astype(v.dtype)


def eps_scaled(eps: float, sc: jax.Array) -> jax.Array | float:
    return (float(eps) * sc) * sc if eps else 0.0


def _prologue(x2d, acc):
    x = x2d.astype(acc)
    fin = jnp.isfinite(x)
    counts = jnp.sum(~fin, axis=-1, dtype=jnp.int32)
    bad = jnp.any(~fin, axis=-1, keepdims=True)
    xf = jnp.where(fin, x, 0)
    sc = lax.stop_gradient(_common.pow2_scale(jnp.max(jnp.abs(xf), axis=-1, keepdims=True)))
    return xf * sc, sc, bad, counts


@functools.partial(jax.jit, static_argnames=("eps", "acc"))
def layer_norm_stats(x2d, eps: float, acc: jnp.dtype):
    """``(yhat, inv, counts)``: normalised rows (NaN rows where an input is non-finite), the
    inverse standard deviation in x's units (0 for degenerate rows), counts per row."""
    xs, sc, bad, counts = _prologue(x2d, acc)
    n = xs.shape[-1]
    mean = (_common.tree_sum(xs) / n)[..., None]
    d = xs - mean
    sd, sdd = (_common.tree_sum(jnp.stack([d, d * d])) / n)[..., None]  # one tree, two sums
    var = jnp.maximum(sdd - sd * sd, 0)
    inv = inv_std(var + eps_scaled(eps, sc), eps, sc)
    # A constant row is 0 exactly: ``sum / n`` rounds off its value, and the rounding residue
    # ``d - sd`` (~4e-9) over the residue's own spread, or times 1/sqrt(eps), was 0.7 or 7e7.
    flat = jnp.max(xs, axis=-1, keepdims=True) == jnp.min(xs, axis=-1, keepdims=True)
    yhat = jnp.where(bad, jnp.nan, jnp.where(flat, 0, (d - sd) * inv))
    big = jnp.finfo(acc).max
    return yhat, jnp.minimum(inv * sc, big), counts


@functools.partial(jax.jit, static_argnames=("eps", "acc"))
def rms_norm_stats(x2d, eps: float, acc: jnp.dtype):
    """``(xhat, inv, counts)`` for RMS norm, as ``layer_norm_stats``."""
    xs, sc, bad, counts = _prologue(x2d, acc)
    n = xs.shape[-1]
    ms = (_common.tree_sum(xs * xs) / n)[..., None]
    inv = inv_std(ms + eps_scaled(eps, sc), eps, sc)
    xhat = jnp.where(bad, jnp.nan, xs * inv)
    big = jnp.finfo(acc).max
    return xhat, jnp.minimum(inv * sc, big), counts


def layer_norm_rows(x2d, scale, bias, eps: float, acc: jnp.dtype):
    """Safe layer norm of the rows of ``x2d`` in ``acc`` -> ``(y[acc], counts[rows])``."""
    yhat, _, counts = layer_norm_stats(x2d, eps, acc)
    if scale is not None:
        yhat = yhat * scale.astype(acc)
    if bias is not None:
        yhat = yhat + bias.astype(acc)
    return yhat, counts


def rms_norm_rows(x2d, scale, eps: float, acc: jnp.dtype):
    """Safe RMS norm of the rows of ``x2d`` in ``acc`` -> ``(y[acc], counts[rows])``."""
    xhat, _, counts = rms_norm_stats(x2d, eps, acc)
    if scale is not None:
        xhat = xhat * scale.astype(acc)
    return xhat, counts
