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

At the top level of a train step the flags replay first covers only the forward prefix, and
decides from it when the whole step could not flag anything earlier (``prefix.py``).

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
from nan2safe_jax.replay import branches, cache, interpret, rules
from nan2safe_jax.replay import prefix as prefix_lib

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
    # decided from the forward prefix (``prefix.py``): (output indices, their codes) of the
    # outputs the prefix computes; ``out_codes`` is None then
    prefix_outs: tuple[np.ndarray, np.ndarray] | None = None
    # flat index of a scan with a plain body -> (first flagged iteration, its body's root, nan,
    # literal flags): the flags replay of that iteration's level, computed in this one
    bodies: dict[int, tuple] = dataclasses.field(default_factory=dict)


def _host_bodies(bodies: dict) -> dict[int, tuple]:
    return {
        int(k): (int(np.asarray(v[0])), *(np.asarray(a) for a in v[1:])) for k, v in bodies.items()
    }


def first_flagged(fl: Flags) -> tuple[int, str] | None:
    """``(flat index, "root" | "nan")`` of the first equation flagged root or nan, in program
    order: the culprit ``locate`` searches for (a root when it is both)."""
    either = np.asarray(fl.root, bool) | np.asarray(fl.nan, bool)
    if not either.any():
        return None
    k = int(np.argmax(either))
    return k, "root" if fl.root[k] else "nan"


@dataclasses.dataclass
class Found:
    item: Item
    path: tuple
    invals: list
    outvals: list
    mode: str = "root"  # the flag that found it (``interpret.MODES``)
    constant: bool = False  # a higher-order equation whose body made nothing non-finite
    shard: Any = None  # rules.ShardCtx when found inside a shard_map body
    # (level, jaxpr, consts, args, ns, frames, base path, flat index): the level the culprit was
    # found in, for a replay of it (``magnitude.py``); None inside a shard_map body
    where: tuple | None = None


def structure(level: Any) -> Any:
    """``level`` without step numbers: every iteration of a loop body shares one replay."""
    if not isinstance(level, tuple):
        return level
    parent, k, elem = level
    return (structure(parent), k, elem[0] if elem[0] in ("iter", "cond", "shard") else elem)


def _pick(tree: Any, shard: Any) -> Any:
    """Shard ``shard.index``'s part of a replay's stacked results (the results themselves outside
    a ``shard_map`` body)."""
    if shard is None:
        return tree
    return jax.tree.map(lambda x: np.asarray(x)[shard.index], tree)


