"""One rule per higher-order primitive: how the replay evaluates, instruments and enters it.

Like ``jax.experimental.checkify``'s rule tables, ``RULES`` maps a primitive name to a ``Rule``;
the interpreter (``interpret.walk``) and the search (``search.py``) dispatch through it and hold
no per-primitive branches. A rule of kind:

* ``"call"`` (``jit``, ``closed_call``, ``remat``/``checkpoint``, ``custom_jvp_call``,
  ``custom_vjp_call``): calls one jaxpr once; the interpreter inlines it (same primal values).
* ``"step"`` (``scan``, ``while``, ``cond``, ``shard_map``): evaluates a body several times or
  picks one. ``flags`` runs the instrumented body inside the same construct and returns the first
  flagged *step* for each flag (-1: none), ``capture`` returns the body's inputs at a given
  (traced) step, ``enter`` turns a concrete step and those inputs into the sub-level to search.

Steps: a ``scan`` step is the index along the scanned axis; a ``while`` step ``s`` is condition
evaluation ``s // 2`` when ``s`` is even and iteration ``s // 2`` when odd (evaluation ``t`` of the
condition runs before iteration ``t``, so the earlier of the two wins); a ``cond`` step is the
branch index; a ``shard_map`` step is the shard's linear index over the mapped mesh axes.

A higher-order primitive without a rule (``pallas_call``, ``custom_transpose``, ...) is evaluated
as one opaque equation and blamed as a whole when its outputs go bad.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from nan2safe_jax.replay import _jax_compat as jc
from nan2safe_jax.replay import interpret as it

__all__ = ["COMBINER", "OPAQUE", "RULES", "Rule", "ShardCtx", "rule_for"]


@dataclasses.dataclass(frozen=True)
class Rule:
    """How the replay handles one higher-order primitive (see the module docstring).

    Attributes:
      kind: ``"call"`` or ``"step"``.
      body: call rules: ``eqn -> (Jaxpr, consts)`` of the called jaxpr.
      flags: step rules: ``(eqn, invals, name_stack) -> (outs, steps)``, ``steps`` int32[3]: the
        first step flagged root, nan and literal (``interpret.MODES``), -1 for none.
      capture: step rules: ``(eqn, invals, name_stack, traced_step) -> captured values``.
      enter: step rules: ``(eqn, step, captured) -> (path_element, Jaxpr, consts, args)``.
      pick: step rules whose step is known from the operands alone (``cond``: the branch index):
        ``(eqn, invals) -> step``; the search then needs neither ``flags`` nor ``capture``.
      eager: instrument the body inside the level's own flags replay (loops: a non-finite value
        made in a while condition reaches no result, so only in-place flags can see it; a loop
        body is one compiled body, unlike the three branches of a gear switch).
      context: ``(eqn, step) -> ShardCtx``: the sub-level's replays must run inside this
        construct (a ``shard_map`` body holds collectives).
    """

    kind: str
    body: Callable[..., Any] | None = None
    flags: Callable[..., Any] | None = None
    capture: Callable[..., Any] | None = None
    enter: Callable[..., Any] | None = None
    pick: Callable[..., Any] | None = None
    eager: bool = False
    context: Callable[..., Any] | None = None


def _coerce(x: Any, var: Any) -> Any:
    """A literal operand as an array of its variable's dtype (loop carries must match exactly)."""
    if isinstance(x, (bool, int, float, complex, np.ndarray, np.generic)):
        return jnp.asarray(x, var.aval.dtype)
    return x


# ---------------------------------------------------------------------------------- call


def _call_body(eqn: Any) -> tuple[Any, Any]:
    body = jc.call_body(eqn)
    assert body is not None  # rule_for only returns a call rule when there is a body
    return body


CALL = Rule("call", body=_call_body)


# ---------------------------------------------------------------------------------- scan


def _scan_split(eqn: Any, invals: list) -> tuple[dict, list, list, list]:
    sp = jc.scan_params(eqn)
    nc, ncar = sp["num_consts"], sp["num_carry"]
    init = [
        _coerce(x, v)
        for x, v in zip(invals[nc : nc + ncar], eqn.invars[nc : nc + ncar], strict=True)
    ]
    return sp, invals[:nc], init, invals[nc + ncar :]


