"""Which outputs of a jaxpr the value of one of its equations can reach (forward dataflow).

The fidelity check (``locate._locate``) accepts an output that only the replay makes
non-finite when production failed too: XLA's fused step may drop a NaN that the replay's pieces
keep. It accepts it only when the culprit the replay names can reach an output production saw
non-finite; a value that reaches none of them (a flaky kernel, a host callback that misbehaves
on the replay) did not make production's failure, and the replay is then not reproducible.

Conservative: every output of an equation depends on every input, and a culprit inside a loop,
a branch or a shard taints every output of that construct; only call-like equations (``jit``,
``remat``, ``custom_jvp/vjp``) are followed inside, where the body's outputs are the call's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from nan2safe_jax.replay import _jax_compat as jc


def tainted_outputs(jaxpr: Any, path: Sequence[Any]) -> set[int]:
    """The indices of ``jaxpr``'s outputs that the value made at ``path`` can reach.

    Args:
      jaxpr: an open ``Jaxpr`` (``jc.open_jaxpr`` of a ``ClosedJaxpr``).
      path: an ``EqnRef.eqn_path`` relative to ``jaxpr``: an equation index, then, inside a
        call, the index in its body, and so on (a step element such as ``("iter", i)`` stops
        the descent).

    Returns:
      Output indices; every output when ``path`` does not name an equation of ``jaxpr``.
    """
    if not path or not isinstance(path[0], int) or not 0 <= path[0] < len(jaxpr.eqns):
        return set(range(len(jaxpr.outvars)))
    k, rest = path[0], tuple(path[1:])
    eqn = jaxpr.eqns[k]
    body = jc.call_body(eqn)
    if body is not None and rest and isinstance(rest[0], int):
        inner = tainted_outputs(body[0], rest)
        taint = {id(eqn.outvars[i]) for i in inner if i < len(eqn.outvars)}
    else:
        taint = {id(v) for v in eqn.outvars}
    for later in jaxpr.eqns[k + 1 :]:
        if any(not jc.is_literal(v) and id(v) in taint for v in later.invars):
            taint.update(id(v) for v in later.outvars)
    return {i for i, v in enumerate(jaxpr.outvars) if not jc.is_literal(v) and id(v) in taint}


def reaches(jaxpr: Any, path: Sequence[Any], outputs: Sequence[int]) -> bool:
    """Whether the value made at ``path`` can reach any of ``outputs`` (indices)."""
    return bool(tainted_outputs(jaxpr, path) & {int(i) for i in outputs})
