"""The search: which flat equation of which level made the first non-finite value.

A *level* is one jaxpr being searched: the top-level program, or the body of a loop iteration,
a loop condition evaluation, a taken ``cond`` branch, one shard of a ``shard_map``. Per level:

1. one *flags* replay (``interpret`` in ``"flags"`` mode) returns, for every flat equation, whether
   it turned finite inputs into a non-finite output (root) or NaN-free inputs into NaN;
2. one *capture* replay runs the level's prefix up to the first flagged equation and returns its
   inputs and outputs. A primitive: done. A higher-order equation (loop, branch, map): a *step
   flags* replay runs it alone on those inputs with its body instrumented by its rule and returns
   the first flagged step (iteration, condition evaluation, branch, shard); a *step capture*
   replay returns that step's body inputs, which are the next level.

Each replay is one compiled program over the level's own values, so memory follows the step's live
set; the flags replay's outputs are O(#equations). Bodies of higher-order equations are
instrumented only when entered, so a flags replay reduces only its own level's values (a train
step's gear switches hold three branches each; only the taken one is ever instrumented).
Compiled replays are kept in ``cache.CACHE`` (the step index of a step capture is a runtime
argument, so one compile serves every iteration).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from nan2safe_jax.replay import _jax_compat as jc
from nan2safe_jax.replay import cache, interpret, rules

__all__ = ["Flags", "Found", "Item", "Session", "flatten", "search"]


@dataclasses.dataclass(frozen=True)
class Item:
    """One flat equation of a level."""

    eqn: Any
    path: tuple  # equation indices from the level's jaxpr down through inlined calls
    name_stack: Any  # full NameStack
    frames: tuple  # ((file, line), ...) non-JAX frames that traced it, innermost first, then
    # those of the equations that called its jaxpr (an inner jit's equations carry none)
    rule: rules.Rule | None  # a step rule, or None for a first-order / opaque equation

    @property
    def source(self) -> str | None:
        """``"file.py:LINE"`` of the innermost non-JAX frame."""
        return f"{self.frames[0][0]}:{self.frames[0][1]}" if self.frames else None


def flatten(jaxpr: Any, ns: Any, path: tuple = (), frames: tuple = ()) -> list[Item]:
    """The flat equations of ``jaxpr`` (call-like equations inlined), in walk order.

    ``frames``: the frames of the equation whose body ``jaxpr`` is (inherited by its equations).
    """
    items: list[Item] = []
    for i, eqn in enumerate(jaxpr.eqns):
        ens = jc.eqn_name_stack(eqn, ns)
        own = tuple(jc.eqn_user_frames(eqn))
        fr = own + frames if own else frames
        rule = rules.rule_for(eqn)
        if rule is not None and rule.kind == "call":
            items.extend(flatten(rule.body(eqn)[0], ens, (*path, i), fr))
        else:
            items.append(Item(eqn, (*path, i), ens, fr, rule))
    return items


@dataclasses.dataclass
class Flags:
    """Host copy of one flags replay."""

    root: np.ndarray  # bool[n_flat]
    nan: np.ndarray  # bool[n_flat]
    literal: np.ndarray  # bool[n_flat]
    steps: dict[int, list[int]]  # flat index of an eagerly instrumented loop -> first steps [3]
    in_codes: np.ndarray | None  # int8[n_args] codes of the arguments (top level only)
    out_codes: np.ndarray | None  # int8[n_outs] codes of the outputs (top level only)


@dataclasses.dataclass
class Found:
    item: Item
    path: tuple
    invals: list
    outvals: list
    mode: str = "root"  # the flag that found it (``interpret.MODES``)
    constant: bool = False  # a higher-order equation whose body made nothing non-finite


def _structure(level: Any) -> Any:
    """``level`` without step numbers: every iteration of a loop body shares one replay."""
    if not isinstance(level, tuple):
        return level
    parent, k, elem = level
    return (_structure(parent), k, elem[0] if elem[0] in ("iter", "cond", "shard") else elem)


class Session:
    """One localization: its replays (counted), flags and captures (memoized per level).

    Args:
      top: the program being located (its structure keys the compiled-replay cache).
      stats: also record XLA's memory analysis of every compiled replay in ``self.stats``.
    """

    def __init__(self, top: Any, stats: bool = False) -> None:
        self.replays = 0
        self.compiles = 0
        self.stats: list[dict[str, Any]] = [] if stats else None  # type: ignore[assignment]
        self._jits = cache.CACHE.table(top)
        self._flags: dict[Any, Flags] = {}
        self._captured: dict[Any, Any] = {}

    def call(self, key: Any, fn: Any, *args: Any) -> Any:
        """Runs the replay ``fn`` (compiled once per ``key`` and argument shapes)."""
        jitted = self._jits.get(key)
        if jitted is None:
            jitted = self._jits[key] = cache.jit(fn)
            self.compiles += 1
        self.replays += 1
        if self.stats is not None:
            self.stats.append({"key": key, **cache.compiled_stats(jitted, *args)})
        return jax.device_get(jitted(*args))

    def flags(self, level: Any, jaxpr: Any, consts: list, args: list, ns: Any, top: bool) -> Flags:
        """The flags replay of a level (memoized)."""
        cached = self._flags.get(level)
        if cached is not None:
            return cached

        def fn(consts, args):
            ctx = interpret.Ctx("flags")
            arg_refs = [ctx.ref(a) for a in args] if top else []
            outs = interpret.walk(jaxpr, consts, args, ctx, ns)
            root, nan, literal = ctx.finalize()
            steps = {k: jnp.asarray(v, jnp.int32) for k, v in ctx.steps.items()}
            codes = None
            if top:

                def stack(refs):
                    if not refs:
                        return jnp.zeros((0,), jnp.int8)
                    return jnp.stack([ctx.code_of(r) for r in refs])

                codes = (stack(arg_refs), stack([ctx.ref(o) for o in outs]))
            return root, nan, literal, steps, codes

        root, nan, literal, steps, codes = self.call(
            ("flags", _structure(level), top), fn, list(consts), list(args)
        )
        out = Flags(
            np.asarray(root),
            np.asarray(nan),
            np.asarray(literal),
            {k: [int(x) for x in np.asarray(v)] for k, v in steps.items()},
            None if codes is None else np.asarray(codes[0]),
            None if codes is None else np.asarray(codes[1]),
        )
        self._flags[level] = out
        return out

    def capture(
        self, level: Any, jaxpr: Any, consts: list, args: list, ns: Any, ks: Sequence[int]
    ) -> dict[int, tuple[list, list]]:
        """``{k: (inputs, outputs)}`` of flat equations ``ks`` of a level, in one replay."""
        missing = sorted(k for k in set(ks) if (level, k) not in self._captured)
        if missing:

            def fn(consts, args):
                ctx = interpret.Ctx("capture", dict.fromkeys(missing))
                try:
                    interpret.walk(jaxpr, consts, args, ctx, ns)
                except interpret.Stop as stop:
                    return [stop.payload[k] for k in missing]
                raise RuntimeError(
                    f"replay: flat equations {missing} not reached"
                )  # pragma: no cover

            key = ("capture", _structure(level), tuple(missing))
            out = self.call(key, fn, list(consts), list(args))
            for k, payload in zip(missing, out, strict=True):
                self._captured[(level, k)] = payload
        return {k: self._captured[(level, k)] for k in ks}

    def step_flags(self, level: Any, k: int, item: Item, invals: list) -> list[int]:
        """First step flagged root, nan and literal (``interpret.MODES``; -1: none) of
        higher-order equation ``k`` run alone on ``invals``, its body instrumented by its rule."""

        def fn(invals):
            return item.rule.flags(item.eqn, invals, item.name_stack)[1]

        steps = self.call(("step_flags", _structure(level), k), fn, list(invals))
        return [int(s) for s in np.asarray(steps)]

    def step_capture(self, level: Any, k: int, item: Item, invals: list, step: int) -> list:
        """The body inputs of step ``step`` of higher-order equation ``k`` (see ``rules``)."""

        def fn(invals, step):
            return item.rule.capture(item.eqn, invals, item.name_stack, step)

        key = ("step_capture", _structure(level), k)
        return list(self.call(key, fn, list(invals), np.int32(step)))


def search(
    sess: Session,
    level: Any,
    jaxpr: Any,
    consts: list,
    args: list,
    ns: Any,
    base: tuple,
    mode: str,
    top: bool = False,
    frames: tuple = (),
) -> Found | None:
    """First flagged equation (``mode`` one of ``interpret.MODES``) of a level, entering step
    equations (loops, branches, shards) through their rules.

    Returns:
      The culprit with its captured inputs and outputs, or None when nothing is flagged.
    """
    items = flatten(jaxpr, ns, (), frames)
    fl = sess.flags(level, jaxpr, consts, args, ns, top)
    vec = {"root": fl.root, "nan": fl.nan, "literal": fl.literal}[mode]
    for k in np.nonzero(vec)[0][:3]:  # the first; the next ones only if replays disagree
        k = int(k)
        item = items[k]
        path = (*base, *item.path)
        invals, outvals = sess.capture(level, jaxpr, consts, args, ns, [k])[k]
        if item.rule is None:
            return Found(item, path, list(invals), list(outvals), mode)
        if item.rule.pick is not None:  # the step is known from the operands (a branch index)
            step = item.rule.pick(item.eqn, list(invals))
            captured = item.rule.capture(item.eqn, list(invals), item.name_stack, step)
            elem, sub, sub_consts, sub_args = item.rule.enter(item.eqn, step, captured)
            for sub_mode in interpret.MODES[interpret.MODES.index(mode) :]:
                found = search(
                    sess, (level, k, elem), sub, sub_consts, sub_args, item.name_stack,
                    (*path, elem), sub_mode, frames=item.frames,
                )  # fmt: skip
                if found is not None:
                    return found
            return Found(item, path, list(invals), list(outvals), mode, constant=True)
        if k in fl.steps:
            steps = fl.steps[k]
        else:
            steps = sess.step_flags(level, k, item, list(invals))
        # The equation is flagged in ``mode``; its body may hold the culprit under a later mode
        # only: a root equation whose body makes NaN from a -inf mask literal (nan), or whose
        # body only combines finite values with a non-finite literal (literal).
        sub_mode, step = mode, -1
        for sub_mode in interpret.MODES[interpret.MODES.index(mode) :]:
            step = steps[interpret.MODES.index(sub_mode)]
            if step >= 0:
                break
        if step < 0:  # not even a literal: an output of the body is a non-finite literal
            return Found(item, path, list(invals), list(outvals), mode, constant=True)
        captured = sess.step_capture(level, k, item, list(invals), step)
        elem, sub, sub_consts, sub_args = item.rule.enter(item.eqn, step, captured)
        found = search(
            sess, (level, k, elem), sub, sub_consts, sub_args, item.name_stack,
            (*path, elem), sub_mode, frames=item.frames,
        )  # fmt: skip
        if found is not None:
            return found
    return None
