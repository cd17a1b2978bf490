"""Finds the equation that produced the first non-finite value of a program.

Root cause: the first equation, in program order, whose output holds a non-finite value while all
its inputs (operands, literals and constants) are finite. A ``-inf`` mask fill is therefore never
blamed (its ``-inf`` operand is itself non-finite), an ``exp`` overflow is blamed rather than the
``inf - inf`` after it, and a NaN hidden by ``jnp.where`` in the forward pass is found even when
only the gradient shows it.

How (one instrumented pass per nesting level, then one capture pass):
  * The jaxpr is walked by a small interpreter that is itself traced under ``jax.jit``. Call-like
    equations (``jit``, ``closed_call``, ``remat``/``checkpoint``, ``custom_jvp_call``,
    ``custom_vjp_call``) are inlined, so one level is a flat list of primitives and loop/branch
    equations. The *flags pass* returns, for every flat equation, two bools: "non-finite output
    from finite inputs" (root) and "NaN output from NaN-free inputs" (first NaN). A ``scan`` /
    ``while`` is re-built with its body instrumented the same way and additionally carries the
    first iteration at which a body flag fired; a ``cond`` runs the taken branch instrumented. So
    one compiled segment answers every halving of a bisection at once: the first True index is
    the culprit at that level (a segment replay of N equations costs O(N) work, not O(N log N)).
  * The *capture pass* replays the prefix of the level up to the culprit and returns its input
    (and output) values; for a loop it runs exactly the iterations before the bad one and returns
    that iteration's body inputs; for a ``cond`` the branch index and operands. The localizer then
    descends into the loop body / branch with those inputs and repeats.
  Each jitted pass is one *replay* (``Report.replays``): 2 per nesting level, ~2-8 in total for a
  train step, well under ``3 * log2(N)``. Compiled passes are cached by the program's structure,
  so a second incident on a freshly traced copy of the same step compiles nothing.

JAX internals are isolated in ``_jax_compat``.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from nan2safe_jax.replay import _jax_compat as jc
from nan2safe_jax.replay.report import (
    NOT_REPRODUCIBLE,
    EqnRef,
    Report,
    array_stats,
    channel_scan,
    diagnose,
    direction_of,
)
from nan2safe_jax.site import site_from_name_stack

__all__ = ["locate", "locate_step"]


# ---------------------------------------------------------------------------------------------
# static view of one level: the flat list of equations after inlining call-like equations


@dataclasses.dataclass(frozen=True)
class _Item:
    eqn: Any
    path: tuple  # equation indices from the level's jaxpr down through inlined calls
    name_stack: Any  # full NameStack
    source: str | None
    kind: str  # "prim" | "scan" | "while" | "cond"


def _kind(eqn: Any) -> str:
    name = eqn.primitive.name
    if name == "scan":
        return "scan"
    if name == "while":
        return "while"
    if name == "cond":
        return "cond"
    return "prim"


def _flatten(jaxpr: Any, ns: Any, path: tuple = (), source: str | None = None) -> list[_Item]:
    items: list[_Item] = []
    for i, eqn in enumerate(jaxpr.eqns):
        ens = jc.eqn_name_stack(eqn, ns)
        src = jc.eqn_user_source(eqn) or source
        body = jc.call_body(eqn)
        if body is not None:
            items.extend(_flatten(body[0], ens, (*path, i), src))
        else:
            items.append(_Item(eqn, (*path, i), ens, src, _kind(eqn)))
    return items


# ---------------------------------------------------------------------------------------------
# the interpreter (traced under jax.jit)


class _Stop(Exception):  # noqa: N818 - control flow, not an error
    def __init__(self, payload: list[Any]):
        super().__init__()
        self.payload = payload


def _inexact(x: Any) -> bool:
    try:
        return bool(jax.dtypes.issubdtype(jnp.result_type(x), jnp.inexact))
    except (TypeError, ValueError):
        return False


_Ref = tuple  # (static code, frozenset of indices into _Ctx.vals): a value's code is the max


class _Ctx:
    """Per-walk state. mode: "plain" (just evaluate), "flags" or "capture".

    In "flags" mode every float value is summarized by a code: 0 all finite, 1 has +-inf but no
    NaN, 2 has NaN. Codes are not computed one reduction per value (one XLA kernel each: that
    dominated compile time); values are registered in ``vals`` and ``finalize`` computes all codes
    with one concatenation and one segment reduction, then each equation's flags with static
    gathers. Literals get static codes; outputs of value-preserving equations get the union of
    their inputs' index sets, so they need no reduction at all.
    """

    def __init__(self, mode: str, targets: dict[int, int | None] | None = None):
        self.mode = mode
        self.targets = targets or {}  # capture: flat index -> loop iteration (or None)
        self.payloads: dict[int, list] = {}
        self.count = 0
        self.vals: list[Any] = []
        self.recs: list[tuple] = []  # per flat eqn: ("eqn", in_ref, out_ref) | ("given", r, n)
        self.iters: dict[int, tuple[Any, Any]] = {}
        self._memo: dict[int, tuple[Any, _Ref]] = {}
        self._flags: tuple[Any, Any] | None = None
        self._codes: Any = None

    def ref(self, x: Any) -> _Ref:
        """The code reference of ``x`` (registering it for a reduction if needed)."""
        if not _inexact(x):
            return (0, frozenset())
        if isinstance(x, (int, float, complex, np.ndarray, np.generic)):
            a = np.asarray(x)
            return (2 if np.isnan(a).any() else int(not np.isfinite(a).all()), frozenset())
        hit = self._memo.get(id(x))
        if hit is not None and hit[0] is x:
            return hit[1]
        r = (0, frozenset({len(self.vals)}))
        self.vals.append(x)
        self._memo[id(x)] = (x, r)
        return r

    def union(self, xs: Sequence[Any]) -> _Ref:
        code, idx = 0, frozenset()
        for x in xs:
            c, i = self.ref(x)
            code, idx = max(code, c), idx | i
        return code, idx

    def derive(self, x: Any, r: _Ref) -> None:
        """Records that ``x``'s code is ``r`` (known from its inputs, no reduction needed)."""
        if _inexact(x) and not isinstance(x, (int, float, complex, np.ndarray, np.generic)):
            self._memo[id(x)] = (x, r)

    def record(self, in_ref: _Ref | None, out_ref: _Ref | None) -> None:
        self.recs.append(("eqn", in_ref, out_ref))

    def record_given(self, r: Any, n: Any) -> None:
        self.recs.append(("given", r, n))

    def codes(self) -> Any:
        """int8[len(vals)]: the code of every registered value (computed once, on finalize)."""
        if self._codes is not None:
            return self._codes
        if not self.vals:
            return jnp.zeros((0,), jnp.int8)
        # Group by a common dtype so that each value costs at most one convert (exact: f16/bf16/fp8
        # -> f32), then one concatenation and three elementwise ops per group, not per value.
        groups: dict[Any, tuple[list, list]] = {}
        for j, v in enumerate(self.vals):
            dt = jnp.result_type(v)
            if jnp.issubdtype(dt, jnp.floating) and jnp.finfo(dt).bits <= 32:
                dt = jnp.dtype(jnp.float32)
            parts, seg = groups.setdefault(dt, ([], []))
            parts.append(jnp.ravel(v).astype(dt))
            seg.append(np.full(int(np.prod(np.shape(v))), j, np.int32))
        flats, segs = [], []
        for parts, seg in groups.values():
            x = jnp.concatenate(parts) if len(parts) > 1 else parts[0]
            flats.append(jnp.where(jnp.isnan(x), 2, jnp.isinf(x).astype(jnp.int8)).astype(jnp.int8))
            segs.append(np.concatenate(seg))
        flat = jnp.concatenate(flats) if len(flats) > 1 else flats[0]
        n = len(self.vals)
        out = jax.ops.segment_max(flat, np.concatenate(segs), num_segments=n)
        self._codes = jnp.maximum(out, 0)  # empty values reduce to the identity (-128)
        return self._codes

    def finalize(self) -> tuple[Any, Any]:
        """``(root, nan)``: bool[count] flags of every flat equation of this walk."""
        if self._flags is not None:
            return self._flags
        m = len(self.recs)
        if m == 0:
            z = jnp.zeros((1,), bool)
            self._flags = (z, z)
            return self._flags
        codes = jnp.concatenate([self.codes(), jnp.zeros((1,), jnp.int8)])  # last: a zero pad
        in_static = np.zeros(m, np.int8)
        out_static = np.zeros(m, np.int8)
        live = np.zeros(m, bool)
        gi, si, go, so = [], [], [], []
        for k, rec in enumerate(self.recs):
            if rec[0] != "eqn" or rec[2] is None:
                continue
            live[k] = True
            (ci, ii), (co, oi) = rec[1], rec[2]
            in_static[k], out_static[k] = ci, co
            gi += sorted(ii)
            si += [k] * len(ii)
            go += sorted(oi)
            so += [k] * len(oi)

        def gather_max(idx, seg, static):
            if not idx:
                return jnp.asarray(static)
            g = jax.ops.segment_max(codes[np.asarray(idx)], np.asarray(seg, np.int32), m)
            return jnp.maximum(g, jnp.asarray(static))

        cin = gather_max(gi, si, in_static)
        cout = gather_max(go, so, out_static)
        root = (cout > 0) & (cin == 0) & live
        nan = (cout == 2) & (cin < 2) & live
        given = [(k, rec[1], rec[2]) for k, rec in enumerate(self.recs) if rec[0] == "given"]
        if given:
            ks = np.asarray([k for k, _, _ in given])
            root = root.at[ks].set(jnp.stack([jnp.asarray(r, bool) for _, r, _ in given]))
            nan = nan.at[ks].set(jnp.stack([jnp.asarray(n, bool) for _, _, n in given]))
        self._flags = (root, nan)
        return self._flags

    def any_root(self) -> Any:
        return jnp.any(self.finalize()[0])

    def any_nan(self) -> Any:
        return jnp.any(self.finalize()[1])


