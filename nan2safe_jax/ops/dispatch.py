"""Gear dispatch: one op, three paths, the gear as data.

A Python int dispatches directly (no ``cond`` in the program); anything else, notably a traced
int32 scalar inside ``jit``, goes through ``lax.switch``: one compile serves all three gears.
``branch_site`` re-enters a site's name scope inside every branch so the localizer can name it,
and ``_switch_fast_vjp`` keeps the FAST backward from paying for the untaken paths.

Gears whose paths are the same function (an op passes the same callable, decided at trace time
from the dtype: an f32 ``Linear``'s STABLE *is* its FAST) share one branch: XLA compiles each
distinct path once, and a gear that maps to a single path needs no ``switch`` at all.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from nan2safe_jax.site import branch_site as branch_site  # re-exported: ops.branch_site
from nan2safe_jax.site import current_branch_site, scoped


def _static_gear(gear: Any) -> int | None:
    """The gear as a Python int when it is known at trace time, else None."""
    if isinstance(gear, jax.core.Tracer):
        return None
    try:
        g = operator.index(gear)
    except TypeError:
        return None
    return g


def _distinct(gear: jax.Array, branches: Sequence[Callable[..., Any]]):
    """``(index, unique)``: the distinct branches (first occurrence order) and the gear mapped
    onto them (clamped to ``[0, len(branches) - 1]`` first, as ``lax.switch`` does)."""
    unique: list[Callable[..., Any]] = []
    table = []
    for b in branches:
        found = next((i for i, u in enumerate(unique) if u is b), None)
        if found is None:
            unique.append(b)
            found = len(unique) - 1
        table.append(found)
    if len(unique) == len(branches):
        return gear, unique
    idx = jnp.clip(gear, 0, len(branches) - 1)
    return jnp.asarray(table, jnp.int32)[idx], unique


def switch(gear: Any, branches: Sequence[Callable[..., Any]], *operands: Any) -> Any:
    """Runs ``branches[gear](*operands)``.

    A Python int (or any concrete integer scalar) calls the branch directly; a traced gear goes
    through ``lax.switch`` (index clamped to ``[0, len(branches) - 1]``, as ``lax.switch`` does).

    Args:
      gear: ``Gear`` / int, or an int32 scalar array (may be traced).
      branches: one callable per gear (FAST, STABLE, SAFE).
      *operands: passed to the branch; pytrees (``None`` allowed).

    Raises:
      ValueError: a Python int outside the branches, or a gear that is not a scalar.
    """
    g = _static_gear(gear)
    if g is not None:
        if isinstance(gear, int) and not 0 <= g < len(branches):
            raise ValueError(
                f"gear must be one of Gear.FAST/STABLE/SAFE (0..{len(branches) - 1}), got {gear!r}"
            )
        return branches[min(max(g, 0), len(branches) - 1)](*operands)
    gear = jnp.asarray(gear)
    if gear.ndim != 0:
        raise ValueError(
            f"gear must be a scalar, got shape {gear.shape}; a stacked site's gear (shape [L]) is "
            "sliced per layer by nnx.scan, index it (gear[i]) when calling an op directly"
        )
    if not jnp.issubdtype(gear.dtype, jnp.integer):
        gear = gear.astype(jnp.int32)
    gear, branches = _distinct(gear.astype(jnp.int32), branches)
    if len(branches) == 1:
        return branches[0](*operands)
    name = current_branch_site()
    if name is not None:
        branches = [scoped(b, name) for b in branches]
    return lax.switch(gear, tuple(branches), *operands)


class _FastVJP(NamedTuple):
    """The FAST path with a hand-written backward (see ``_switch_fast_vjp``)."""

    fwd: Callable[..., Any]  # (*args) -> (out, residuals)
    bwd: Callable[..., Any]  # (args, residuals, out_cotangent) -> arg cotangents
    zeros: Callable[..., Any]  # (*args) -> residuals-shaped zeros


def _switch_fast_vjp(gear, branches, fast: _FastVJP, *args):
    """``switch`` whose backward does not pay for the paths it did not take.

    Under ``jax.grad`` a plain ``lax.switch`` saves the union of every branch's residuals, the
    untaken ones zero-filled: for a memory-bound op (a norm) that doubles the FAST step. Here
    the forward saves the inputs plus FAST's own (small) residuals; the backward runs FAST's
    hand-written VJP, or recomputes the STABLE / SAFE branch under ``jax.vjp`` (those gears can
    afford a second forward). A Python-int gear dispatches directly with ordinary autodiff.
    Not forward-mode differentiable (``custom_vjp``) with a traced gear.
    """
    g = _static_gear(gear)
    if g is not None:
        return switch(g, branches, *args)
    gear = jnp.asarray(gear)
    if gear.ndim != 0:
        return switch(gear, branches, *args)  # raises the scalar error
    gear, branches = _distinct(gear.astype(jnp.int32), branches)
    if len(branches) == 1:  # every gear runs FAST's path: plain autodiff, no switch
        return branches[0](*args)
    return _fast_vjp_switch(gear, branches, fast, args)


def _fast_vjp_switch(gear, branches, fast: _FastVJP, args):
    """The ``custom_vjp`` of ``_switch_fast_vjp``: ``gear`` (traced int32) indexes the distinct
    ``branches``, FAST's first (``_distinct`` keeps the first occurrence first)."""
    name = current_branch_site()
    wrap = (lambda f: scoped(f, name)) if name is not None else (lambda f: f)
    branches = [wrap(b) for b in branches]
    n = len(branches)

    @jax.custom_vjp
    def run(gear, args):
        return lax.switch(gear, branches, *args)

    def run_fwd(gear, args):
        def others(i):
            return lambda *a: (branches[i](*a), fast.zeros(*a))

        fwds = [wrap(fast.fwd)] + [others(i) for i in range(1, n)]
        out, res = lax.switch(gear, fwds, *args)
        return out, (gear, args, res)

    def run_bwd(saved, ct):
        gear, args, res = saved

        def recompute(i):
            def bwd(args, res, ct):
                _, vjp = jax.vjp(branches[i], *args)
                return vjp(ct)

            return bwd

        fast_bwd = wrap(lambda args, res, ct: fast.bwd(args, res, ct))
        bwds = [fast_bwd] + [recompute(i) for i in range(1, n)]
        dargs = lax.switch(gear, bwds, args, res, ct)
        return None, tuple(dargs)

    run.defvjp(run_fwd, run_bwd)
    return run(gear, tuple(args))


def autodiff_fast(fast: Callable[..., Any]) -> _FastVJP:
    """A ``_FastVJP`` whose backward is JAX's own autodiff of ``fast``.

    FAST must be exactly what ``flax.nnx`` computes, gradients included, so its backward is
    not hand-written: the forward runs ``jax.vjp(fast, *args)`` and saves that pullback's
    residuals (FAST's own, nothing from the untaken paths); the backward rebuilds the pullback
    from them. The gradient is therefore the one ``jax.grad`` gives for the plain formula.
    """
    box: dict[str, Any] = {}

    def leaves_of(*args):
        out, pullback = jax.vjp(fast, *args)
        leaves, treedef = jax.tree_util.tree_flatten(pullback)
        return out, tuple(leaves), treedef

    def fwd(*args):
        out, leaves, box["treedef"] = leaves_of(*args)
        return out, leaves

    def bwd(args, res, ct):
        del args
        return jax.tree_util.tree_unflatten(box["treedef"], list(res))(ct)

    def zeros(*args):
        shapes = jax.eval_shape(lambda *a: leaves_of(*a)[1], *args)
        return tuple(jnp.zeros(s.shape, s.dtype) for s in shapes)

    return _FastVJP(fwd, bwd, zeros)
