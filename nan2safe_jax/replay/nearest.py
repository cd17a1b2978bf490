"""The site nearest to an equation that lies in no site (tier 2's hint on a partly converted model).

When the culprit equation is outside every site, no gear reaches it; the useful hint is *where*
it sits relative to the sites the model does have: "between ``blocks.ln1`` and
``blocks.attn``" tells the user which code to wrap in ``nan2safe.nn.Site``. This walks the
step's jaxpr down the culprit's ``Report.eqn_path`` (through the same flattening and rules the
search uses) and, at the culprit's level, looks at its neighbours in program order, the closest
first (the earlier one on a tie: the producer of its inputs, more often than not). If that level
holds no site equation, the equation that contains it is looked around, one level up, and so on.
A site called from the same function as the culprit (the user's frames above the innermost
one alike: the culprit is in the module that calls that site), in the unbroken run of that
function's equations around the culprit, comes first, however far: the closest site in
program order was the next block's first norm for a culprit at the end of a block's MoE, whose
router is a site (newuser46, newuser48).
Tracing only (``jax.make_jaxpr``): nothing is compiled or run.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

import jax

from nan2safe_jax.replay import _jax_compat as jc
from nan2safe_jax.replay.locate import user_frames
from nan2safe_jax.replay.search import flatten
from nan2safe_jax.site import site_from_name_stack

__all__ = ["nearest_site", "nearest_site_in_jaxpr"]


def _step(elem: tuple, prim: str) -> int:
    kind, k = elem
    if kind == "iter":
        return 2 * k + 1 if prim == "while" else k
    if kind == "cond":  # a while loop's condition evaluation
        return 2 * k
    return k  # "branch", "shard"


def _site(item, known: Collection[str] | None) -> str | None:
    name = site_from_name_stack(str(item.name_stack))
    if name is None or (known is not None and name not in known):
        return None
    return name


def _same_caller(chain: tuple, culprit: tuple) -> bool:
    """The user's frames of two equations: the same file innermost and the same frames above
    it (one invocation of one function, up to its line)."""
    return (
        bool(chain) and bool(culprit) and chain[0][0] == culprit[0][0] and chain[1:] == culprit[1:]
    )


def _same_caller_site(items, k: int, culprit: tuple, known) -> str | None:
    """The site nearest to ``items[k]`` among the equations around it traced from the same
    invocation as the culprit: each direction walks only the unbroken run of them (an
    equation of another function ends it; one with no frame of the user's is passed), so the
    next iteration of a loop over blocks, whose frames are the same lines, is not reached."""
    best = None
    for step in (-1, 1):
        j = k + step
        while 0 <= j < len(items):
            chain = user_frames(items[j].frames)
            if chain and not _same_caller(chain, culprit):
                break
            name = _site(items[j], known) if chain else None
            if name is not None:
                if best is None or abs(j - k) < best[0]:
                    best = (abs(j - k), name)
                break
            j += step
    return None if best is None else best[1]


def nearest_site_in_jaxpr(
    jaxpr: Any, eqn_path: Sequence, known: Collection[str] | None = None
) -> str | None:
    """The site nearest to the equation at ``eqn_path`` in ``jaxpr`` (a ClosedJaxpr or Jaxpr).

    Args:
      jaxpr: the program the path indexes (what ``replay.locate`` searched).
      eqn_path: ``Report.eqn_path``.
      known: only these site names count (the model's); None: any ``nan2safe[...]`` scope.

    Returns:
      The nearest site's name, or None (the path does not fit, or no site anywhere around).
    """
    body, _ = jc.open_jaxpr(jaxpr)
    ns = jc.empty_name_stack()
    path = list(eqn_path)
    levels = []  # (flat items of the level, index of the item on the path)
    while path:
        items = flatten(body, ns)
        k = next(
            (i for i, it in enumerate(items) if tuple(path[: len(it.path)]) == tuple(it.path)),
            None,
        )
        if k is None:
            break
        levels.append((items, k))
        item = items[k]
        path = path[len(item.path) :]
        if not path or item.rule is None or not isinstance(path[0], tuple):
            break
        elem = path.pop(0)
        _, body, _, _ = item.rule.enter(item.eqn, _step(elem, item.eqn.primitive.name), [])
        body, _ = jc.open_jaxpr(body)
        ns = item.name_stack
    culprit = user_frames(levels[-1][0][levels[-1][1]].frames) if levels else ()
    for items, k in reversed(levels):
        name = _same_caller_site(items, k, culprit, known)
        if name is not None:
            return name
    for items, k in reversed(levels):
        for d in range(1, len(items)):
            for j in (k - d, k + d):
                if 0 <= j < len(items):
                    name = _site(items[j], known)
                    if name is not None:
                        return name
    return None


def nearest_site(
    step_fn: Any, args: Sequence, eqn_path: Sequence, known: Collection[str] | None = None
) -> str | None:
    """``nearest_site_in_jaxpr`` of ``jax.make_jaxpr(step_fn)(*args)`` (the replayed step).

    Args:
      step_fn: the step ``replay.locate_step`` traced.
      args: its arguments.
      eqn_path: the culprit's ``Report.eqn_path``.
      known: the model's site names.
    """
    return nearest_site_in_jaxpr(jax.make_jaxpr(step_fn)(*args), eqn_path, known)