def _plain_body(jaxpr: Any) -> bool:
    """Whether ``jaxpr`` (call-like equations inlined) holds no loop, branch or map: its flags
    replay as a level of its own computes exactly what its walk inside the loop computes (no
    branch index to know, no nested loop's steps)."""
    for eqn in jaxpr.eqns:
        rule = rule_for(eqn)
        if rule is not None and rule.kind == "call":
            if not _plain_body(rule.body(eqn)[0]):
                return False
        elif rule is not None:
            return False
    return True


def _flat_count(jaxpr: Any) -> int:
    """The number of flat equations of ``jaxpr`` (call-like equations inlined)."""
    n = 0
    for eqn in jaxpr.eqns:
        rule = rule_for(eqn)
        n += _flat_count(rule.body(eqn)[0]) if rule is not None and rule.kind == "call" else 1
    return n


def _scan_flags(eqn: Any, invals: list, ns: Any) -> tuple[list, Any, Any]:
    """The scan with its body instrumented: ``(outputs, first flagged steps, body)``.

    ``body``: for a plain body (``_plain_body``), ``(t, root, nan, literal)``: the body's own
    flags at ``t``, the first iteration that flags anything (-1: none), so the search enters
    that iteration without a flags replay of its own (``Session.body_flags``); else None.
    """
    sp, consts, init, xs = _scan_split(eqn, invals)
    ncar, length = sp["num_carry"], sp["length"]
    plain = _plain_body(sp["jaxpr"])

    def body(carry, x):
        i, first, c, kept = carry
        sub = it.Ctx("flags", runtime_branches=True)
        outs = it.walk(sp["jaxpr"], sp["consts"], [*consts, *c, *x], sub, ns)
        t = (length - 1 - i) if sp["reverse"] else i  # index along the scanned axis
        hit = sub.any_flags()
        if plain:
            take = (kept[0] < 0) & jnp.any(hit)
            now = (t, *sub.finalize())
            kept = tuple(jnp.where(take, a, b) for a, b in zip(now, kept, strict=True))
        return (i + 1, it.first_step(first, hit, t), outs[:ncar], kept), outs[ncar:]

    kept0: tuple = (jnp.asarray(-1, jnp.int32),)
    if plain:  # one flag per flat equation of the body (``Ctx.finalize``), at least one
        m = max(_flat_count(sp["jaxpr"]), 1)
        kept0 = (jnp.asarray(-1, jnp.int32), *(jnp.zeros(m, bool) for _ in range(3)))
    (_, first, c, kept), ys = lax.scan(
        body,
        (jnp.asarray(0, jnp.int32), it.no_step(), list(init), kept0),
        list(xs),
        length=length,
        reverse=sp["reverse"],
        unroll=sp["unroll"],
    )
    return [*c, *ys], first, (kept if plain else None)


def _scan_capture(eqn: Any, invals: list, ns: Any, t: Any) -> list:
    """Body inputs of the iteration at index ``t`` of the scanned axis (``t`` traced: one compile
    serves every iteration)."""
    sp, consts, init, xs = _scan_split(eqn, invals)
    ncar, length, rev = sp["num_carry"], sp["length"], sp["reverse"]

    def body(i, c):
        idx = (length - 1 - i) if rev else i
        x = [lax.dynamic_index_in_dim(a, idx, keepdims=False) for a in xs]
        return it.walk(sp["jaxpr"], sp["consts"], [*consts, *c, *x], it.Ctx("plain"), ns)[:ncar]

    n = (length - 1 - t) if rev else t
    c = lax.fori_loop(0, n, body, list(init))
    return [*consts, *c, *[lax.dynamic_index_in_dim(a, t, keepdims=False) for a in xs]]


def _scan_enter(eqn: Any, step: int, captured: list) -> tuple:
    sp = jc.scan_params(eqn)
    return ("iter", step), sp["jaxpr"], list(sp["consts"]), list(captured)


SCAN = Rule("step", flags=_scan_flags, capture=_scan_capture, enter=_scan_enter, eager=True)


# ---------------------------------------------------------------------------------- while


def _while_split(eqn: Any, invals: list) -> tuple[dict, list, list, list]:
    wp = jc.while_params(eqn)
    cn, bn = wp["cond_nconsts"], wp["body_nconsts"]
    init = [_coerce(x, v) for x, v in zip(invals[cn + bn :], eqn.invars[cn + bn :], strict=True)]
    return wp, invals[:cn], invals[cn : cn + bn], init