# Primitives whose output holds exactly the values of their inputs (each input element appears at
# least once, nothing is computed): the output is finite iff every input is, so the flags pass
# derives their finiteness instead of reducing over them (a third of a train step's equations).
_PRESERVING = frozenset(
    {"reshape", "broadcast_in_dim", "transpose", "squeeze", "expand_dims", "copy", "copy_p"}
    | {"rev", "concatenate", "neg", "optimization_barrier"}
)


def _preserves(eqn: Any) -> bool:
    name = eqn.primitive.name
    if name in _PRESERVING:
        return all(d > 0 for v in eqn.outvars for d in getattr(v.aval, "shape", ()))
    if name == "convert_element_type":  # widening float -> float keeps every value
        src = eqn.invars[0].aval.dtype
        dst = eqn.params["new_dtype"]
        try:
            return bool(
                jnp.issubdtype(src, jnp.floating)
                and jnp.issubdtype(dst, jnp.floating)
                and jnp.finfo(dst).max >= jnp.finfo(src).max
                and jnp.finfo(dst).bits >= jnp.finfo(src).bits
            )
        except (TypeError, ValueError):
            return False
    return False


def _walk(jaxpr: Any, consts: Sequence[Any], args: Sequence[Any], ctx: _Ctx, ns: Any) -> list:
    env: dict[Any, Any] = {}

    def read(a: Any) -> Any:
        return jc.literal_value(a) if jc.is_literal(a) else env[a]

    for v, x in zip(jaxpr.constvars, consts, strict=True):
        env[v] = x
    for v, x in zip(jaxpr.invars, args, strict=True):
        env[v] = x
    for eqn in jaxpr.eqns:
        invals = [read(a) for a in eqn.invars]
        ens = jc.eqn_name_stack(eqn, ns)
        body = jc.call_body(eqn)
        if body is not None:
            outs = _walk(body[0], body[1], invals, ctx, ens)
        else:
            k = ctx.count
            ctx.count += 1
            if ctx.mode == "capture" and k in ctx.targets:
                ctx.payloads[k] = payload = _capture(eqn, invals, ens, ctx.targets[k])
                if len(ctx.payloads) == len(ctx.targets):
                    raise _Stop(ctx.payloads)
                outs = payload[1] if _kind(eqn) == "prim" else _apply(eqn, invals, ens, ctx, k)
            else:
                outs = _apply(eqn, invals, ens, ctx, k)
        for v, o in zip(eqn.outvars, outs, strict=True):
            env[v] = o
    return [read(a) for a in jaxpr.outvars]


