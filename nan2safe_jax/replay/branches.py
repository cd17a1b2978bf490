"""Branch indices known before a level is replayed: the gear switches.

A train step built from ``nan2safe.nn`` sites holds one ``cond`` per site op whose index is the
site's gear: an int32 scalar of the state, through a few scalar operations. Its STABLE and SAFE
branches are most of what XLA compiles for the step (``docs/design.md``), yet a replay runs one
branch of each, and which one is known from the arguments before the replay is compiled.

So before a level's flags and capture replays, one small program computes every such index: it
evaluates only the level's *small* equations (first-order, no effects, every value at most
``SMALL`` elements) and returns the indices of the ``cond`` equations whose index is small. The
replays then bind those ``cond`` equations with their index as a constant; XLA drops the branches
that cannot run (its conditional simplifier) and compiles the taken one in place. The equations a
replay evaluates are the same, so are the flat equation numbers, the flags and the captured
values; only the fusion boundary around the taken branch goes. ``locate_step``'s fidelity check
(the replay must reproduce the production step's non-finite outputs) covers that difference.

A ``cond`` whose index depends on a large value (a guard that tests the gradients) is left as it
is: computing its index would cost a replay of its own.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from nan2safe_jax.replay import _jax_compat as jc
from nan2safe_jax.replay import rules

__all__ = ["SMALL", "known_indices"]

SMALL = 4096  # elements: a gear ``[L]`` of a stacked site is small, an activation is not


def _is_small_aval(aval: Any) -> bool:
    shape = getattr(aval, "shape", None)
    return shape is not None and int(np.prod(shape, dtype=np.int64)) <= SMALL


def _evaluable(eqn: Any, rule: Any) -> bool:
    """A first-order equation without effects whose outputs are all small (inputs aside)."""
    return (
        rule is None
        and eqn.primitive.name not in rules.OPAQUE
        and not jc.has_sub_jaxpr(eqn)
        and not eqn.effects
        and all(_is_small_aval(v.aval) for v in eqn.outvars)
    )


def _walk(jaxpr: Any, env: dict[Any, Any], on_eqn: Any) -> None:
    """Walks ``jaxpr`` as ``interpret.walk`` does (call-like equations inlined, the others
    numbered in order), keeping in ``env`` only the values of small equations whose inputs are
    all in ``env``; ``on_eqn(k, eqn, invals)`` returns the outputs of flat equation ``k`` (None:
    not evaluated). A literal operand reads as its value, a missing one as None."""
    count = 0

    def visit(j: Any, env: dict[Any, Any]) -> list:
        nonlocal count

        def read(a: Any) -> Any:
            return jc.literal_value(a) if jc.is_literal(a) else env.get(a)

        for eqn in j.eqns:
            rule = rules.rule_for(eqn)
            invals = [read(a) for a in eqn.invars]
            if rule is not None and rule.kind == "call":
                body, body_consts = rule.body(eqn)
                inner = {
                    v: c
                    for v, c in zip(body.constvars, body_consts, strict=True)
                    if _is_small_aval(v.aval)
                }
                inner.update(
                    (v, x) for v, x in zip(body.invars, invals, strict=True) if x is not None
                )
                outs = visit(body, inner)
            else:
                outs = on_eqn(count, eqn, invals)
                count += 1
                if outs is None:
                    continue
            env.update((v, o) for v, o in zip(eqn.outvars, outs, strict=True) if o is not None)
        return [read(a) for a in j.outvars]

    visit(jaxpr, env)


def known_indices(
    call: Any, key: Any, jaxpr: Any, consts: list, args: list, ns: Any
) -> dict[int, int]:
    """``{flat index: branch index}`` of a level's ``cond`` equations with a small index.

    Two walks: one over shapes only (which ``cond`` equations have an index computable from
    small values), then, if there are any, one compiled program over the small values that
    returns those indices.

    Args:
      call: ``Session.call``: compiles (once per ``key``) and runs the small program.
      key: the replay-cache key of this level's small program.
      jaxpr, consts, args: the level (an open jaxpr and the values of its constvars, invars).
      ns: the name stack the level is called under.

    Returns:
      The branch index of each such ``cond``; empty when the level has none.
    """
    small_vars = [v for v in (*jaxpr.constvars, *jaxpr.invars) if _is_small_aval(v.aval)]
    targets: dict[int, Any] = {}
    marker = object()  # a shape-only walk: any non-None value means "small and known"

    def plan(k, eqn, invals):
        if rules.rule_for(eqn) is rules.COND and invals[0] is not None:
            targets[k] = eqn
        if _evaluable(eqn, rules.rule_for(eqn)) and all(x is not None for x in invals):
            return [marker] * len(eqn.outvars)
        return None

    _walk(jaxpr, dict.fromkeys(small_vars, marker), plan)
    if not targets:
        return {}
    ks = sorted(targets)

    def fn(small_values):
        found: dict[int, Any] = {}

        def run(k, eqn, invals):
            if k in targets:
                found[k] = invals[0]
            if _evaluable(eqn, rules.rule_for(eqn)) and all(x is not None for x in invals):
                return jc.bind_eqn(eqn, invals, ns)
            return None

        _walk(jaxpr, dict(zip(small_vars, small_values, strict=True)), run)
        return [found[k] for k in ks]

    values = dict(zip((*jaxpr.constvars, *jaxpr.invars), (*consts, *args), strict=True))
    got = call(key, fn, [values[v] for v in small_vars])
    return {
        k: int(np.clip(int(np.asarray(i)), 0, len(jc.cond_branches(targets[k])) - 1))
        for k, i in zip(ks, got, strict=True)
    }