class Session:
    """One localization: its replays (counted), flags and captures (memoized per level).

    Args:
      top: the program being located (its structure keys the compiled-replay cache).
      stats: also record XLA's memory analysis of every compiled replay in ``self.stats``.
      prefix: try the forward prefix first at the top level (``prefix.py``).
      bodies: enter a loop whose steps the level's flags replay found through one capture
        replay (``capture_into``), and a scan's plain body with the flags that replay computed
        (``seed``) instead of a flags replay of its own.
    """

    def __init__(
        self, top: Any, stats: bool = False, prefix: bool = True, bodies: bool = True
    ) -> None:
        self.prefix = prefix
        self.bodies = bodies
        self.prefix_decided = False
        self.replays = 0
        self.compiles = 0
        self.stats: list[dict[str, Any]] = [] if stats else None  # type: ignore[assignment]
        self._jits = cache.CACHE.table(top)
        self._flags: dict[Any, Flags] = {}
        self._captured: dict[Any, Any] = {}
        self._known: dict[Any, dict[int, int]] = {}

    def known(
        self, level: Any, jaxpr: Any, consts: list, args: list, ns: Any, shard: Any = None
    ) -> dict[int, int]:
        """The branch indices of a level's gear switches (``branches.py``; memoized; none
        inside a ``shard_map`` body, whose values are per shard)."""
        if shard is not None:
            return {}
        hit = self._known.get(level)
        if hit is None:
            key = ("branches", structure(level))
            call = lambda key, fn, *a: self.call(key, fn, *a, replay=False)  # noqa: E731
            hit = branches.known_indices(call, key, jaxpr, consts, args, ns)
            self._known[level] = hit
        return hit

    def call(
        self,
        key: Any,
        fn: Any,
        *args: Any,
        shard: Any = None,
        stacked: tuple = (),
        replay: bool = True,
    ) -> Any:
        """Runs the replay ``fn`` (compiled once per ``key`` and argument shapes); inside a
        ``shard_map`` body (``shard``), on every shard, with results stacked. ``replay=False``:
        a helper program over small values (``branches.py``), not counted as a replay."""
        key = (key, cache.quick())  # compiled with LLVM's optimisation off, or not
        jitted = self._jits.get(key)
        if jitted is None:
            jitted = self._jits[key] = cache.jit(shard.wrap(fn, stacked) if shard else fn)
            self.compiles += 1
        self.replays += replay
        if self.stats is not None:
            self.stats.append({"key": key, **cache.compiled_stats(jitted, *args)})
        return jax.device_get(jitted(*args))

    def flags(
        self,
        level: Any,
        jaxpr: Any,
        consts: list,
        args: list,
        ns: Any,
        top: bool,
        shard: Any = None,
    ) -> Flags:
        """The flags replay of a level (memoized)."""
        cached = self._flags.get(level)
        if cached is not None:
            return cached
        known = self.known(level, jaxpr, consts, args, ns, shard)

        def fn(consts, args):
            ctx = interpret.Ctx("flags", known=known)
            arg_refs = [ctx.ref(a) for a in args] if top else []
            if top:
                ctx.mark_constants(consts)
            outs = interpret.walk(jaxpr, consts, args, ctx, ns)
            root, nan, literal = ctx.finalize()
            steps = {k: jnp.asarray(v, jnp.int32) for k, v in ctx.steps.items()}
            steps = (steps, dict(ctx.bodies))
            codes = None
            if top:

                def stack(refs):
                    if not refs:
                        return jnp.zeros((0,), jnp.int8)
                    return jnp.stack([ctx.code_of(r) for r in refs])

                codes = (stack(arg_refs), stack([ctx.ref(o) for o in outs]))
            return root, nan, literal, steps, codes

        res = self.call(
            ("flags", structure(level), top, tuple(sorted(known.items()))),
            fn, list(consts), list(args),
            shard=shard, stacked=(False, True),
        )  # fmt: skip
        root, nan, literal, (steps, bodies), codes = _pick(res, shard)
        out = Flags(
            np.asarray(root),
            np.asarray(nan),
            np.asarray(literal),
            {k: [int(x) for x in np.asarray(v)] for k, v in steps.items()},
            None if codes is None else np.asarray(codes[0]),
            None if codes is None else np.asarray(codes[1]),
            bodies=_host_bodies(bodies),
        )
        self._flags[level] = out
        return out

    def seed(self, level: Any, flags: Flags) -> None:
        """The flags of ``level``, computed by an enclosing replay (a scan's plain body at its
        first flagged iteration): no flags replay of its own."""
        if self.bodies:
            self._flags.setdefault(level, flags)

    def top_flags(self, jaxpr: Any, consts: list, args: list, ns: Any) -> Flags:
        """The top level's flags: from its forward prefix when that decides the culprit
        (``prefix.py``; the flags then hold only the decided equations), else from the flags
        replay of the whole level."""
        cached = self._flags.get("top")
        if cached is not None:
            return cached
        items = flatten(jaxpr, ns)
        stop = prefix_lib.boundary([str(it.name_stack) for it in items]) if self.prefix else None
        if stop is not None:
            fl = self._prefix_flags(jaxpr, consts, args, ns, stop, len(items))
            if fl is not None:
                self._flags["top"] = fl
                self.prefix_decided = True
                return fl
        return self.flags("top", jaxpr, consts, args, ns, top=True)

    def _prefix_flags(
        self, jaxpr: Any, consts: list, args: list, ns: Any, stop: int, n: int
    ) -> Flags | None:
        known = self.known("top", jaxpr, consts, args, ns)
        outs = prefix_lib.producers(jaxpr)
        watch = prefix_lib.watch(outs, stop)

        def fn(consts, args):
            ctx = interpret.Ctx("flags", known=known, stop_at=stop, watch=watch)
            for a in args:  # registered first, as in the whole level's replay
                ctx.ref(a)
            try:
                interpret.walk(jaxpr, consts, args, ctx, ns)
            except interpret.Stop:
                pass
            upper = ctx.finalize()  # the walk did not return: nothing masked
            # What the step returns is live whatever the rest does; so is what the prefix
            # observes.
            ctx.outputs = frozenset().union(
                *(ctx.ref(x)[1] for xs in ctx.watched.values() for x in xs)
            )
            lower = ctx.finalize(observed_only=True)
            steps = {k: jnp.asarray(v, jnp.int32) for k, v in ctx.steps.items()}

            def codes(xs):
                if not xs:
                    return jnp.zeros((0,), jnp.int8)
                return jnp.stack([ctx.code_of(ctx.ref(x)) for x in xs])

            watched = {k: codes(v) for k, v in ctx.watched.items()}
            return upper, lower, (steps, dict(ctx.bodies)), codes(list(args)), watched

        key = ("prefix", stop, tuple(sorted(known.items())), tuple(sorted(watch.items())))
        upper, lower, (steps, bodies), in_codes, watched = self.call(
            key, fn, list(consts), list(args)
        )
        upper = [np.asarray(x)[:stop] for x in upper]
        lower = [np.asarray(x)[:stop] for x in lower]
        decided = prefix_lib.decide(upper[:2], lower[:2])
        in_codes = np.asarray(in_codes)
        if decided is None and not in_codes.any():
            return None
        root, nan, literal = (np.zeros(n, bool) for _ in range(3))
        if decided is not None:
            k, mode = decided
            (root if mode == "root" else nan)[k] = True
            kn = prefix_lib.first_nan(upper[1], lower[1])
            if kn is not None:
                nan[kn] = True
        idx, got = [], []
        for i, src in enumerate(outs):
            if src is not None and src[0] in watched:
                idx.append(i)
                got.append(int(np.asarray(watched[src[0]])[watch[src[0]].index(src[1])]))
        return Flags(
            root, nan, literal,
            {k: [int(x) for x in np.asarray(v)] for k, v in steps.items()},
            in_codes, None,
            (np.asarray(idx, np.int64), np.asarray(got, np.int8)),
            _host_bodies(bodies),
        )  # fmt: skip

    def capture(
        self,
        level: Any,
        jaxpr: Any,
        consts: list,
        args: list,
        ns: Any,
        ks: Sequence[int],
        shard: Any = None,
    ) -> dict[int, tuple[list, list]]:
        """``{k: (inputs, outputs)}`` of flat equations ``ks`` of a level, in one replay
        (inside a ``shard_map`` body: every shard's, stacked)."""
        missing = sorted(k for k in set(ks) if (level, k) not in self._captured)
        if missing:
            known = self.known(level, jaxpr, consts, args, ns, shard)

            def fn(consts, args):
                ctx = interpret.Ctx("capture", dict.fromkeys(missing), known)
                try:
                    interpret.walk(jaxpr, consts, args, ctx, ns)
                except interpret.Stop as stop:
                    return [stop.payload[k] for k in missing]
                raise RuntimeError(
                    f"replay: flat equations {missing} not reached"
                )  # pragma: no cover

            key = ("capture", structure(level), tuple(missing), tuple(sorted(known.items())))
            out = self.call(key, fn, list(consts), list(args), shard=shard, stacked=(False, True))
            for k, payload in zip(missing, out, strict=True):
                self._captured[(level, k)] = payload
        return {k: self._captured[(level, k)] for k in ks}

    def capture_into(
        self,
        level: Any,
        jaxpr: Any,
        consts: list,
        args: list,
        ns: Any,
        k: int,
        item: Item,
        step: int,
    ) -> list:
        """The body inputs of step ``step`` of loop equation ``k`` of a level, in one replay:
        the level up to ``k``, then the loop up to that step (``step_capture`` without the
        capture of ``k``'s own inputs and outputs; the step is an argument, one compile)."""
        known = self.known(level, jaxpr, consts, args, ns)

        def fn(consts, args, step):
            into = lambda invals: item.rule.capture(item.eqn, invals, item.name_stack, step)  # noqa: E731
            ctx = interpret.Ctx("capture", {k: into}, known)
            try:
                interpret.walk(jaxpr, consts, args, ctx, ns)
            except interpret.Stop as stop:
                return stop.payload[k]
            raise RuntimeError(f"replay: flat equation {k} not reached")  # pragma: no cover

        key = ("capture_into", structure(level), k, tuple(sorted(known.items())))
        return list(self.call(key, fn, list(consts), list(args), np.int32(step)))

    def step_flags(
        self, level: Any, k: int, item: Item, invals: list, shard: Any = None
    ) -> list[int]:
        """First step flagged root, nan and literal (``interpret.MODES``; -1: none) of
        higher-order equation ``k`` run alone on ``invals``, its body instrumented by its rule."""

        def fn(invals):
            return item.rule.flags(item.eqn, invals, item.name_stack)[1]

        key = ("step_flags", structure(level), k)
        steps = _pick(self.call(key, fn, list(invals), shard=shard, stacked=(True,)), shard)
        return [int(s) for s in np.asarray(steps)]

    def step_capture(
        self, level: Any, k: int, item: Item, invals: list, step: int, shard: Any = None
    ) -> list:
        """The body inputs of step ``step`` of higher-order equation ``k`` (see ``rules``)."""

        def fn(invals, step):
            return item.rule.capture(item.eqn, invals, item.name_stack, step)

        key = ("step_capture", structure(level), k)
        out = self.call(key, fn, list(invals), np.int32(step), shard=shard, stacked=(True, False))
        return list(out)


