"""Where a finite value near the top of its range was made: the culprit's input, walked back.

``locate`` names the first equation whose output is non-finite. When that equation's input was
already close to overflowing (a LayerNorm's input at 84% of bfloat16's range, newuser48), the
equation that overflowed is not where the fault is: any arithmetic on that value would have.
This module walks the value back through the equations that made it, each step to the producer
of its largest input relative to that input's range, and stops at the first equation whose
inputs are all far from their range (the *origin*: an ``exp``, a matmul by a weight that is not
large), or at an argument of the program (a parameter made huge by a bad update).

How: one replay of the level's prefix up to the culprit in ``"flags"`` mode
(``interpret.py``), returning ``max |x|`` of every float value the walk can reach from the
culprit's inputs (its backward slice: the rest of the prefix is not computed), O(#values)
scalars over the step's own live set. Values an equation passes through unchanged (a
reshape, a copy) share their input's entry, so the walk moves over them. A loop instrumented
in place is not entered: a large value that comes out of a loop names the loop.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from nan2safe_jax.replay import interpret
from nan2safe_jax.replay.search import structure

__all__ = [
    "ARGUMENT_NEAR", "NEAR", "Origin", "is_huge", "max_abs", "near_input", "origin", "worth_walking"
]  # fmt: skip

# A value at or above this fraction of its dtype's largest finite value is *near* overflow:
# within a factor 100 of it, where a square, a sum of a few hundred terms or an ``exp`` of it
# overflows. Ordinary activations are far below (fp16 attention logits of 30: 0.05%).
NEAR = 1e-2
# An argument of the program (a weight) at this fraction of a range as wide as f32's (bf16,
# f32: past ~3e34) is past any value training makes: a walk that reaches it names it, not the
# equation that read it (newuser49: a kernel x5e36, 0.6% of bf16's range, was named as its
# matmul, SAFE there did not help, and the rollback came two incidents later). In a narrow
# range (fp16: 6.5) it is an ordinary weight. Values the program makes are walked only from
# ``NEAR``: gradients past 3e34 made from a weight x1e15 are the loss scale's and the hint's
# business (the step's own sum of squares, ``incidents.in_step_bookkeeping``).
ARGUMENT_NEAR = 1e-4
_WIDE = 1e30


# Equations that move or cast a value without computing on it: an argument read through them
# is still that argument.
_MOVES = frozenset(
    {
        "convert_element_type", "reshape", "transpose", "broadcast_in_dim", "squeeze",
        "expand_dims", "slice", "dynamic_slice", "copy", "copy_p", "reduce_precision",
    }
)  # fmt: skip


def is_huge(mag: float, top: float, argument: bool = False) -> bool:
    """Whether ``mag`` is near overflow in a range whose largest finite value is ``top``:
    ``NEAR`` of it, or, for an ``argument``, ``ARGUMENT_NEAR`` of a range as wide as f32's."""
    frac = mag / top
    return frac >= NEAR or (argument and top > _WIDE and frac >= ARGUMENT_NEAR)


@dataclasses.dataclass(frozen=True)
class Origin:
    """Where the near-overflow input of the culprit came from.

    Attributes:
      record: the flat index (in the level's walk) of the equation that made it, or None when
        no equation of the walk did: an argument, a constant, a result of a loop (whose body
        the walk does not enter).
      argument: the index of the program's argument it is, or None.
      max_abs: ``max |x|`` of the value the origin made (or the argument's).
      fraction: ``max_abs`` over the largest finite value of the dtype the equation after it
        on the walk reads it in.
      inputs_max_abs: ``max |x|`` of the origin equation's float input nearest its range (how
        far from the range it started), None for an argument.
      steps: equations walked back from the culprit (those passing the value through unchanged
        not counted).
      input_argument: for an origin equation, the program's argument its largest input is
        (a learned scale an ``exp`` reads), or None.
    """

    record: int | None
    argument: int | None
    max_abs: float
    fraction: float
    inputs_max_abs: float | None
    steps: int
    input_argument: int | None = None


def _limit(dtype: Any) -> float:
    """``dtype``'s largest finite value (inf for a dtype without one: nothing is near it)."""
    if not jnp.issubdtype(dtype, jnp.floating):
        return float("inf")
    return float(jnp.finfo(dtype).max)