def _apply(eqn: Any, invals: list, ns: Any, ctx: _Ctx, k: int) -> list:
    if ctx.mode != "flags":
        return jc.bind_eqn(eqn, invals, ns)
    kind = _kind(eqn)
    if kind == "scan":
        outs, fr, fn = _scan_flags(eqn, invals, ns)
    elif kind == "while":
        outs, fr, fn = _while_flags(eqn, invals, ns)
    elif kind == "cond":
        outs, r, n = _cond_flags(eqn, invals, ns)
        ctx.record_given(r, n)
        return outs
    else:
        in_ref = ctx.union(invals)
        outs = jc.bind_eqn(eqn, invals, ns)
        if _preserves(eqn):  # exact without a reduction: out finite <=> all inputs finite
            for o in outs:
                ctx.derive(o, in_ref)
            ctx.record(None, None)
        elif in_ref[0] == 2:  # a NaN literal input: never flagged
            ctx.record(None, None)
        else:
            ctx.record(in_ref, ctx.union(outs))
        return outs
    ctx.iters[k] = (fr, fn)
    ctx.record_given(fr >= 0, fn >= 0)
    return outs


def _first(first: Any, hit: Any, i: Any) -> Any:
    return jnp.where((first < 0) & hit, i, first)


def _scan_flags(eqn: Any, invals: list, ns: Any) -> tuple[list, Any, Any]:
    sp = jc.scan_params(eqn)
    nc, ncar, length = sp["num_consts"], sp["num_carry"], sp["length"]
    consts, init, xs = invals[:nc], invals[nc : nc + ncar], invals[nc + ncar :]

    def body(carry, x):
        i, fr, fn, c = carry
        sub = _Ctx("flags")
        outs = _walk(sp["jaxpr"], sp["consts"], [*consts, *c, *x], sub, ns)
        t = (length - 1 - i) if sp["reverse"] else i  # index along the scanned axis
        carry = (i + 1, _first(fr, sub.any_root(), t), _first(fn, sub.any_nan(), t))
        return (*carry, outs[:ncar]), outs[ncar:]

    m1 = jnp.asarray(-1, jnp.int32)
    (_, fr, fn, c), ys = lax.scan(
        body,
        (jnp.asarray(0, jnp.int32), m1, m1, list(init)),
        list(xs),
        length=length,
        reverse=sp["reverse"],
        unroll=sp["unroll"],
    )
    return [*c, *ys], fr, fn


