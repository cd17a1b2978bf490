"""Numerics shared by the SAFE paths: saturating casts and exact power-of-two range scaling."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

_F32 = jnp.float32
_HIGHEST = lax.Precision.HIGHEST


def _float_dtype(x: jax.Array) -> jnp.dtype:
    dt = jnp.dtype(x.dtype)
    return dt if jnp.issubdtype(dt, jnp.floating) else jnp.dtype(_F32)


def _saturate(y: jax.Array, dtype) -> jax.Array:
    """Casts ``y`` to ``dtype``, clipping to the dtype's finite range (NaN stays NaN)."""
    dtype = jnp.dtype(dtype)
    if jnp.dtype(y.dtype) == dtype:
        return y
    if jnp.finfo(dtype).max < jnp.finfo(y.dtype).max:
        big = float(jnp.finfo(dtype).max)
        y = jnp.clip(y, -big, big)
    return y.astype(dtype)


def _times_pow2_saturated(v: jax.Array, *exponents: jax.Array) -> jax.Array:
    """``v · 2^(sum of exponents)`` in f32, saturated at f32's largest finite value where it
    would overflow, with no inf on the way (NaN and inf stay as they are; a result below f32's
    smallest normal reads 0, as the CPU flushes it).

    For a SAFE probe's statistic scaled back from its range-compressed form: past f32 it reads
    as full headroom, not as an inf that the SAFE path itself never computed. A model probe
    that reads an inf makes the step an incident (``train.model_probes_nonfinite``), and a
    multiply that overflowed would be tier 2's first non-finite value. The exponent is moved
    in the bits (``frexp`` and ``ldexp`` took 94 HLO instructions, a sixth of the general
    program's growth, per probe).

    Args:
      v: f32.
      *exponents: integers (``_range_exponent``'s), broadcastable with ``v``.
    """
    v = jnp.asarray(v, _F32)
    bits = lax.bitcast_convert_type(v, jnp.int32)
    field = _exponent_field(v)
    t = field + sum(jnp.asarray(x, jnp.int32) for x in exponents)
    moved = (bits & jnp.int32(~(0xFF << 23))) | lax.shift_left(jnp.clip(t, 1, 254), jnp.int32(23))
    out = lax.bitcast_convert_type(moved, _F32)
    big = jnp.full_like(v, float(jnp.finfo(_F32).max))
    out = jnp.where(t > 254, jnp.where(v < 0, -big, big), out)
    out = jnp.where((t < 1) | (field == 0), jnp.zeros_like(v), out)
    return jnp.where(field == 0xFF, v, out)


def _exponent_field(v: jax.Array) -> jax.Array:
    """The biased exponent bits of f32 ``v`` (int32: 0 for zero and subnormals, 255 for inf
    and NaN; a normal ``|v|`` is ``m · 2^(field - 127)``, ``m`` in [1, 2))."""
    bits = lax.bitcast_convert_type(jnp.asarray(v, _F32), jnp.int32)
    return lax.shift_right_logical(bits, jnp.int32(23)) & 0xFF


def _pow2(e: jax.Array) -> jax.Array:
    """Exactly ``2.0**e`` in f32 for integer ``e`` (clipped to the normal range [-126, 127])."""
    e = jnp.clip(e.astype(jnp.int32), -126, 127)
    return lax.bitcast_convert_type(lax.shift_left(e + 127, jnp.int32(23)), _F32)


def _scale_back(x: jax.Array, *exponents: jax.Array) -> jax.Array:
    """``x * 2**e1 * 2**e2 ...``, one exact power of two at a time, with an optimization
    barrier between them (forward and backward): XLA folds a chain of multiplications by
    broadcast scalars into one product, and ``2**e1 * 2**e2`` is inf once ``e1 + e2 >= 128``
    (SAFE's logits past the f32 range), so ``0 * inf`` made the gradient NaN under ``jit``
    where the eager one was finite."""
    for i, e in enumerate(exponents):
        if i:
            x = lax.optimization_barrier(x)
        x = x * _pow2(e)
    return x


def _range_exponent(x: jax.Array, axis=None, keepdims=False) -> jax.Array:
    """``e`` with ``max|x| * 2**-e`` in [0.5, 1) (0 for an all-zero or non-finite max).

    Dynamic range compression: multiplying by ``_pow2(-e)`` (and later by ``_pow2(e)``) is exact
    in binary floating point, barring subnormals. Not differentiated (a constant factor).
    """
    amax = lax.stop_gradient(jnp.max(jnp.abs(x), axis=axis, keepdims=keepdims, initial=0.0))
    amax = amax.astype(_F32)  # exact for every narrower float
    # frexp's exponent from the bits (``jnp.frexp`` compiled ~25 instructions per call, in
    # every SAFE path of the general program)
    e = jnp.where(amax == 0, 0, _exponent_field(amax) - 126)
    return jnp.where(jnp.isfinite(amax), jnp.clip(e, -120, 120), 0).astype(jnp.int32)


def _kernels():
    from nan2safe_jax import kernels  # lazy: only the SAFE paths need it

    return kernels


def _check_rank(x: jax.Array, ndim: int, name: str, op: str) -> None:
    if x.ndim != ndim:
        raise ValueError(f"{op}: {name} must have rank {ndim}, got shape {x.shape}")
