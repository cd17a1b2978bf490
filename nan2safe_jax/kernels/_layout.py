"""Reshaping helpers: any reduction becomes a row reduction over a 2-D ``(rows, cols)`` array."""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp


def normalize_axes(axis: None | int | Sequence[int], ndim: int, op: str) -> tuple[int, ...]:
    if axis is None:
        return tuple(range(ndim))
    axes = (axis,) if isinstance(axis, int) else tuple(axis)
    out = []
    for a in axes:
        if not isinstance(a, int):
            raise TypeError(f"{op}: axis must be None, an int or a tuple of ints, got {axis!r}")
        if not -ndim <= a < max(ndim, 1):
            raise ValueError(f"{op}: axis {a} is out of range for an array of rank {ndim}")
        out.append(a % ndim if ndim else 0)
    if len(set(out)) != len(out):
        raise ValueError(f"{op}: repeated axis in {axis!r}")
    return tuple(sorted(out))


def to_rows(x: jax.Array, axes: tuple[int, ...]) -> tuple[jax.Array, tuple[int, ...]]:
    """Moves ``axes`` last and flattens: returns ``(x2d[rows, cols], kept_shape)``."""
    if x.ndim == 0:
        return x.reshape(1, 1), ()
    kept = [a for a in range(x.ndim) if a not in axes]
    xt = jnp.transpose(x, kept + list(axes)) if kept + list(axes) != list(range(x.ndim)) else x
    kept_shape = tuple(x.shape[a] for a in kept)
    rows = 1
    for d in kept_shape:
        rows *= d
    cols = 1
    for a in axes:
        cols *= x.shape[a]
    return xt.reshape(rows, cols), kept_shape


def last_axis_rows(x: jax.Array, axis: int, op: str) -> tuple[jax.Array, tuple[int, ...], int]:
    """For row-wise ops along one axis: ``(x2d, moved_shape, axis)``; undo with ``from_rows``."""
    if x.ndim == 0:
        raise ValueError(f"{op}: needs an array of rank >= 1, got a scalar")
    (ax,) = normalize_axes(axis, x.ndim, op)
    xm = jnp.moveaxis(x, ax, -1) if ax != x.ndim - 1 else x
    # not -1: a reshape cannot infer it when the axis is empty
    return xm.reshape(math.prod(xm.shape[:-1]), x.shape[ax]), xm.shape, ax


def from_rows(y2d: jax.Array, moved_shape: tuple[int, ...], ax: int) -> jax.Array:
    y = y2d.reshape(moved_shape)
    return jnp.moveaxis(y, -1, ax) if ax != len(moved_shape) - 1 else y