def _scan_capture(eqn: Any, invals: list, ns: Any, t: int) -> list:
    """The body inputs of iteration ``t`` (index along the scanned axis) of a scan equation."""
    sp = jc.scan_params(eqn)
    nc, ncar, length = sp["num_consts"], sp["num_carry"], sp["length"]
    consts, init, xs = invals[:nc], invals[nc : nc + ncar], invals[nc + ncar :]

    def body(c, x):
        outs = _walk(sp["jaxpr"], sp["consts"], [*consts, *c, *x], _Ctx("plain"), ns)
        return outs[:ncar], None

    if sp["reverse"]:
        before = [x[t + 1 :] for x in xs]
        n = length - 1 - t
    else:
        before = [x[:t] for x in xs]
        n = t
    c, _ = lax.scan(body, list(init), before, length=n, reverse=sp["reverse"])
    return [*consts, *c, *[x[t] for x in xs]]


def _while_flags(eqn: Any, invals: list, ns: Any) -> tuple[list, Any, Any]:
    wp = jc.while_params(eqn)
    cn, bn = wp["cond_nconsts"], wp["body_nconsts"]
    cc, bc, init = invals[:cn], invals[cn : cn + bn], invals[cn + bn :]

    def cond(carry):
        c = carry[3]
        return _walk(wp["cond_jaxpr"], wp["cond_consts"], [*cc, *c], _Ctx("plain"), ns)[0]

    def body(carry):
        i, fr, fn, c = carry
        sub = _Ctx("flags")
        outs = _walk(wp["body_jaxpr"], wp["body_consts"], [*bc, *c], sub, ns)
        return i + 1, _first(fr, sub.any_root(), i), _first(fn, sub.any_nan(), i), outs

    m1 = jnp.asarray(-1, jnp.int32)
    _, fr, fn, c = lax.while_loop(cond, body, (jnp.asarray(0, jnp.int32), m1, m1, list(init)))
    return list(c), fr, fn


def _while_capture(eqn: Any, invals: list, ns: Any, t: int) -> list:
    wp = jc.while_params(eqn)
    cn, bn = wp["cond_nconsts"], wp["body_nconsts"]
    cc, bc, init = invals[:cn], invals[cn : cn + bn], invals[cn + bn :]

    def cond(carry):
        i, c = carry
        ok = _walk(wp["cond_jaxpr"], wp["cond_consts"], [*cc, *c], _Ctx("plain"), ns)[0]
        return jnp.logical_and(ok, i < t)

    def body(carry):
        i, c = carry
        return i + 1, _walk(wp["body_jaxpr"], wp["body_consts"], [*bc, *c], _Ctx("plain"), ns)

    _, c = lax.while_loop(cond, body, (jnp.asarray(0, jnp.int32), list(init)))
    return [*bc, *c]


