"""Softmax and logsumexp with FAST / STABLE / SAFE paths."""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from nan2safe_jax.ops._numerics import (
    _F32,
    _float_dtype,
    _kernels,
    _saturate,
)
from nan2safe_jax.ops.dispatch import switch


def _softmax_fast(x, where, axis):
    if where is not None:
        x = jnp.where(where, x, -jnp.inf)  # the write-up's masking: a full row is 0/0 = NaN
    return jax.nn.softmax(x, axis=axis)


def _softmax_stable(x, where, axis):
    return _softmax_fast(x.astype(_F32), where, axis).astype(x.dtype)


def _softmax_safe(x, where, axis):
    y = _kernels().safe_softmax(x.astype(_F32), axis=axis, where=where)
    return y.astype(x.dtype)


def softmax(
    x: jax.typing.ArrayLike,
    axis: int = -1,
    where: jax.typing.ArrayLike | None = None,
    gear: Any = 0,
) -> jax.Array:
    """Softmax along ``axis``; entries where ``where`` is False are 0.

    FAST: ``jax.nn.softmax`` in ``x.dtype`` after setting masked entries to -inf, so a
    fully-masked row is exp(-inf)/sum = 0/0 = NaN (the write-up's padding-mask fault).
    STABLE: the same in f32. SAFE: ``kernels.safe_softmax`` in f32 (compensated denominator; a
    fully-masked row gives zeros with finite gradients).

    Args:
      x: logits.
      axis: the softmax axis.
      where: optional bool mask broadcastable to ``x``; True = keep.
      gear: FAST/STABLE/SAFE, a Python int or a (traced) int32 scalar.

    Returns:
      Probabilities in ``x``'s float dtype.
    """
    x = jnp.asarray(x)
    x = x.astype(_float_dtype(x))
    if where is not None:
        where = jnp.broadcast_to(jnp.asarray(where, bool), x.shape)
    branches = [functools.partial(f, axis=axis) for f in (_softmax_fast, _softmax_stable)]
    branches.append(functools.partial(_softmax_safe, axis=axis))
    return switch(gear, branches, x, where)


def _lse_plain(x, where, axis, keepdims):
    return jax.nn.logsumexp(x, axis=axis, where=where, keepdims=keepdims)


def _lse_stable(x, where, axis, keepdims):
    return _lse_plain(x.astype(_F32), where, axis, keepdims).astype(x.dtype)


def _lse_safe(x, where, axis, keepdims):
    xf = x.astype(_F32)
    valid = jnp.ones(x.shape, bool) if where is None else where
    m = jnp.max(jnp.where(valid, xf, -jnp.inf), axis=axis, keepdims=True, initial=-jnp.inf)
    m = lax.stop_gradient(jnp.where(jnp.isfinite(m), m, 0.0))
    z = jnp.where(valid, xf - m, 0.0)  # double-where: no exp of a masked (maybe huge) entry
    e = jnp.where(valid, jnp.exp(z), 0.0)
    s = _kernels().safe_sum(e, axis=axis)
    s = jnp.expand_dims(s, axis)
    tiny = jnp.finfo(_F32).tiny
    ok = s > tiny
    out = m + jnp.where(ok, jnp.log(jnp.where(ok, s, 1.0)), jnp.log(tiny))
    if not keepdims:
        out = jnp.squeeze(out, axis)
    return _saturate(out, x.dtype)


def logsumexp(
    x: jax.typing.ArrayLike,
    axis: int = -1,
    where: jax.typing.ArrayLike | None = None,
    gear: Any = 0,
    *,
    keepdims: bool = False,
) -> jax.Array:
    """``log(sum(exp(x)))`` along ``axis`` over the entries where ``where`` is True.

    FAST: ``jax.nn.logsumexp`` in ``x.dtype``: an fp16 sum of more than 65504 near-max terms
    overflows to inf, and a fully-masked row is -inf. STABLE: f32. SAFE: f32, compensated sum,
    log clamped at ``log(finfo(f32).tiny)`` (about -87.3) so a fully-masked row is finite, and
    finite gradients (zero on masked entries).

    Returns:
      ``x``'s float dtype, ``axis`` removed unless ``keepdims``.
    """
    x = jnp.asarray(x)
    x = x.astype(_float_dtype(x))
    if where is not None:
        where = jnp.broadcast_to(jnp.asarray(where, bool), x.shape)
    kw = dict(axis=axis, keepdims=keepdims)
    branches = [functools.partial(f, **kw) for f in (_lse_plain, _lse_stable, _lse_safe)]
    return switch(gear, branches, x, where)
