"""Public safe sum / mean: dispatch between the Pallas kernel and the jnp reference."""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from nan2safe_jax.kernels import _common, _layout
from nan2safe_jax.kernels.safe_reduce import pallas, reference
from nan2safe_jax.manual_axes import cotangents_like

Axis = None | int | Sequence[int]


def _prepare(x: ArrayLike, op: str) -> jax.Array:
    x = jnp.asarray(x)
    if jnp.issubdtype(x.dtype, jnp.complexfloating):
        raise TypeError(f"{op}: complex input is not supported, got {x.dtype}")
    if not jnp.issubdtype(x.dtype, jnp.floating):
        x = x.astype(_common.acc_dtype())  # ints/bools: exact up to 2**24 (2**53 under x64)
    return x


def _forward(x, axes, impl, interpret, mean):
    op = "safe_mean" if mean else "safe_sum"
    acc = _common.acc_dtype()
    x2d, kept = _layout.to_rows(x, axes)
    if impl == "auto":
        fn = functools.partial(pallas.sum_rows, acc=acc, interpret=interpret)
        ok = _common.pallas_compiles(op, (x2d.shape, x2d.dtype, acc, interpret), fn, x2d)
        impl = "pallas" if ok else "reference"
    if impl == "pallas":
        total, counts = pallas.sum_rows(x2d, acc=acc, interpret=interpret)
    else:
        total, counts = reference.sum_rows(x2d, acc)
    if mean:
        total = total / jnp.asarray(x2d.shape[1], acc)
    return total.reshape(kept), jnp.sum(counts, dtype=jnp.int32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3, 4))
def _safe_sum(x, axes, impl, interpret, mean):
    return _forward(x, axes, impl, interpret, mean)


def _fwd(x, axes, impl, interpret, mean):
    # Residual: a zero-size slice of x that carries its shape, dtype and (inside shard_map)
    # the mesh axes it varies over.
    return _forward(x, axes, impl, interpret, mean), x[None][:0]


def _bwd(axes, impl, interpret, mean, res, cts):
    # The derivative of a sum is exactly 1 per element (compensation does not change it); the
    # mean divides by the element count. Nothing here makes a NaN out of a finite cotangent.
    del impl, interpret
    x_shape, x_dtype = res.shape[1:], res.dtype
    g, _ = cts
    if mean:
        count = 1
        for a in axes:
            count *= x_shape[a]
        g = g / jnp.asarray(count, g.dtype)
    g = jnp.expand_dims(g, axes) if axes else g
    return cotangents_like((jnp.broadcast_to(g, x_shape).astype(x_dtype),), (res,))


_safe_sum.defvjp(_fwd, _bwd)
# One executable per static configuration: eager calls dispatch once, jit callers inline it.
_safe_sum_jit = jax.jit(_safe_sum, static_argnums=(1, 2, 3, 4))


def _call(x, axis, implementation, with_count, mean):
    op = "safe_mean" if mean else "safe_sum"
    x = _prepare(x, op)
    axes = _layout.normalize_axes(axis, x.ndim, op)
    if mean:
        n = 1
        for a in axes:
            n *= x.shape[a]
        if n == 0:
            raise ValueError(f"{op}: the mean over zero elements is undefined (shape {x.shape})")
    impl, interpret = _common.resolve(implementation, op)
    total, count = _safe_sum_jit(x, axes, impl, interpret, mean)
    return (total, count) if with_count else total


def safe_sum(
    x: ArrayLike,
    axis: Axis = None,
    *,
    implementation: str | None = None,
    with_count: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Neumaier-compensated sum that neither overflows a half-precision input nor loses the
    small terms of a long sum.

    Accumulates in f32 (f64 when ``jax_enable_x64`` is on and the backend has f64): a vector
    of Neumaier accumulators per tile, combined by TwoSum trees. The result is within a few
    f32 ulps of the exact sum (checked against ``math.fsum``), where a naive f32 sum of
    cancelling data can be off by orders of magnitude.

    Args:
      x: array of any float dtype (ints are converted to the accumulation dtype).
      axis: None (all axes), an int or a tuple of ints.
      implementation: None (Pallas on GPU/TPU, the jnp reference on CPU; falls back to the
        reference with a one-time warning if the kernel does not lower), "pallas" (interpret
        mode on CPU) or "reference".
      with_count: also return the int32 number of non-finite inputs.

    Returns:
      The sum, dtype f32 (f64 under x64) whatever the input dtype, shape ``x.shape`` without
      ``axis``; with ``with_count``, ``(sum, count)``. Non-finite inputs follow IEEE: NaN ->
      NaN, +inf -> +inf, +inf with -inf -> NaN. Partial sums beyond the accumulator's range
      (|sum| > 3.4e38 in f32) overflow to inf.

    Gradient: ``custom_vjp``, exact (ones, broadcast), cast to ``x.dtype``.

    References:
      Neumaier (1974); Knuth TwoSum (TAOCP vol. 2).
    """
    return _call(x, axis, implementation, with_count, mean=False)


def safe_mean(
    x: ArrayLike,
    axis: Axis = None,
    *,
    implementation: str | None = None,
    with_count: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Compensated mean: ``safe_sum(x, axis) / n`` (one more rounding). See ``safe_sum``.

    Raises:
      ValueError: when the reduction covers zero elements.
    """
    return _call(x, axis, implementation, with_count, mean=True)