def _cond_flags(eqn: Any, invals: list, ns: Any) -> tuple[list, Any, Any]:
    index, ops = invals[0], invals[1:]

    def branch(j, consts):
        def run(*o):
            sub = _Ctx("flags")
            outs = _walk(j, consts, o, sub, ns)
            return outs, sub.any_root(), sub.any_nan()

        return run

    fns = [branch(j, c) for j, c in jc.cond_branches(eqn)]
    outs, r, n = lax.switch(index, fns, *ops)
    return list(outs), r, n


def _capture(eqn: Any, invals: list, ns: Any, it: int | None) -> list:
    kind = _kind(eqn)
    if kind == "scan":
        return _scan_capture(eqn, invals, ns, it)
    if kind == "while":
        return _while_capture(eqn, invals, ns, it)
    if kind == "cond":
        return list(invals)
    return [list(invals), jc.bind_eqn(eqn, invals, ns)]


# ---------------------------------------------------------------------------------------------
# one locate call: compiled passes, cached, counted


@dataclasses.dataclass
class _Flags:
    root: np.ndarray  # bool[n_flat]
    nan: np.ndarray  # bool[n_flat]
    iters: dict[int, tuple[int, int]]  # flat index of a loop -> first (root, nan) iteration
    in_finite: np.ndarray | None  # bool[n_args], top level only


@dataclasses.dataclass
class _Found:
    item: _Item
    path: tuple
    invals: list
    outvals: list
    note: str = ""


# Every intermediate of a replay is observed by a finiteness reduction. XLA's instruction fusion
# then duplicates each cheap producer chain into every reduction that reads it, which makes the
# optimized program quadratic in size (a 600-op add/mul chain: 8 s to compile on CPU instead of
# 0.4 s). Replays therefore run unfused, which is also closest to op-by-op semantics.
_NO_FUSION = "fusion,priority-fusion,multi_output_fusion"


def _compiler_options() -> dict[str, Any]:
    """XLA options for replays: no fusion; on GPU also deterministic ops (SPEC tier 2 step 2).

    On CPU also LLVM optimization level 0: it cuts a train step's replay compile by ~30-40% and
    changes results only at the rounding level, as unfused compilation already does (measured on
    the benchmark's train steps: at most 1.5e-7 of each output's max, no flag changed). Not used:
    ``xla_cpu_use_fusion_emitters=False`` compiles 5x faster but computes multi-axis contractions
    wrongly when fusion is off (jax 0.10.2), and fusion on is quadratic (see ``_NO_FUSION``).
    """
    opts: dict[str, Any] = {"xla_disable_hlo_passes": _NO_FUSION}
    backend = jax.default_backend()
    if backend == "gpu":
        opts["xla_gpu_deterministic_ops"] = True
    elif backend == "cpu":
        opts["xla_backend_optimization_level"] = 0
    return opts


# Compiled replays, reused when a structurally identical program is located again: the supervisor
# replays several ring-buffer steps of one traced step, and traces the step afresh per incident.
# {fingerprint of the top jaxpr: {structural key of a replay: jitted}}. The fingerprint is the
# printed jaxpr (equations, parameters, literals, shapes) plus the constants' shapes and dtypes:
# constants are arguments of every replay, so their values may differ. A jaxpr whose printout
# holds an object address (a function-valued parameter) simply misses.
_JIT_CACHE: dict[str, dict[Any, Any]] = {}
_JIT_CACHE_SIZE = 4


def _fingerprint(top: Any) -> str:
    jaxpr, consts = jc.open_jaxpr(top)
    avals = [(np.shape(c), str(jnp.result_type(c))) for c in consts]
    return f"{jaxpr}\n{avals}"


def _jits_for(top: Any) -> dict[Any, Any]:
    key = _fingerprint(top)
    hit = _JIT_CACHE.get(key)
    if hit is not None:
        return hit
    while len(_JIT_CACHE) >= _JIT_CACHE_SIZE:
        _JIT_CACHE.pop(next(iter(_JIT_CACHE)))
    jits: dict[Any, Any] = {}
    _JIT_CACHE[key] = jits
    return jits