def _range_of(eqn: Any) -> float:
    """The largest finite value of the dtype equation ``eqn`` reads its inputs in: its widest
    float operand's (an f16 value read by f32 arithmetic is far from that range), and for a
    cast, the dtype it casts to (an f32 weight cast to f16 must fit f16's)."""
    outs = [v.aval.dtype for v in eqn.outvars if hasattr(v.aval, "dtype")]
    if eqn.primitive.name == "convert_element_type" and outs:
        return _limit(outs[0])
    ins = [v.aval.dtype for v in eqn.invars if hasattr(getattr(v, "aval", None), "dtype")]
    limits = [_limit(d) for d in ins if jnp.issubdtype(d, jnp.floating)]
    return max(limits) if limits else float("inf")


def _input_maxima(invals: list) -> list[tuple[float, float]]:
    """``(max |x|, finfo.max)`` of each finite float input of an equation (host values, in the
    dtypes the equation reads them in), values at exactly ``±finfo.max`` left out (a mask's
    ``finfo.min`` fill, as flax's attention writes it, is no near-overflow value)."""
    out = []
    for x in invals:
        a = np.asarray(x)
        if not interpret.inexact(a) or a.size == 0 or a.dtype.kind == "c":
            continue
        top = _limit(a.dtype)
        mags = np.abs(a.astype(np.float64))
        mags = mags[np.isfinite(mags) & (mags < top)]
        if mags.size:
            out.append((float(mags.max()), top))
    return out


def near_input(invals: list) -> float:
    """The largest ``max |x| / finfo.max`` over an equation's inputs (``_input_maxima``)."""
    return max((m / top for m, top in _input_maxima(invals)), default=0.0)


def worth_walking(invals: list) -> bool:
    """Whether an equation's inputs (``_input_maxima``) hold one that may be ``is_huge`` (at an
    argument's threshold: the walk tells arguments apart): ``origin`` walks back only then."""
    return any(is_huge(m, top, argument=True) for m, top in _input_maxima(invals))


def max_abs(x: Any) -> Any:
    """``max |x|`` in f32, the values at exactly ``±finfo.max`` (fills) and non-finite ones
    left out (see ``near_input``)."""
    if jnp.iscomplexobj(x):
        x = jnp.abs(x)
    if np.size(x) == 0:
        return jnp.zeros((), jnp.float32)
    a = jnp.abs(x)
    keep = a < jnp.finfo(a.dtype).max  # also drops inf; a NaN compares False
    return jnp.max(jnp.where(keep, a, jnp.zeros((), a.dtype))).astype(jnp.float32)


def _trace(
    jaxpr: Any, consts: list, args: list, ns: Any, known: dict, stop: int, meta: dict, top: bool
):
    """The replay: the level walked up to and including flat equation ``stop - 1``; fills
    ``meta`` (its records, value dtypes, argument references) while it traces."""

    def fn(consts, args):
        ctx = interpret.Ctx("flags", known=known, stop_at=stop)
        arg_refs = [ctx.ref(a) for a in args]  # registered first, as the flags replay does
        if top:  # the program's closed-over constants (a body's constants are its operands)
            ctx.mark_constants(consts)
        try:
            interpret.walk(jaxpr, consts, args, ctx, ns)
        except interpret.Stop:
            pass
        # (a loop instrumented in place holds its traced flags where a record holds inputs)
        recs = [(r[0], None if r[0] == "given" else r[1], r[2]) for r in ctx.recs]
        meta["recs"] = recs
        meta["args"] = [r[1] for r in arg_refs]
        if not ctx.vals:
            return jnp.zeros((0,), jnp.float32)
        # Only the values the walk can reach (``_cone``) are reduced; the rest of the level,
        # whose results nothing returns, is left for XLA to drop.
        cone = _cone(recs, stop - 1)
        zero = jnp.zeros((), jnp.float32)
        return jnp.stack([max_abs(v) if i in cone else zero for i, v in enumerate(ctx.vals)])

    return fn


def _producers(recs: list, culprit: int) -> dict[int, int]:
    """``{value index: record that made it}`` over the records before ``culprit`` (a value an
    equation passes through unchanged shares its input's index: its maker is the input's)."""
    producer: dict[int, int] = {}
    for k, (kind, in_ref, out_ref) in enumerate(recs[:culprit]):
        if kind == "given" or out_ref is None:
            continue
        for v in out_ref[1] - (in_ref[1] if in_ref is not None else frozenset()):
            producer.setdefault(v, k)
    return producer


