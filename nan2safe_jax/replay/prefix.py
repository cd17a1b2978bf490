"""The forward prefix: decide a train step's culprit from its forward pass alone when it can be.

A flags replay of the whole step compiles the step's program with a reduction on every value:
about three times what the step itself compiles. Most faults of a train step are made in its
forward pass (a masked row, an overflowing logit), which is the first third of its equations.
So the top level is first replayed up to the *boundary* (the first equation of the backward
pass) and its flags are read twice:

* ``upper``: every non-finite value the prefix made counts, as if the rest of the step left all
  of them live (``Ctx.finalize()`` of a walk that did not return: nothing masked);
* ``lower``: only the values an equation of the prefix observes count
  (``Ctx.finalize(observed_only=True)``), which the rest of the step cannot undo.

The whole step's flags lie between the two. When the first equation flagged in ``upper`` (in
program order, ``search.first_flagged``) is also flagged in ``lower``, it is the whole step's
first flagged equation, and the search goes on from there without the whole step's replay.
Otherwise (a fault made in the backward pass, a NaN only masked later) the whole step is
replayed as before, and the prefix replay was the price of trying.

The fidelity check then compares only the step's outputs that the prefix computes (a train
step's forward probes and auxiliaries; ``watch``): the other outputs are not replayed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from nan2safe_jax.replay import _jax_compat as jc
from nan2safe_jax.replay import rules

__all__ = ["boundary", "decide", "first_nan", "producers", "watch"]

# A prefix must save at least this share of the level's equations to be worth its own compile.
MAX_SHARE = 0.6


def boundary(name_stacks: Sequence[str]) -> int | None:
    """Flat index of the first equation of the backward pass (a ``transpose`` in its name
    stack), or None when there is none or the prefix would not be much shorter than the level.

    Args:
      name_stacks: the level's flat equations' name stacks, in walk order.
    """
    n = len(name_stacks)
    for k, ns in enumerate(name_stacks):
        if "transpose(" in ns:
            return k if 0 < k <= MAX_SHARE * n else None
    return None


def producers(jaxpr: Any) -> list[tuple[int, int] | None]:
    """Per output of ``jaxpr``: ``(flat index, output position)`` of the equation producing it,
    numbered as ``interpret.walk`` numbers flat equations (call-like equations inlined); None for
    a literal, a constant or an argument passed through.
    """
    count = 0

    def go(jx: Any, srcs: list) -> list:
        nonlocal count
        env: dict[Any, Any] = dict(zip(jx.invars, srcs, strict=True))
        for eqn in jx.eqns:
            ins = [None if jc.is_literal(a) else env.get(a) for a in eqn.invars]
            rule = rules.rule_for(eqn)
            if rule is not None and rule.kind == "call":
                outs = go(rule.body(eqn)[0], ins)
            else:
                outs = [(count, p) for p in range(len(eqn.outvars))]
                count += 1
            env.update(zip(eqn.outvars, outs, strict=True))
        return [None if jc.is_literal(a) else env.get(a) for a in jx.outvars]

    return go(jaxpr, [None] * len(jaxpr.invars))


def watch(producers_: list, stop: int) -> dict[int, tuple[int, ...]]:
    """``{flat index: output positions}`` of the outputs produced before ``stop``."""
    out: dict[int, tuple[int, ...]] = {}
    for src in producers_:
        if src is not None and src[0] < stop:
            out[src[0]] = tuple(sorted({*out.get(src[0], ()), src[1]}))
    return out


def decide(
    upper: tuple[np.ndarray, np.ndarray], lower: tuple[np.ndarray, np.ndarray]
) -> tuple[int, str] | None:
    """``(flat index, "root" | "nan")`` of the whole level's first flagged equation, or None
    when the prefix cannot tell it.

    Args:
      upper: ``(root, nan)`` flags of the prefix with nothing masked (a superset of the level's).
      lower: ``(root, nan)`` flags with only observed values live (a subset of the level's).
    """
    root_u, nan_u = (np.asarray(a, bool) for a in upper)
    root_l, nan_l = (np.asarray(a, bool) for a in lower)
    any_u = root_u | nan_u
    if not any_u.any():
        return None
    k = int(np.argmax(any_u))
    mode = "root" if root_u[k] else "nan"
    return (k, mode) if (root_l[k] if mode == "root" else nan_l[k]) else None


def first_nan(upper_nan: np.ndarray, lower_nan: np.ndarray) -> int | None:
    """The level's first NaN-from-NaN-free equation when the prefix tells it, else None."""
    upper_nan, lower_nan = np.asarray(upper_nan, bool), np.asarray(lower_nan, bool)
    if not upper_nan.any():
        return None
    k = int(np.argmax(upper_nan))
    return k if lower_nan[k] else None