def _jit_key(level: Any) -> Any:
    """``level`` without loop iterations: every iteration of a loop body shares one replay."""
    if not isinstance(level, tuple):
        return level
    parent, k, step = level
    return (_jit_key(parent), k, "iter" if step[0] == "iter" else step)


class _Session:
    def __init__(self, top: Any) -> None:
        self.replays = 0
        self._jits = _jits_for(top)
        self._flags: dict[Any, _Flags] = {}
        self._captured: dict[Any, list] = {}
        self._options = _compiler_options()

    def _call(self, key: Any, fn: Any, *args: Any) -> Any:
        jitted = self._jits.get(key)
        if jitted is None:
            jitted = self._jits[key] = jc.jit_with_options(fn, self._options)
        self.replays += 1
        while True:
            try:
                return jax.device_get(jitted(*args))
            except Exception as e:  # noqa: BLE001 - an unknown compiler option: drop it, retry
                bad = [o for o in self._options or () if f"'{o}'" in str(e)]
                if not self._options or "compile option" not in str(e):
                    raise
                for o in bad or list(self._options):
                    self._options.pop(o)
                jitted = self._jits[key] = jc.jit_with_options(fn, self._options)

    def flags(self, level: Any, jaxpr: Any, consts: list, args: list, ns: Any, top: bool) -> _Flags:
        cached = self._flags.get(level)
        if cached is not None:
            return cached

        def fn(consts, args):
            ctx = _Ctx("flags")
            arg_refs = [ctx.ref(a) for a in args] if top else []
            _walk(jaxpr, consts, args, ctx, ns)
            root, nan = ctx.finalize()
            iters = {k: (jnp.asarray(a), jnp.asarray(b)) for k, (a, b) in ctx.iters.items()}
            in_fin = None
            if top:
                codes = ctx.codes()
                fins = [jnp.asarray(c == 0) if not i else codes[min(i)] == 0 for c, i in arg_refs]
                in_fin = jnp.stack(fins) if fins else jnp.ones((0,), bool)
            return root, nan, iters, in_fin

        root, nan, iters, in_fin = self._call(
            ("flags", _jit_key(level), top), fn, list(consts), list(args)
        )
        out = _Flags(
            np.asarray(root),
            np.asarray(nan),
            {k: (int(a), int(b)) for k, (a, b) in iters.items()},
            None if in_fin is None else np.asarray(in_fin),
        )
        self._flags[level] = out
        return out

    def capture(
        self, level: Any, jaxpr: Any, consts: list, args: list, ns: Any, k: int, it: int | None
    ) -> list:
        """Inputs (and outputs) of flat equation ``k`` of a level; see ``_capture``."""
        hit = self._captured.get((level, k, it))
        if hit is None:
            self.capture_many(level, jaxpr, consts, args, ns, ((k, it),))
            hit = self._captured[(level, k, it)]
        return hit

    def capture_many(
        self, level: Any, jaxpr: Any, consts: list, args: list, ns: Any, targets: tuple
    ) -> None:
        """Captures several equations of one level in a single replay."""
        want = dict(targets)

        def fn(consts, args):
            try:
                _walk(jaxpr, consts, args, _Ctx("capture", want), ns)
            except _Stop as stop:
                return stop.payload
            raise RuntimeError(f"replay: flat equations {want} not reached")  # pragma: no cover

        key = ("capture", _jit_key(level), tuple(sorted(want.items())))
        out = self._call(key, fn, list(consts), list(args))
        for k, it in want.items():
            self._captured[(level, k, it)] = out[k]


