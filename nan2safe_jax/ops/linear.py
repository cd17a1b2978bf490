"""Dense layer matmul with FAST / STABLE / SAFE paths."""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from nan2safe_jax.ops._numerics import (
    _F32,
    _HIGHEST,
    _float_dtype,
    _pow2,
    _range_exponent,
    _saturate,
)
from nan2safe_jax.ops.dispatch import switch


def _dot_last(x, kernel, **kw):
    return lax.dot_general(x, kernel, (((x.ndim - 1,), (0,)), ((), ())), **kw)


def _bias_shape(bias, ndim):
    return jnp.reshape(bias, (1,) * (ndim - 1) + (-1,))


def _linear_fast(x, kernel, bias, *, precision):
    y = _dot_last(x, kernel.astype(x.dtype), precision=precision)
    if bias is not None:
        y = y + _bias_shape(bias.astype(x.dtype), y.ndim)
    return y


def _linear_stable(x, kernel, bias, *, precision):
    y = _dot_last(x, kernel.astype(x.dtype), precision=precision, preferred_element_type=_F32)
    if bias is not None:
        y = y + _bias_shape(bias.astype(_F32), y.ndim)
    return y.astype(x.dtype)


def _linear_safe(x, kernel, bias, *, precision):
    del precision
    xf, kf = x.astype(_F32), kernel.astype(_F32)
    ex, ek = _range_exponent(xf), _range_exponent(kf)
    y = _dot_last(xf * _pow2(-ex), kf * _pow2(-ek), precision=_HIGHEST)
    y = y * _pow2(ex) * _pow2(ek)
    if bias is not None:
        y = y + _bias_shape(bias.astype(_F32), y.ndim)
    return _saturate(y, x.dtype)


def linear(
    x: jax.typing.ArrayLike,
    kernel: jax.typing.ArrayLike,
    bias: jax.typing.ArrayLike | None = None,
    gear: Any = 0,
    *,
    precision: Any = None,
) -> jax.Array:
    """``x @ kernel + bias`` over the last axis of ``x``.

    FAST: ``lax.dot_general`` in ``x.dtype`` (``flax.nnx.Linear``'s math). STABLE:
    ``preferred_element_type=f32`` and the bias added in f32. SAFE: f32 operands compressed by
    powers of two, ``Precision.HIGHEST``, and a saturating cast back (an fp16 output past 65504
    is clipped to ±65504 instead of becoming inf).

    Args:
      x: ``[..., in_features]``.
      kernel: ``[in_features, out_features]`` (cast to ``x.dtype``).
      bias: ``[out_features]`` or None.
      gear: FAST/STABLE/SAFE.
      precision: ``lax.Precision`` for FAST/STABLE (SAFE always uses HIGHEST).

    Returns:
      ``[..., out_features]`` in ``x``'s float dtype.
    """
    x, kernel = jnp.asarray(x), jnp.asarray(kernel)
    x = x.astype(_float_dtype(x))
    bias = None if bias is None else jnp.asarray(bias)
    if x.shape[-1] != kernel.shape[0] or kernel.ndim != 2:
        raise ValueError(
            f"linear: x [..., {x.shape[-1]}] needs a kernel [{x.shape[-1]}, out], "
            f"got {kernel.shape}"
        )
    kw = dict(precision=precision)
    branches = [functools.partial(f, **kw) for f in (_linear_fast, _linear_stable, _linear_safe)]
    return switch(gear, branches, x, kernel, bias)