def _first_step(steps: Sequence[int], mode: str) -> tuple[int, tuple[str, ...]]:
    """``(step, (sub mode,))`` to enter a loop flagged in ``mode``: its first step flagged in
    ``mode`` or, when none, in a later mode (a root equation whose body makes NaN from a -inf
    mask literal: nan; or whose body only combines finite values with a non-finite literal:
    literal); ``(-1, ())`` when no step is flagged at all."""
    for m in interpret.MODES[interpret.MODES.index(mode) :]:
        if steps[interpret.MODES.index(m)] >= 0:
            return steps[interpret.MODES.index(m)], (m,)
    return -1, ()


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
    shard: Any = None,
) -> Found | None:
    """First flagged equation (``mode`` one of ``interpret.MODES``) of a level, entering step
    equations (loops, branches, shards) through their rules.

    ``shard``: the level is (inside) a ``shard_map`` body (``rules.ShardCtx``): its values are
    stacked over shards and the search follows shard ``shard.index``.

    Returns:
      The culprit with its captured inputs and outputs, or None when nothing is flagged.
    """
    items = flatten(jaxpr, ns, (), frames)
    fl = sess.flags(level, jaxpr, consts, args, ns, top, shard)
    vec = {"root": fl.root, "nan": fl.nan, "literal": fl.literal}[mode]
    for k in np.nonzero(vec)[0][:3]:  # the first; the next ones only if replays disagree
        k = int(k)
        item = items[k]
        path = (*base, *item.path)
        step, sub_modes = -1, ()
        direct = (  # a loop whose flagged steps the flags replay found: one capture replay
            item.rule is not None
            and item.rule.pick is None
            and item.rule.context is None
            and k in fl.steps
            and shard is None
            and sess.bodies
        )
        if direct:
            step, sub_modes = _first_step(fl.steps[k], mode)
            direct = step >= 0
        if direct:
            captured = sess.capture_into(level, jaxpr, consts, args, ns, k, item, step)
            sub_shard, mine = None, None
        else:
            invals, outvals = sess.capture(level, jaxpr, consts, args, ns, [k], shard)[k]
            mine = _pick((list(invals), list(outvals)), shard)
            if item.rule is None:
                where = (
                    None if shard is not None else (level, jaxpr, consts, args, ns, frames, base, k)
                )
                return Found(item, path, *mine, mode, shard=shard, where=where)
            sub_shard = shard
            if item.rule.pick is not None:  # the step is known from the operands (a branch)
                step = item.rule.pick(item.eqn, mine[0])
                captured = item.rule.capture(item.eqn, list(invals), item.name_stack, step)
                sub_modes = interpret.MODES[interpret.MODES.index(mode) :]
            else:
                steps = (
                    fl.steps[k] if k in fl.steps else sess.step_flags(level, k, item, invals, shard)
                )
                step, sub_modes = _first_step(steps, mode)
                if step < 0:  # not even a literal: an output of the body is a non-finite literal
                    return Found(item, path, *mine, mode, constant=True, shard=shard)
                if item.rule.context is not None:
                    if shard is not None:  # pragma: no cover - nested shard_map bodies
                        return Found(item, path, *mine, mode, shard=shard)
                    sub_shard = item.rule.context(item.eqn, step)
                captured = sess.step_capture(level, k, item, invals, step, shard)
        elem, sub, sub_consts, sub_args = item.rule.enter(item.eqn, step, list(captured))
        body = fl.bodies.get(k)
        if body is not None and body[0] == step and sub_shard is None:
            sess.seed((level, k, elem), Flags(*body[1:], {}, None, None))
        for sub_mode in sub_modes:
            found = search(
                sess, (level, k, elem), sub, sub_consts, sub_args, item.name_stack,
                (*path, elem), sub_mode, frames=item.frames, shard=sub_shard,
            )  # fmt: skip
            if found is not None:
                return found
        if item.rule.pick is not None:
            return Found(item, path, *mine, mode, constant=True, shard=shard)
    return None