def _search(
    sess: _Session,
    level: Any,
    jaxpr: Any,
    consts: list,
    args: list,
    ns: Any,
    base: tuple,
    mode: str,
    top: bool = False,
    depth: int = 0,
) -> _Found | None:
    """First flagged equation (mode "root" or "nan") of a level, descending into loops/branches."""
    items = _flatten(jaxpr, ns)
    fl = sess.flags(level, jaxpr, consts, args, ns, top)
    vec = fl.root if mode == "root" else fl.nan
    for k in np.nonzero(vec)[0][:3]:  # the first; the next ones only if replays disagree
        k = int(k)
        item = items[k]
        path = (*base, *item.path)
        if item.kind in ("scan", "while"):
            t = fl.iters[k][0 if mode == "root" else 1]
            body_args = sess.capture(level, jaxpr, consts, args, ns, k, t)
            if item.kind == "scan":
                sp = jc.scan_params(item.eqn)
                bj, bc = sp["jaxpr"], sp["consts"]
            else:
                wp = jc.while_params(item.eqn)
                bj, bc = wp["body_jaxpr"], wp["body_consts"]
            sub_path = (*path, ("iter", t))
            found = _search(
                sess, (level, k, ("iter", t)), bj, list(bc), list(body_args), item.name_stack,
                sub_path, mode, depth=depth + 1,
            )  # fmt: skip
        elif item.kind == "cond":
            vals = sess.capture(level, jaxpr, consts, args, ns, k, None)
            b = int(np.asarray(vals[0]))
            bj, bc = jc.cond_branches(item.eqn)[b]
            sub_path = (*path, ("branch", b))
            found = _search(
                sess, (level, k, ("branch", b)), bj, list(bc), list(vals[1:]), item.name_stack,
                sub_path, mode, depth=depth + 1,
            )  # fmt: skip
        else:
            invals, outvals = sess.capture(level, jaxpr, consts, args, ns, k, None)
            return _Found(item, path, list(invals), list(outvals))
        if found is not None:
            return found
    return None


# ---------------------------------------------------------------------------------------------
# public API


def _kind_of(outvals: Sequence[Any]) -> tuple[str | None, int | None]:
    """("nan" | "inf" | None, index of the first non-finite output)."""
    first, kind = None, None
    for i, o in enumerate(outvals):
        a = np.asarray(o)
        if not _inexact(a):
            continue
        a = a.astype(np.float64) if a.dtype.kind != "c" else a
        if np.isnan(a).any():
            return "nan", i
        if first is None and not np.isfinite(a).all():
            first, kind = i, "inf"
    return kind, first


def _ref(found: _Found) -> EqnRef:
    ns = str(found.item.name_stack)
    return EqnRef(
        primitive=found.item.eqn.primitive.name,
        source=found.item.source,
        name_stack=ns,
        site=site_from_name_stack(ns),
        direction=direction_of(ns),
        eqn_path=found.path,
    )


def locate(jaxpr: Any, args: Any) -> Report | None:
    """Names the equation that produced the first non-finite value of ``jaxpr`` on ``args``.

    Args:
      jaxpr: the ``ClosedJaxpr`` of a function (``jax.make_jaxpr(f)(*args)``), or an open
        ``Jaxpr`` without constants.
      args: the pytree of the function's arguments; its leaves, flattened, are the jaxpr's inputs
        (pass the tuple of positional arguments).

    Returns:
      None when no equation produces a non-finite value from finite inputs and no argument is
      non-finite; else a ``Report``. An argument that is already non-finite gives a report with
      ``diagnosis == "polluted input"``, ``primitive=None`` and the argument's ``keystr`` path.
      When no equation turns finite inputs into a non-finite value but some equation turns NaN-free
      inputs into NaN (e.g. ``-inf - -inf`` after a ``-inf`` mask on a fully masked row), that
      equation is reported.

    Raises:
      ValueError: if ``args`` does not have one leaf per input of ``jaxpr``.
    """
    return _run(jaxpr, args)[0]


def _run(jaxpr: Any, args: Any) -> tuple[Report | None, int]:
    """``locate``, and the number of replays it ran."""
    t0 = time.perf_counter()
    top_jaxpr, consts = jc.open_jaxpr(jaxpr)
    leaves_with_path, _ = jax.tree_util.tree_flatten_with_path(args)
    leaves = [leaf for _, leaf in leaves_with_path]
    if len(leaves) != len(top_jaxpr.invars):
        raise ValueError(
            f"locate: args has {len(leaves)} leaves but the jaxpr has {len(top_jaxpr.invars)} "
            "inputs; pass the tuple of the traced function's positional arguments, e.g. "
            "locate(jax.make_jaxpr(f)(*args), args)"
        )
    sess = _Session(jaxpr)
    return _locate(sess, jaxpr, leaves_with_path, t0), sess.replays


