"""Public safe softmax: dispatch between the Pallas kernel and the jnp reference."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from nan2safe_jax.kernels import _common, _layout
from nan2safe_jax.kernels.softmax import pallas, reference
from nan2safe_jax.manual_axes import cotangents_like


def _forward(x, where, axis, impl, interpret):
    acc = _common.acc_dtype()
    x2d, moved, ax = _layout.last_axis_rows(x, axis, "safe_softmax")
    m2d = None
    if where is not None:
        m2d, _, _ = _layout.last_axis_rows(jnp.broadcast_to(where, x.shape), axis, "safe_softmax")
    if impl == "auto":
        fn = functools.partial(pallas.softmax_rows, acc=acc, out_dtype=x.dtype, interpret=interpret)
        key = (x2d.shape, x2d.dtype, where is not None, acc, interpret)
        impl = "pallas" if _common.pallas_compiles("safe_softmax", key, fn, x2d, m2d) else "ref"
    if impl == "pallas":
        y2d, counts = pallas.softmax_rows(x2d, m2d, acc=acc, out_dtype=x.dtype, interpret=interpret)
    else:
        y2d, counts = reference.softmax_rows(x2d, m2d, acc)
        y2d = y2d.astype(x.dtype)
    return _layout.from_rows(y2d, moved, ax), jnp.sum(counts, dtype=jnp.int32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _safe_softmax(x, where, axis, impl, interpret):
    return _forward(x, where, axis, impl, interpret)


def _fwd(x, where, axis, impl, interpret):
    y, count = _forward(x, where, axis, impl, interpret)
    return (y, count), y


def _bwd(axis, impl, interpret, y, cts):
    # dx = y * (g - sum(g * y)); entries with y == 0 (masked, fully-masked rows, -inf) get
    # exactly 0 even if g is inf/NaN there (double where), so no NaN is created.
    del impl, interpret
    g, _ = cts
    acc = _common.acc_dtype()
    yf = y.astype(acc)
    zero = yf == 0
    gy = jnp.where(zero, 0, g.astype(acc) * yf)
    s = jnp.sum(gy, axis=axis, keepdims=True)
    dx = jnp.where(zero, 0, gy - yf * s)
    return cotangents_like(dx.astype(y.dtype), y), None


_safe_softmax.defvjp(_fwd, _bwd)
# One executable per static configuration: eager calls dispatch once, jit callers inline it.
_safe_softmax_jit = jax.jit(_safe_softmax, static_argnums=(2, 3, 4))


def safe_softmax(
    x: ArrayLike,
    axis: int = -1,
    where: ArrayLike | None = None,
    *,
    implementation: str | None = None,
    with_count: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """NaN-free softmax: max subtraction, compensated denominator, fully-masked rows -> 0.

    Computes in f32 (f64 under x64) and casts to ``x.dtype`` on store.

    Args:
      x: float array.
      axis: the softmax axis (one int).
      where: optional boolean mask broadcastable to ``x``; False entries are ignored (their
        probability is 0 and their value is never read, even if it is NaN).
      implementation: None (Pallas on GPU/TPU, the jnp reference on CPU; reference with a
        one-time warning if the kernel does not lower), "pallas" (interpret mode on CPU) or
        "reference".
      with_count: also return the int32 number of unmasked non-finite inputs.

    Returns:
      ``softmax(x)`` with ``x.dtype``; rows with no unmasked entry or only -inf give zeros;
      +inf entries share the row's mass; an unmasked NaN makes its row NaN (propagated, never
      created). With ``with_count``, ``(y, count)``.

    Gradient: ``custom_vjp``, ``dx = y * (g - sum(g * y))`` in f32, exactly 0 where y == 0
    (so fully-masked rows have zero gradient).
    """
    x = jnp.asarray(x)
    _common.check_float(x, "x", "safe_softmax")
    if not isinstance(axis, int):
        raise TypeError(f"safe_softmax: axis must be one int, got {axis!r}")
    _layout.normalize_axes(axis, x.ndim, "safe_softmax")
    if where is not None:
        where = jnp.asarray(where)
        try:
            jnp.broadcast_shapes(where.shape, x.shape)
        except ValueError:
            raise ValueError(
                f"safe_softmax: where of shape {where.shape} does not broadcast to x of shape "
                f"{x.shape}"
            ) from None
        where = jnp.broadcast_to(where.astype(bool), x.shape)
    if x.size == 0:  # no row to reduce (an empty axis): nothing to compute, nothing non-finite
        return (x, jnp.zeros([], jnp.int32)) if with_count else x
    impl, interpret = _common.resolve(implementation, "safe_softmax")
    y, count = _safe_softmax_jit(x, where, axis, impl, interpret)
    return (y, count) if with_count else y
