"""Finds the equation that produced the first non-finite value of a program.

Root cause: the first equation, in program order, that either turns finite inputs (operands,
literals and constants) into a non-finite value (a *root*) or turns NaN-free inputs into NaN (a
*nan* equation: ``-inf - -inf`` on a fully masked row, after a ``-inf`` fill). A ``-inf`` mask
fill is therefore never blamed (its ``-inf`` operand is itself non-finite), an ``exp`` overflow
is blamed rather than the ``inf - inf`` after it (the overflow comes first), and a NaN hidden by
``jnp.where`` in the forward pass is found even when only the gradient shows it. When neither
exists, the literal or constant that carried the non-finite value in is named.

How: ``search.py`` (one flags replay and one capture replay per nesting level, see there), the
interpreter in ``interpret.py``, one rule per higher-order primitive in ``rules.py``, compiled
replays cached in ``cache.py``; at the top level of a train step the forward prefix is replayed
first and decides when it can (``prefix.py``). ``locate_step`` also checks that the replay
reproduces the production step's non-finite outputs before it names anything.
"""

from __future__ import annotations

import dataclasses
import itertools
import re
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from nan2safe_jax import programs
from nan2safe_jax.replay import _jax_compat as jc
from nan2safe_jax.replay import cache, interpret, magnitude, reach, rules
from nan2safe_jax.replay.report import (
    NOT_REPRODUCIBLE,
    EqnRef,
    Report,
    array_stats,
    channel_scan,
    diagnose,
    direction_of,
    magnitude_sentence,
    opaque_why,
    path_str,
)
from nan2safe_jax.replay.search import Found, Session, first_flagged, flatten, search
from nan2safe_jax.site import LIBRARY_DIRS, site_from_name_stack

__all__ = ["locate", "locate_replayed", "locate_step"]

_CODE_NAMES = {0: "finite", 1: "inf", 2: "nan"}


def _kind_of(outvals: Sequence[Any]) -> tuple[str | None, int | None]:
    """("nan" | "inf" | None, index of the first non-finite output)."""
    first, kind = None, None
    for i, o in enumerate(outvals):
        a = np.asarray(o)
        if not interpret.inexact(a):
            continue
        a = a.astype(np.float64) if a.dtype.kind != "c" else a
        if np.isnan(a).any():
            return "nan", i
        if first is None and not np.isfinite(a).all():
            first, kind = i, "inf"
    return kind, first


def user_frames(frames: Sequence[tuple[str, int]]) -> tuple[tuple[str, int], ...]:
    """The frames outside JAX, Flax, optax and nan2safe_jax, innermost first: the user's."""
    return tuple(f for f in frames if not f[0].startswith(LIBRARY_DIRS))


def user_source(frames: Sequence[tuple[str, int]]) -> str | None:
    """``"file.py:LINE"`` of the innermost frame outside JAX, Flax, optax and nan2safe_jax: for
    an equation of a ``nan2safe.nn`` site, the model code that called the site."""
    mine = user_frames(frames)
    return f"{mine[0][0]}:{mine[0][1]}" if mine else None