def _batched(wp: dict) -> bool:
    """Whether a ``while``'s predicate is batched (``bool[B]``: the loop was vmapped)."""
    return bool(wp["cond_jaxpr"].outvars[0].aval.shape)


def _keep_finished(pred: Any, new: list, old: list) -> list:
    """The carry after an iteration of a loop whose predicate ``pred`` was evaluated on ``old``.

    A vmapped loop's predicate is batched (``bool[B]``, one per example; every carry is batched
    along its leading axis then): JAX runs the body while any holds and, as its lowering does,
    keeps a finished example's carry as it was. A scalar predicate keeps nothing.
    """
    if jnp.ndim(pred) == 0:
        return list(new)

    def one(n, o):
        p = jnp.reshape(pred, jnp.shape(pred) + (1,) * (jnp.ndim(n) - jnp.ndim(pred)))
        return jnp.where(p, n, o)

    return [one(n, o) for n, o in zip(new, old, strict=True)]


def _while_flags(eqn: Any, invals: list, ns: Any) -> tuple[list, Any]:
    """The loop with its body *and* its condition instrumented: condition evaluation ``t`` is step
    ``2t``, iteration ``t`` step ``2t + 1``. The condition is evaluated inside the body (and once
    before the loop) because a ``while_loop`` condition may return nothing but its predicate
    (a ``bool[B]`` one under ``vmap``: the loop runs while any is true, ``_keep_finished``)."""
    wp, cc, bc, init = _while_split(eqn, invals)
    if _batched(wp):  # the body, then the select that keeps a finished example's carry
        body_jaxpr, body_consts = _body_keeping_finished(wp)
    else:
        body_jaxpr, body_consts = wp["body_jaxpr"], wp["body_consts"]

    def cond_eval(c):
        sub = it.Ctx("flags", runtime_branches=True)
        pred = it.walk(wp["cond_jaxpr"], wp["cond_consts"], [*cc, *c], sub, ns)[0]
        return pred, sub.any_flags()

    def body(s):
        pred, i, first, c = s
        sub = it.Ctx("flags", runtime_branches=True)
        # A batched loop's select is in the same walk: a value made only in a finished
        # example's lane, which it drops, is masked (no root), as it reaches no result in JAX.
        args = [*bc, *c, pred] if jnp.ndim(pred) else [*bc, *c]
        c = it.walk(body_jaxpr, body_consts, args, sub, ns)
        first = it.first_step(first, sub.any_flags(), 2 * i + 1)
        pred, hit = cond_eval(c)
        return pred, i + 1, it.first_step(first, hit, 2 * i + 2), c

    pred, hit = cond_eval(init)
    start = (pred, jnp.asarray(0, jnp.int32), it.first_step(it.no_step(), hit, 0), list(init))
    _, _, first, c = lax.while_loop(lambda s: jnp.any(s[0]), body, start)
    return list(c), first


def _while_capture(eqn: Any, invals: list, ns: Any, s: Any) -> list:
    """Condition and body constants and the carry before step ``s`` (after ``s // 2`` iterations:
    a flagged step implies the condition held, for some example, at every earlier iteration);
    for a batched predicate, then that iteration's predicate (``_while_enter``)."""
    wp, cc, bc, init = _while_split(eqn, invals)
    t = s // 2
    batched = _batched(wp)

    def body(state):
        i, c = state
        new = it.walk(wp["body_jaxpr"], wp["body_consts"], [*bc, *c], it.Ctx("plain"), ns)
        if batched:
            pred = it.walk(wp["cond_jaxpr"], wp["cond_consts"], [*cc, *c], it.Ctx("plain"), ns)
            new = _keep_finished(pred[0], new, c)
        return i + 1, list(new)

    _, c = lax.while_loop(lambda st: st[0] < t, body, (jnp.asarray(0, jnp.int32), list(init)))
    if not batched:
        return [*cc, *bc, *c]
    pred = it.walk(wp["cond_jaxpr"], wp["cond_consts"], [*cc, *c], it.Ctx("plain"), ns)[0]
    return [*cc, *bc, *c, pred]