def _locate(sess: _Session, jaxpr: Any, leaves_with_path: list, t0: float) -> Report | None:
    top_jaxpr, consts = jc.open_jaxpr(jaxpr)
    leaves = [leaf for _, leaf in leaves_with_path]
    ns = jc.empty_name_stack()
    fl = sess.flags("top", top_jaxpr, list(consts), leaves, ns, top=True)

    if fl.in_finite is not None and not fl.in_finite.all():
        i = int(np.nonzero(~fl.in_finite)[0][0])
        path, leaf = leaves_with_path[i]
        a = np.asarray(leaf).astype(np.float64)
        kind = "nan" if np.isnan(a).any() else "inf"
        stats = array_stats(leaf)
        chans, cut = channel_scan(leaf)
        keystr = jax.tree_util.keystr(path)
        return Report.no_equation(
            kind=kind,
            inputs=[stats],
            channels=chans,
            channels_truncated=cut,
            diagnosis="polluted input",
            explanation=(
                f"argument {keystr} already holds {stats['nonfinite']} non-finite value(s) "
                "before any equation runs (data or state pollution)"
            ),
            replays=sess.replays,
            seconds=time.perf_counter() - t0,
            input_path=keystr,
            output_shape=tuple(np.shape(leaf)),
        )

    mode = "root" if fl.root.any() else ("nan" if fl.nan.any() else None)
    if mode is None:
        return None
    if mode == "root" and fl.nan.any():  # one replay captures both top-level culprits
        kr, kn = int(np.argmax(fl.root)), int(np.argmax(fl.nan))
        if kr != kn:
            targets = (
                (kr, fl.iters[kr][0] if kr in fl.iters else None),
                (kn, fl.iters[kn][1] if kn in fl.iters else None),
            )
            sess.capture_many("top", top_jaxpr, list(consts), leaves, ns, targets)
    found = _search(sess, "top", top_jaxpr, list(consts), leaves, ns, (), mode, top=True)
    if found is None:  # pragma: no cover - flags and capture replays disagreed
        return None
    kind, oi = _kind_of(found.outvals)
    first_nan = None
    if kind == "inf" and fl.nan.any():
        nf = _search(sess, "top", top_jaxpr, list(consts), leaves, ns, (), "nan", top=True)
        first_nan = _ref(nf) if nf is not None else None
    ref = _ref(found)
    literal = [jc.is_literal(a) for a in found.item.eqn.invars]
    in_stats = [array_stats(v, lit) for v, lit in zip(found.invals, literal, strict=True)]
    out = found.outvals[oi] if oi is not None else found.outvals[0]
    kind = kind or ("nan" if mode == "nan" else "inf")
    chans, cut = channel_scan(out, nan_only=mode == "nan")
    diagnosis, why = diagnose(ref.primitive, found.invals, out, kind, in_stats)
    if mode == "nan":
        why += (
            "; its inputs already held +-inf from a non-finite constant or literal "
            "(e.g. a -inf mask fill on a fully masked row), so no equation made the inf"
        )
    if jc.has_sub_jaxpr(found.item.eqn):  # an opaque higher-order primitive was blamed
        diagnosis = "other"
        why = f"could not enter {ref.primitive}: the fault is inside it ({why})"
    return Report(
        primitive=ref.primitive,
        source=ref.source,
        name_stack=ref.name_stack,
        site=ref.site,
        direction=ref.direction,
        kind=kind,
        first_nan=first_nan,
        eqn_path=ref.eqn_path,
        inputs=in_stats,
        channels=chans,
        channels_truncated=cut,
        diagnosis=diagnosis,
        explanation=why,
        replays=sess.replays,
        seconds=time.perf_counter() - t0,
        output_shape=tuple(np.shape(out)),
    )


def locate_step(step_fn: Any, *args: Any) -> Report:
    """Traces ``step_fn(*args)`` and locates its first non-finite value.

    A jitted ``step_fn`` traces to a single ``jit`` equation, which is entered. On GPU every replay
    is compiled with ``xla_gpu_deterministic_ops`` (a per-``jit`` compiler option, so it does not
    need to be set before the backend starts).

    Returns:
      The ``Report`` of ``locate``; when the replay produces no non-finite value at all, a report
      with ``reproducible=False``, ``primitive=None`` and diagnosis
      ``"not reproducible: suspect hardware or non-determinism"`` (unlike ``locate``, which returns
      None for a clean function: ``locate_step`` is called because a step *was* seen to fail).
    """
    t0 = time.perf_counter()
    jaxpr = jax.make_jaxpr(step_fn)(*args)
    report, replays = _run(jaxpr, args)
    if report is not None:
        return report
    return Report.no_equation(
        kind=None,
        inputs=[],
        channels={},
        diagnosis=NOT_REPRODUCIBLE,
        explanation=(
            "a deterministic replay of the step from the same inputs produced only finite values"
        ),
        replays=replays,
        seconds=time.perf_counter() - t0,
        reproducible=False,
    )