def _cone(recs: list, culprit: int) -> set[int]:
    """The value indices ``origin``'s walk can read: the culprit's inputs and, transitively,
    the inputs of the records that made them (a backward slice of the level)."""
    if culprit >= len(recs) or recs[culprit][1] is None:
        return set()
    producer = _producers(recs, culprit)
    cone: set[int] = set()
    todo = list(recs[culprit][1][1])
    while todo:
        v = todo.pop()
        if v in cone:
            continue
        cone.add(v)
        k = producer.get(v)
        if k is not None and recs[k][1] is not None:
            todo.extend(recs[k][1][1])
    return cone


def origin(
    sess: Any,
    level: Any,
    jaxpr: Any,
    consts: list,
    args: list,
    ns: Any,
    culprit: int,
    top: bool,
    items: list,
) -> Origin | None:
    """Walks the culprit's largest near-overflow input back to where it was made, within the
    level the culprit is in (the step's top level, a loop iteration's body, a taken branch).

    Args:
      sess: the localization's ``search.Session`` (its replays are counted and cached).
      level, jaxpr, consts, args, ns: the level, as ``search.search`` was given it.
      culprit: the culprit's flat index in that level.
      top: the level is the program's top level.
      items: the level's flat equations (``search.flatten``), one per record of the walk.

    Returns:
      The ``Origin``, or None when no input of the culprit is huge (``is_huge``: it made the
      non-finite value from ordinary inputs) or the culprit is not in the walk's records.
    """
    known = sess.known(level, jaxpr, consts, args, ns)
    meta: dict = {}
    fn = _trace(jaxpr, consts, args, ns, known, culprit + 1, meta, top)
    mags = np.asarray(
        sess.call(
            ("magnitude", structure(level), culprit, tuple(sorted(known.items()))),
            fn,
            list(consts),
            list(args),
        ),
        np.float64,
    )
    if "recs" not in meta:  # a compiled replay from an earlier localization: trace it again
        jax.eval_shape(fn, list(consts), list(args))
    recs = meta["recs"]
    if culprit >= len(recs) or recs[culprit][0] == "given" or recs[culprit][1] is None:
        return None
    if len(recs) > len(items):  # pragma: no cover - the walk and ``flatten`` disagree
        return None
    producer = _producers(recs, culprit)

    def largest(k: int) -> tuple[int | None, float]:
        """The input of record ``k`` nearest the range ``k`` reads it in, and that range's
        largest finite value."""
        ref, top = recs[k][1], _range_of(items[k].eqn)
        vs = sorted(ref[1]) if ref is not None else []
        return (max(vs, key=lambda v: mags[v]) if vs else None), top

    def argument_of(v: int) -> int | None:
        return next((i for i, r in enumerate(meta["args"]) if v in r), None)

    def source_argument(v: int) -> int | None:
        """The argument ``v`` is, through casts and moves of it (an f32 weight cast to a bf16
        layer's dtype, sliced, transposed), or None."""
        for _ in range(len(recs)):
            k = producer.get(v)
            if k is None:
                return argument_of(v)
            if items[k].eqn.primitive.name not in _MOVES:
                return None
            v = largest(k)[0]
            if v is None:
                return None
        return None

    v, top = largest(culprit)
    if v is None:
        return None
    if not is_huge(float(mags[v]), top):  # the culprit made it, unless it read a huge argument
        arg = source_argument(v)
        if arg is None or not is_huge(float(mags[v]), top, argument=True):
            return None
        return Origin(None, arg, float(mags[v]), float(mags[v]) / top, None, 0)
    steps = 0
    while True:
        k = producer.get(v)
        if k is None:  # an argument, or a value the walk saw no equation make
            return Origin(None, argument_of(v), float(mags[v]), float(mags[v]) / top, None, steps)
        steps += 1
        u, top_u = largest(k)
        arg = None if u is None else source_argument(u)
        if u is not None and arg is not None and is_huge(float(mags[u]), top_u, argument=True):
            return Origin(None, arg, float(mags[u]), float(mags[u]) / top_u, None, steps)
        if u is None or not is_huge(float(mags[u]), top_u):
            inputs = 0.0 if u is None else float(mags[u])
            frac = float(mags[v]) / top
            return Origin(k, None, float(mags[v]), frac, inputs, steps, input_argument=arg)
        v, top = u, top_u