def _while_enter(eqn: Any, step: int, captured: list) -> tuple:
    wp = jc.while_params(eqn)
    cn, bn = wp["cond_nconsts"], wp["body_nconsts"]
    batched = _batched(wp)
    pred = captured[-1] if batched else None
    captured = captured[:-1] if batched else captured
    cc, bc, carry = captured[:cn], captured[cn : cn + bn], captured[cn + bn :]
    if step % 2 == 0:
        return ("cond", step // 2), wp["cond_jaxpr"], list(wp["cond_consts"]), [*cc, *carry]
    if batched:  # the body, then JAX's select of the finished examples' carry
        jaxpr, consts = _body_keeping_finished(wp)
        return ("iter", step // 2), jaxpr, consts, [*bc, *carry, pred]
    return ("iter", step // 2), wp["body_jaxpr"], list(wp["body_consts"]), [*bc, *carry]


def _body_keeping_finished(wp: dict) -> tuple[Any, list]:
    """A batched loop's body followed by ``_keep_finished`` as one jaxpr (inputs: body
    constants, carry, then the iteration's predicate), for the flags replay and the entered
    iteration alike: a value made only in a finished example's lane is masked. The body's
    equations come first, in order, with their source lines (``eval_jaxpr`` keeps them)."""
    body = wp["body_jaxpr"]
    ncarry = len(body.outvars)

    def run(*args):
        *ins, p = args
        outs = jax.core.eval_jaxpr(body, wp["body_consts"], *ins)
        return _keep_finished(p, outs, ins[len(ins) - ncarry :])

    specs = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in body.invars]
    pred = wp["cond_jaxpr"].outvars[0].aval
    closed = jax.make_jaxpr(run)(*specs, jax.ShapeDtypeStruct(pred.shape, pred.dtype))
    return closed.jaxpr, list(closed.consts)


WHILE = Rule("step", flags=_while_flags, capture=_while_capture, enter=_while_enter, eager=True)


# ---------------------------------------------------------------------------------- cond


def _cond_flags(eqn: Any, invals: list, ns: Any) -> tuple[list, Any]:
    index, ops = invals[0], invals[1:]

    def branch(j, consts):
        def run(*o):
            sub = it.Ctx("flags")
            outs = it.walk(j, consts, o, sub, ns)
            return outs, sub.any_flags()

        return run

    outs, hit = lax.switch(index, [branch(j, c) for j, c in jc.cond_branches(eqn)], *ops)
    return list(outs), it.first_step(it.no_step(), hit, jnp.asarray(index, jnp.int32))


def _cond_capture(eqn: Any, invals: list, ns: Any, step: Any) -> list:
    return list(invals[1:])


def _cond_enter(eqn: Any, step: int, captured: list) -> tuple:
    j, consts = jc.cond_branches(eqn)[step]
    return ("branch", step), j, list(consts), list(captured)


def _cond_pick(eqn: Any, invals: list) -> int:
    return int(np.asarray(invals[0]))


COND = Rule("step", flags=_cond_flags, capture=_cond_capture, enter=_cond_enter, pick=_cond_pick)


# ---------------------------------------------------------------------------------- shard_map


@dataclasses.dataclass(frozen=True)
class ShardCtx:
    """A level inside a ``shard_map`` body: its replays run under the same ``shard_map`` (so
    collectives work) on *stacked* per-shard values (leading axis: the shard's linear index over
    the manual mesh axes), and keep the results of shard ``index`` only."""

    mesh: Any
    axes: tuple
    check_vma: bool
    index: int

    @property
    def size(self) -> int:
        return int(np.prod([self.mesh.shape[a] for a in self.axes]))

    def device(self) -> str | None:
        """The device of shard ``index`` when every mesh axis is manual."""
        if set(self.axes) != set(self.mesh.axis_names):
            return None
        return str(np.asarray(self.mesh.devices).reshape(-1)[self.index])

    def wrap(self, fn: Any, stacked: tuple[bool, ...]) -> Any:
        """``fn(*args)`` on one shard's values -> the same on every shard under the
        ``shard_map``, results stacked; ``stacked[i]``: argument ``i`` is stacked (else it is
        passed to every shard as is)."""
        spec = _shard_spec(self.axes)

        def per_shard(*args):
            local = [
                jax.tree.map(lambda b: b[0], a) if st else a
                for a, st in zip(args, stacked, strict=True)
            ]
            out = fn(*local)
            return jax.tree.map(lambda o: jnp.expand_dims(jnp.asarray(o), 0), out)

        def run(*args):
            specs = tuple(spec if st else P() for st in stacked)
            return jc.shard_map(per_shard, self.mesh, specs, spec, self.axes, self.check_vma)(*args)

        return run


def _shard_spec(axes: tuple) -> Any:
    return P(axes if len(axes) > 1 else axes[0])


def _shard_flags(eqn: Any, invals: list, ns: Any) -> tuple[list, Any]:
    """Runs the ``shard_map`` with its body instrumented. Shards run side by side, so the step is
    the shard whose first flagged equation comes first in the body (lowest shard on a tie): a
    NaN made by ``log`` on shard 2 reaches every shard through a ``psum`` after it, and every
    shard's ``psum`` then looks like a root."""
    p = jc.shard_map_params(eqn)
    big = jnp.iinfo(jnp.int32).max

    def body(*args):
        sub = it.Ctx("flags")
        outs = it.walk(p["jaxpr"], p["consts"], list(args), sub, ns)
        flags = sub.finalize()
        first = [jnp.where(f.any(), jnp.argmax(f), big).astype(jnp.int32) for f in flags]
        return (*outs, jnp.expand_dims(jnp.stack(first), 0))

    out_specs = (*p["out_specs"], _shard_spec(p["axes"]))
    outs = jc.shard_map(body, p["mesh"], p["in_specs"], out_specs, p["axes"], p["check_vma"])(
        *invals
    )
    first = outs[-1]  # int32[n_shards, 3]: first flagged equation per shard and flag
    shard = jnp.argmin(first, axis=0).astype(jnp.int32)
    return list(outs[:-1]), jnp.where(first.min(0) < big, shard, -1)


def _shard_capture(eqn: Any, invals: list, ns: Any, step: Any) -> list:
    """Every shard's body inputs, stacked (leading axis: shard index)."""
    p = jc.shard_map_params(eqn)

    def body(*args):
        return [jnp.expand_dims(a, 0) for a in args]

    spec = _shard_spec(p["axes"])
    fn = jc.shard_map(body, p["mesh"], p["in_specs"], [spec] * len(invals), p["axes"], False)
    return list(fn(*invals))


def _shard_enter(eqn: Any, step: int, captured: list) -> tuple:
    p = jc.shard_map_params(eqn)
    return ("shard", step), p["jaxpr"], list(p["consts"]), list(captured)


def _shard_context(eqn: Any, step: int) -> ShardCtx:
    p = jc.shard_map_params(eqn)
    return ShardCtx(p["mesh"], p["axes"], p["check_vma"], step)


SHARD_MAP = Rule(
    "step",
    flags=_shard_flags,
    capture=_shard_capture,
    enter=_shard_enter,
    context=_shard_context,
)


# ---------------------------------------------------------------------------------- table

RULES: dict[str, Rule] = {
    **{name: CALL for name in jc.CALL_PRIMITIVES},
    "scan": SCAN,
    "while": WHILE,
    "cond": COND,
    "shard_map": SHARD_MAP,
}

# Higher-order primitives deliberately evaluated as one equation (their bodies are not jaxprs of
# the step's values: kernels, transposition rules, state programs).
OPAQUE = frozenset({"pallas_call", "custom_transpose_call", "linear_call", "run_state"})


# First-order primitives whose parameters hold a small combiner jaxpr (how two scalars combine),
# not a program over the step's values: evaluated and blamed like any primitive.
COMBINER = frozenset(
    {"scatter", "scatter-add", "scatter_add", "scatter-mul", "scatter_mul", "scatter-min"}
    | {"scatter_min", "scatter-max", "scatter_max", "reduce", "reduce_window"}
    | {"select_and_scatter", "select_and_scatter_add", "select_and_gather_add", "argsort"}
)


def rule_for(eqn: Any) -> Rule | None:
    """The rule of ``eqn``'s primitive, or None for a first-order (or opaque) equation."""
    rule = RULES.get(eqn.primitive.name)
    if rule is CALL and jc.call_body(eqn) is None:
        return None
    return rule
