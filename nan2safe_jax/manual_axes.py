"""Cotangents of a ``custom_vjp`` inside ``shard_map``: typed as their primals over mesh axes.

Inside ``shard_map`` each value is *varying* over the mesh axes where devices hold different
values (the batch) and *invariant* over the others (a replicated weight, ``P()``). JAX's own
autodiff sums a weight's per-device cotangent over the devices (the transpose of the implicit
``pvary`` is ``psum``); a ``custom_vjp``'s backward must do it itself, since it has to return
every cotangent with its primal's type. The SAFE kernels' and the gear switch's backward rules
computed a weight's cotangent from the varying batch and returned it varying: a type error at
the first gradient of a converted model in a ``shard_map`` (review22).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

__all__ = ["cotangents_like", "varying_axes"]


def varying_axes(x: Any) -> frozenset:
    """The mesh axes ``x`` varies over (empty outside ``shard_map``)."""
    aval = jax.typeof(x)
    mat = getattr(aval, "mat", None)  # jax 0.10: the manual axis type
    if mat is not None:
        return frozenset(getattr(mat, "varying", ()))
    return frozenset(getattr(aval, "vma", ()))  # earlier jax


def _like(ct: Any, primal: Any) -> Any:
    if ct is None or primal is None or not hasattr(ct, "dtype"):
        return ct
    if not jnp.issubdtype(ct.dtype, jnp.inexact):  # float0 of an integer input
        return ct
    extra = varying_axes(ct) - varying_axes(primal)
    return lax.psum(ct, tuple(sorted(extra))) if extra else ct


def cotangents_like(cts: Any, primals: Any) -> Any:
    """``cts`` with each cotangent summed over the mesh axes it varies over and its primal
    does not (a replicated weight's gradient from a sharded batch).

    Args:
      cts: the backward rule's cotangents, one per primal (``None`` allowed).
      primals: the primal inputs (or values of their type), the same structure.

    Returns:
      ``cts``, typed as ``primals`` over the mesh axes; unchanged outside ``shard_map``.
    """
    is_none = lambda x: x is None  # noqa: E731
    flat_c, tree = jax.tree_util.tree_flatten(cts, is_leaf=is_none)
    flat_p = jax.tree_util.tree_leaves(primals, is_leaf=is_none)
    if len(flat_c) != len(flat_p):
        return cts
    fixed = [_like(c, p) for c, p in zip(flat_c, flat_p, strict=True)]
    return jax.tree_util.tree_unflatten(tree, fixed)