def _ref(found: Found) -> EqnRef:
    ns = str(found.item.name_stack)
    return EqnRef(
        primitive=found.item.eqn.primitive.name,
        source=found.item.source,
        name_stack=ns,
        site=site_from_name_stack(ns),
        direction=direction_of(ns),
        eqn_path=found.path,
        user_source=user_source(found.item.frames),
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
      An equation that turns NaN-free inputs into NaN (e.g. ``-inf - -inf`` after a ``-inf``
      mask on a fully masked row) is reported when it comes before every equation that turns
      finite inputs into a non-finite value.

    Raises:
      ValueError: if ``args`` does not have one leaf per input of ``jaxpr``.
    """
    return _run(jaxpr, args)[0]


def _leaves(jaxpr: Any, args: Any) -> list:
    top_jaxpr, _ = jc.open_jaxpr(jaxpr)
    leaves_with_path, _ = jax.tree_util.tree_flatten_with_path(args)
    if len(leaves_with_path) != len(top_jaxpr.invars):
        raise ValueError(
            f"locate: args has {len(leaves_with_path)} leaves but the jaxpr has "
            f"{len(top_jaxpr.invars)} inputs; pass the tuple of the traced function's positional "
            "arguments, e.g. locate(jax.make_jaxpr(f)(*args), args)"
        )
    return leaves_with_path


def _run(
    jaxpr: Any,
    args: Any,
    expected: np.ndarray | None = None,
    stats: bool = False,
    prefix: bool = True,
) -> tuple[Report | None, Session]:
    """``locate``; with ``expected`` (the production outputs' codes) also the fidelity check.

    ``prefix=False``: the reference search: never decide from the forward prefix
    (``prefix.py``), and give every level its own flags replay (``Session.seed``)."""
    t0 = time.perf_counter()
    leaves_with_path = _leaves(jaxpr, args)
    sess = Session(jaxpr, stats=stats, prefix=prefix, bodies=prefix)
    return _locate(sess, jaxpr, leaves_with_path, t0, expected), sess


def _run_full(jaxpr: Any, args: Any, expected: np.ndarray | None = None):
    """``_run`` with the whole step's flags replay and every level's own (the reference
    ``prefix.py`` and ``Session.seed`` are checked against)."""
    return _run(jaxpr, args, expected, prefix=False)


def _polluted(sess: Session, leaves_with_path: list, i: int, t0: float) -> Report:
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


def _not_reproducible(why: str, sess: Session, t0: float) -> Report:
    """The report of a replay that does not reproduce the production step (``why``)."""
    return Report.no_equation(
        kind=None,
        inputs=[],
        channels={},
        diagnosis=NOT_REPRODUCIBLE,
        explanation=why,
        reason=why,
        replays=sess.replays,
        seconds=time.perf_counter() - t0,
        reproducible=False,
    )


def _mismatch(
    expected: np.ndarray, got: np.ndarray, index: np.ndarray | None = None, failed: bool = False
) -> str | None:
    """Why the replay's output codes differ from the production step's, or None if they agree.

    ``index``: the outputs ``expected`` and ``got`` stand for (all of them when None).
    ``failed``: production had a non-finite output (among all of them). Then an output only the
    replay makes non-finite is no mismatch: XLA's fused step may drop a NaN that the replay's
    separately compiled pieces keep (a ``max`` or a pooling window that skips it, a ``0 * x``
    folded away), so the replay sees the fault's first value where production's own outputs
    lost it. Every output production made non-finite must come out alike."""
    expected, got = np.asarray(expected), np.asarray(got)
    differ = expected != got
    if failed:
        differ &= expected != 0
    bad = np.nonzero(differ)[0]
    if not len(bad):
        return None
    i = int(bad[0]) if index is None else int(np.asarray(index)[bad[0]])
    bad_i = int(bad[0])
    return (
        f"the replay does not reproduce the production step: output {i} is "
        f"{_CODE_NAMES[int(got[bad_i])]} in the replay but {_CODE_NAMES[int(expected[bad_i])]} in "
        f"production ({len(bad)} of {len(expected)} outputs differ)"
    )


def _only_in_replay(expected: np.ndarray, got: np.ndarray, index=None) -> str | None:
    """The explanation's note for outputs the replay made non-finite and production did not."""
    extra = np.nonzero((np.asarray(expected) == 0) & (np.asarray(got) != 0))[0]
    if not len(extra):
        return None
    outs = [int(i) if index is None else int(np.asarray(index)[i]) for i in extra]
    return (
        f"; production's compiled step kept output(s) {outs[:8]} finite, which the replay did "
        "not (XLA's fused program dropped a non-finite value, e.g. a max or pooling window that "
        "skips NaN): the fault is the same, production lost its trace"
    )


def _locate(
    sess: Session,
    jaxpr: Any,
    leaves_with_path: list,
    t0: float,
    expected: np.ndarray | None = None,
) -> Report | None:
    top_jaxpr, consts = jc.open_jaxpr(jaxpr)
    leaves = [leaf for _, leaf in leaves_with_path]
    ns = jc.empty_name_stack()
    fl = sess.top_flags(top_jaxpr, list(consts), leaves, ns)

    if fl.in_codes is not None and fl.in_codes.any():
        return _polluted(sess, leaves_with_path, int(np.nonzero(fl.in_codes)[0][0]), t0)
    why = note = None
    failed = expected is not None and bool(np.asarray(expected).any())
    if expected is not None and fl.out_codes is not None:
        why = _mismatch(expected, fl.out_codes, failed=failed)
        note = _only_in_replay(expected, fl.out_codes)
    elif expected is not None and fl.prefix_outs is not None:  # the outputs the prefix computed
        idx, got = fl.prefix_outs
        why = _mismatch(np.asarray(expected)[idx], got, idx, failed=failed)
        note = _only_in_replay(np.asarray(expected)[idx], got, idx)
    if why is not None:
        return _not_reproducible(why, sess, t0)
    strict = None
    if note is not None:  # an output only the replay made non-finite: told apart below
        got = fl.out_codes if fl.out_codes is not None else fl.prefix_outs[1]
        idx = None if fl.out_codes is not None else fl.prefix_outs[0]
        wanted = np.asarray(expected) if idx is None else np.asarray(expected)[idx]
        strict = _mismatch(wanted, got, idx)

    first = first_flagged(fl)
    if first is not None:
        mode = first[1]
    elif fl.literal.any() and fl.out_codes is not None and fl.out_codes.any():
        mode = "literal"  # non-finite outputs that no equation made: a literal carried them in
    else:
        return None
    if mode == "root" and fl.nan.any():  # one replay captures both top-level culprits
        kr, kn = int(np.argmax(fl.root)), int(np.argmax(fl.nan))
        if kr != kn and kr not in fl.steps and kn not in fl.steps:  # (a loop: capture_into)
            sess.capture("top", top_jaxpr, list(consts), leaves, ns, [kr, kn])
    found = search(sess, "top", top_jaxpr, list(consts), leaves, ns, (), mode, top=True)
    if found is None:  # pragma: no cover - flags and capture replays disagreed
        return None
    kind, oi = _kind_of(found.outvals)
    first_nan = None
    if kind == "inf" and fl.nan.any():
        nf = search(sess, "top", top_jaxpr, list(consts), leaves, ns, (), "nan", top=True)
        first_nan = _ref(nf) if nf is not None else None
    ref = _ref(found)
    if strict is not None and not reach.reaches(
        top_jaxpr, ref.eqn_path, np.nonzero(np.asarray(expected))[0]
    ):
        # The value the replay names reaches no output production saw non-finite: it did not
        # make production's failure (a flaky kernel, a callback that differs on the replay).
        return _not_reproducible(strict, sess, t0)
    closed = {id(v) for v in top_jaxpr.constvars}  # the closed-over constants count as literals
    literal = [jc.is_literal(a) or id(a) in closed for a in found.item.eqn.invars]
    in_stats = [array_stats(v, lit) for v, lit in zip(found.invals, literal, strict=True)]
    out = found.outvals[oi] if oi is not None else found.outvals[0]
    mode = found.mode
    kind = kind or ("nan" if mode == "nan" else "inf")
    chans, cut = channel_scan(out, nan_only=mode == "nan")
    diagnosis, why = diagnose(ref.primitive, found.invals, out, kind, in_stats)
    if mode == "nan":
        why += (
            "; its inputs already held +-inf from a non-finite constant or literal "
            "(e.g. a -inf mask fill on a fully masked row), so no equation made the inf"
        )
    if mode == "literal" or found.constant:
        diagnosis = "constant"
        what = "returns" if found.constant else "combines finite inputs with"
        why = (
            f"{ref.primitive} {what} a non-finite literal or constant written in the program "
            f"({sum(s.get('nonfinite', 0) for s in in_stats if s.get('literal'))} non-finite "
            "literal element(s) among its operands); no equation made it from finite values, so "
            "it is deterministic, not hardware"
        )
    elif jc.has_sub_jaxpr(found.item.eqn) and ref.primitive not in rules.COMBINER:
        # an opaque higher-order primitive was blamed
        diagnosis = "other"
        why = opaque_why(ref.primitive, out, kind, in_stats)
    near = None
    if mode == "root" and not found.constant:
        near = _magnitude(sess, leaves_with_path, found)
        if near is not None:
            why += f"; {magnitude_sentence(near)}"
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
        explanation=why + (note or ""),
        replays=sess.replays,
        seconds=time.perf_counter() - t0,
        output_shape=tuple(np.shape(out)),
        user_source=ref.user_source,
        shard=None if found.shard is None else found.shard.index,
        device=None if found.shard is None else found.shard.device(),
        magnitude=near,
    )


def _magnitude(sess: Session, leaves_with_path: list, found: Found) -> dict[str, Any] | None:
    """``Report.magnitude`` of a culprit whose input was ``NEAR`` overflow, walked back within
    the level it was found in (``replay.magnitude``); None otherwise (one replay more only when
    an input is near). Inside a ``shard_map`` body (values per shard) it is not walked back.
    """
    if found.where is None or not magnitude.worth_walking(found.invals):
        return None
    level, jaxpr, consts, args, ns, frames, base, k = found.where
    top = level == "top"
    items = flatten(jaxpr, ns, (), frames)
    org = magnitude.origin(sess, level, jaxpr, list(consts), list(args), ns, k, top, items)
    if org is None:
        return None
    out: dict[str, Any] = {
        "fraction": magnitude.near_input(found.invals),
        "max_abs": org.max_abs,
        "origin_fraction": org.fraction,
        "inputs_max_abs": org.inputs_max_abs,
        "steps": org.steps,
        "origin": None,
        "argument": None,
    }

    def name(i: int) -> tuple[str, int | list[int] | None]:
        """The ``keystr`` of the level's argument ``i`` (and the layer of a stacked one)."""
        if top:
            return jax.tree_util.keystr(leaves_with_path[i][0]), None
        stacked = _stacked_argument(leaves_with_path, args[i], base)
        if stacked is not None:
            return stacked
        # an input of a loop body, a branch: the level's, not the program's
        return f"input {i} of the body at {path_str(base)}", None

    if org.record is not None:
        it = items[org.record]
        out["origin"] = _ref(Found(it, (*base, *it.path), [], [])).to_dict()
        if org.input_argument is not None:
            out["origin_input"] = name(org.input_argument)[0]
    elif org.argument is not None:
        out["argument"], layer = name(org.argument)
        if layer is not None:
            out["layer"] = layer
    return out


def _floating(dtype) -> bool:
    return bool(jnp.issubdtype(dtype, jnp.floating))


# A keystr of the state's parameters: ``[0].params[...]`` (a ``TrainState``) or
# ``[0]['params'][...]`` (a dict), whole or a leaf under it.
_PARAMS = re.compile(r"^\[\d+\](\.params|\['params'\])(\[|\.|$)")


@jax.jit
def _equal(part: jax.Array, value: jax.Array) -> jax.Array:
    return jnp.array_equal(part.astype(value.dtype), value)


def _stacked_argument(
    leaves_with_path: list, value: Any, base: tuple
) -> tuple[str, int | list[int] | None] | None:
    """``(keystr, layer)`` of the one argument of the program that ``value``, an input of a
    loop body's iteration (``base`` holds its ``("iter", t)``, outermost loop first), is:

    - its slice by the loops that slice it (``layer`` the iteration of each, outermost first,
      an int for one): a layer's weight of a scanned stack, sliced by the scan over layers
      (inside a scan over microbatches, or around a scan over time, which do not slice it);
      ``[t1, t2]`` for a scan of scanned blocks;
    - the whole argument (``layer`` None): a weight every iteration reads, closed over by the
      body or passed to the scan whole.

    Equal values, compared on the device in ``value``'s dtype (a floating stack cast before
    the loop, f32 parameters cast to bfloat16 once per step, is still its argument). A leaf
    that matches under two choices of loops, or two leaves, are ambiguous; among several
    leaves the one of the state's parameters (``[0].params``) is taken when it is the only
    one. None when no argument or more than one is (helper-80: nested scans, a whole weight, a
    cast before the scan and two equal leaves all named the body's input, so a huge stacked
    weight was never rolled back).
    """
    iters = tuple(int(e[1]) for e in base if isinstance(e, tuple) and e[0] == "iter")
    if not iters:
        return None
    v = jnp.asarray(value)
    hits: list[tuple[str, int | list[int] | None]] = []
    for path, leaf in leaves_with_path:
        shape, dtype = tuple(np.shape(leaf)), getattr(leaf, "dtype", None)
        if dtype is None or not (dtype == v.dtype or (_floating(dtype) and _floating(v.dtype))):
            continue
        n = len(shape) - v.ndim  # the leading axes some of the loops slice
        if not 0 <= n <= len(iters) or shape[n:] != v.shape:
            continue
        mine = []
        for loops in itertools.combinations(iters, n):
            if all(t < d for t, d in zip(loops, shape, strict=False)):
                layer = None if not n else (loops[0] if n == 1 else list(loops))
                if layer not in mine and bool(_equal(jnp.asarray(leaf)[loops], v)):
                    mine.append(layer)
        key = jax.tree_util.keystr(path)
        hits += [(key, layer) for layer in mine]
    if len(hits) > 1:
        hits = [h for h in hits if _PARAMS.match(h[0])]
    return hits[0] if len(hits) == 1 else None


@jax.jit
def _out_codes(leaves: list) -> Any:
    codes = [
        interpret.value_code(x) if interpret.inexact(x) else jnp.zeros((), jnp.int8) for x in leaves
    ]
    return jnp.stack(codes) if codes else jnp.zeros((0,), jnp.int8)


def _production_codes(
    step_fn: Any, jaxpr: Any, args: tuple, compiled: Sequence[Any] = ()
) -> np.ndarray:
    """Codes of the production step's outputs on ``args`` (one call of ``step_fn``, or of the
    first of its ``compiled`` executables that takes ``args``; arguments it donates are copied
    first so the replays can still read them)."""
    donated = ()
    top, _ = jc.open_jaxpr(jaxpr)
    if len(top.eqns) == 1:
        donated = top.eqns[0].params.get("donated_invars", ())
    if any(donated):
        leaves, treedef = jax.tree_util.tree_flatten(args)
        leaves = [jnp.copy(x) if d else x for x, d in zip(leaves, donated, strict=False)]
        args = jax.tree_util.tree_unflatten(treedef, leaves)
    for exe in compiled:
        try:
            outs = jax.tree_util.tree_leaves(exe(*args))
            break
        except (TypeError, ValueError):  # built for other shapes or shardings
            continue
    else:
        outs = jax.tree_util.tree_leaves(step_fn(*args))
    return np.asarray(_out_codes(outs))


def locate_step(step_fn: Any, *args: Any, check: bool = True) -> Report:
    """Traces ``step_fn(*args)`` and locates its first non-finite value.

    A jitted ``step_fn`` traces to a single ``jit`` equation, which is entered. Replays are
    compiled with the production options (plain ``jax.jit``), and with ``check`` the step itself
    is run once more and the replay must reproduce which of its outputs are finite, inf or NaN.

    Args:
      step_fn: the (jitted) step; a ``make_train_step`` step replays the programs
        ``programs.replay_programs`` gives for ``args[0]``: the FAST-only one for an all-FAST
        state; else the step traced with the state's gears as constants, then, if that does
        not reproduce the failure, the general one.
      *args: its arguments.
      check: run the fidelity check (one extra call of the program).

    Returns:
      The ``Report`` of ``locate``. When the replay's outputs differ from production's, a report
      with ``reproducible=False``, ``primitive=None`` and the difference in ``reason``; when the
      replay produces no non-finite value at all, ``reproducible=False`` with diagnosis
      ``"not reproducible: suspect hardware or non-determinism"`` (unlike ``locate``, which
      returns None for a clean function: ``locate_step`` is called because a step *was* seen to
      fail).
    """
    return locate_replayed(step_fn, *args, check=check)[0]


def locate_replayed(step_fn: Any, *args: Any, check: bool = True) -> tuple[Report, Any]:
    """``locate_step``, and the program its report indexes (``Report.eqn_path``; what
    ``replay.nearest_site`` must trace): the last one replayed.

    The fidelity check compares every replay with the outputs of the general program out of
    FAST (what ran the step, or, once a partial program ran it, what computes the same), so a
    known-gear replay that differs from it (XLA compiled the fault away, or into another
    output) gives way to the general program's. ``Report.seconds`` is the whole call's time.
    A step built with ``jit=False`` has no known-gear program: its general one is replayed."""
    t0 = time.perf_counter()
    candidates = programs.replay_programs(step_fn, args[0]) if args else [step_fn]
    # The last program is the one that ran the step (or, for a partial program's step, computes
    # what it computed): its outputs are what every replay must reproduce. Its executable from
    # the background compile, when that ran the step, is run again rather than compiled anew.
    production = candidates[-1]
    traced = jax.make_jaxpr(production)(*args) if check else None
    compiled = programs.compiled_programs(step_fn, production) if check else []
    expected = _production_codes(production, traced, args, compiled) if check else None
    jaxprs = {id(production): traced} if check else {}  # each program traced once
    report, program, replays = _through(candidates, jaxprs, args, expected, t0)
    if not report.reproducible and cache.quick():
        # compiled as production is, in case LLVM's optimisation decided the difference
        with cache.production_options():
            report, program, more = _through(candidates, jaxprs, args, expected, t0)
        replays += more
    # Every replay, and the whole time (the trace and the production run included).
    report = dataclasses.replace(report, replays=replays, seconds=time.perf_counter() - t0)
    return report, program


def _through(candidates, jaxprs: dict, args, expected, t0) -> tuple[Report, Any, int]:
    """``locate_replayed``'s pass over the candidate programs: ``(report, the program it
    indexes, replays)``; the first reproducible report, else the last program's. ``jaxprs``:
    each program's trace by ``id``, filled as they are traced."""
    replays = 0
    for k, program in enumerate(candidates):
        jaxpr = jaxprs.get(id(program))
        if jaxpr is None:
            jaxpr = jaxprs[id(program)] = jax.make_jaxpr(program)(*args)
        report, sess = _run(jaxpr, args, expected)
        replays += sess.replays
        if report is not None and (report.reproducible or k == len(candidates) - 1):
            return report, program, replays
    why = "a replay of the step from the same inputs produced only finite values"
    return _not_reproducible(why, sess, t0), program, replays
