"""The replay interpreter: evaluates a jaxpr equation by equation, itself traced under ``jax.jit``.

One walk runs in one of three modes (``Ctx.mode``):

* ``"plain"``: each equation is bound as it is, higher-order ones included (their original
  parameters, so a loop stays the production loop).
* ``"flags"``: every float value gets a *code* (0 finite, 1 has +-inf but no NaN, 2 has NaN),
  reduced right where the value is produced (one integer max-reduction that XLA fuses into the
  producer). A walk returns two bools per equation ("non-finite output from finite inputs",
  "NaN output from NaN-free inputs"): O(#equations) outputs over the step's own live set, never
  an array proportional to the sum of the intermediates. Loops (``scan``, ``while``) are
  instrumented in place by their rule (``rules.py``), which also returns the first flagged step
  (a NaN made in a while condition only steers the loop: no result shows it). Other higher-order
  equations (branches, maps) are flagged from their operands and results like a primitive; their
  body is instrumented only when the search enters it.
* ``"capture"``: the walk stops once the target equations have run and returns their inputs and
  outputs.

Call-like equations (``jit``, ``remat``, ``custom_jvp_call`` ...) are inlined, so the *flat*
equations of a walk are its primitives and its loop / branch / map equations, counted in order.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from nan2safe_jax.probe import MONITOR_SCOPE
from nan2safe_jax.replay import _jax_compat as jc
from nan2safe_jax.replay import rules

__all__ = ["MODES", "Ctx", "Stop", "first_step", "no_step", "preserves", "value_code", "walk"]


class Stop(Exception):  # noqa: N818 - control flow, not an error
    """Raised by a capture walk once every target has been captured, and by a flags walk at its
    ``stop_at`` (the rest is not traced)."""

    def __init__(self, payload: dict[int, Any]):
        super().__init__()
        self.payload = payload


def inexact(x: Any) -> bool:
    """Whether ``x`` has a float or complex dtype (the only values that can be non-finite)."""
    try:
        return bool(jax.dtypes.issubdtype(jnp.result_type(x), jnp.inexact))
    except (TypeError, ValueError):
        return False


def _is_static(x: Any) -> bool:
    return isinstance(x, (int, float, complex, np.ndarray, np.generic))


def value_code(x: Any) -> Any:
    """int8 scalar: 0 if ``x`` is finite, 1 if it holds +-inf but no NaN, 2 if it holds a NaN.

    One integer max-reduction, which XLA fuses into the producer of ``x``. (A float ``max |x|``
    would be one op less, but XLA:CPU's vectorized float max-reduction drops NaNs on large
    arrays, jax 0.10.2.)
    """
    if np.size(x) == 0:
        return jnp.zeros((), jnp.int8)
    return jnp.max(jnp.where(jnp.isnan(x), jnp.int8(2), jnp.isinf(x).astype(jnp.int8)))


def static_code(x: Any) -> int:
    """The code of a literal or host constant."""
    a = np.asarray(x)
    if not inexact(a):
        return 0
    return 2 if np.isnan(a).any() else int(not np.isfinite(a).all())


Ref = tuple  # (static code, frozenset of indices into Ctx.vals): a value's code is their max


class Ctx:
    """State of one walk (see the module docstring for the modes).

    In ``"flags"`` mode each traced float value is registered once in ``vals`` (codes computed by
    ``codes()``); outputs of value-preserving equations reuse their inputs' references instead.
    ``recs`` holds per flat equation ``("eqn", in_ref, out_ref)`` (``"mask"`` for an equation that
    can drop an operand: ``select_n``, ``cond``, or absorb an infinite one into a finite float
    result: ``exp``, ``tanh``, ``max`` ... (``_ABSORBING``); a ``cond`` whose branch is known adds
    a fourth item, the reference of the operands that branch drops), or ``("given", bool[3])``
    for a loop instrumented in place (its rule computed its flags; its first flagged steps are in
    ``steps``).
    """

    def __init__(
        self,
        mode: str,
        targets: dict[int, Any] | None = None,
        known: dict[int, int] | None = None,
        stop_at: int | None = None,
        watch: dict[int, tuple[int, ...]] | None = None,
        runtime_branches: bool = False,
    ):
        self.mode = mode
        # a ``cond`` of unknown index drops what its taken branch does not read, decided at run
        # time (a loop body's walk: the gear switches of a scanned stack); else it reads all
        self.runtime_branches = runtime_branches
        self.stop_at = stop_at  # flags: stop (``Stop``) before this flat equation (a prefix)
        self.watch = watch or {}  # flat index -> output positions whose values to keep
        self.watched: dict[int, list] = {}
        # capture: flat index -> None (capture its inputs and outputs), or a function of its
        # inputs whose result is captured instead of binding the equation
        self.targets = targets or {}
        self.known = known or {}  # flat index of a cond -> its branch index (``branches.py``)
        self.payloads: dict[int, Any] = {}
        self.count = 0
        self.vals: list[Any] = []
        self.recs: list[tuple] = []
        self.steps: dict[int, Any] = {}  # flat index of an eagerly instrumented loop -> int32[3]
        # flat index of a scan with a plain body -> (first flagged iteration, its body's flags)
        self.bodies: dict[int, Any] = {}
        self._memo: dict[int, tuple[Any, Ref]] = {}
        self._codes: Any = None
        self._flags: dict[bool, tuple[Any, Any, Any]] = {}
        self.outputs: frozenset | None = None  # value indices the walk returned
        # Per record (parallel to ``recs``): ids of every value it reads (a known branch's
        # dropped operands left out) and writes, of any dtype, for ``_needed``; the values are
        # pinned so that no id is reused while the walk runs.
        self.links: list[tuple[tuple[int, ...], ...]] = []
        self.dead: list[bool] = []  # per link: the equation's results reach nothing (``_walk``)
        # record index of a ``cond`` whose branch is known only at run time (a gear switch in a
        # loop body: the index is a slice of the stacked gear), or of a ``select_n`` with a
        # scalar predicate -> (index, used, operand ids, the index's id): ``used[b, p]``: branch
        # (case) ``b`` reads operand ``p`` (``_flags_eqn``, ``_runtime_pick``); the index is read
        # whatever is taken, even where it is an operand too (``where(p, p, q)``)
        self.dynamic: dict[int, tuple[Any, np.ndarray, tuple[int, ...], int]] = {}
        self._refs_of: dict[int, list[frozenset]] = {}  # its operands' value indices
        self._dead_now = False
        self.copy: list[bool] = []  # per link: a select_n of one value, a copy (``_copies``)
        self._copy_now = False
        self.output_ids: frozenset = frozenset()
        # Value indices of the top level's closed-over constants (``ClosedJaxpr.consts``): the
        # replay passes them as operands, yet like a literal they are no equation's result.
        self.constants: set[int] = set()
        self._pinned: list[Any] = []
        # record indices of equations traced under ``probe.MONITOR_SCOPE``: never flagged
        self.monitored: list[int] = []

    # -- codes ------------------------------------------------------------------------------
    def ref(self, x: Any) -> Ref:
        """The code reference of ``x`` (registering it for a reduction if needed)."""
        if not inexact(x):
            return (0, frozenset())
        if _is_static(x):
            return (static_code(x), frozenset())
        hit = self._memo.get(id(x))
        if hit is not None and hit[0] is x:
            return hit[1]
        r = (0, frozenset({len(self.vals)}))
        self.vals.append(x)
        self._memo[id(x)] = (x, r)
        return r

    def mark_constants(self, xs: Sequence[Any]) -> None:
        """Registers ``xs`` as the closed-over constants (see ``constants``)."""
        for x in xs:
            self.constants |= self.ref(x)[1]

    def union(self, xs: Sequence[Any]) -> Ref:
        code, idx = 0, frozenset()
        for x in xs:
            c, i = self.ref(x)
            code, idx = max(code, c), idx | i
        return code, idx

    def derive(self, x: Any, r: Ref) -> None:
        """Records that ``x``'s code is ``r`` (known from its inputs: no reduction needed)."""
        if inexact(x) and not _is_static(x):
            self._memo[id(x)] = (x, r)

    def codes(self) -> Any:
        """int8[len(vals)]: the code of every registered value, each reduced where produced."""
        if self._codes is None:
            if not self.vals:
                self._codes = jnp.zeros((0,), jnp.int8)
            else:
                self._codes = jnp.stack([value_code(v) for v in self.vals])
        return self._codes

    def code_of(self, r: Ref) -> Any:
        """The (traced) code of a reference."""
        code, idx = r
        if not idx:
            return jnp.asarray(code, jnp.int8)
        c = self.codes()[np.asarray(sorted(idx))].max()
        return jnp.maximum(c, jnp.int8(code))

    # -- per-equation records ---------------------------------------------------------------
    def record(self, in_ref: Ref | None, out_ref: Ref | None, kind: str = "eqn") -> None:
        self.recs.append((kind, in_ref, out_ref))

    def link(self, reads: Sequence[Any], writes: Sequence[Any], drops: Sequence[Any] = ()) -> None:
        """Records which values the record just appended reads, writes and drops (reads, but
        passes over: a known branch's unused operands) for ``_needed``."""
        self._pinned += [*reads, *writes, *drops]
        self.links.append((tuple(map(id, reads)), tuple(map(id, writes)), tuple(map(id, drops))))
        self.dead.append(self._dead_now)
        self.copy.append(self._copy_now)

    def finalize(self, observed_only: bool = False) -> tuple[Any, Any, Any]:
        """``(root, nan, literal)``: bool[count] flags of every flat equation of this walk.

        ``literal``: a non-finite output whose only non-finite inputs are literals or constants
        known at trace time (e.g. ``x + jnp.nan``). The per-equation maxima are O(#equations)
        gathers over the int8 codes.

        ``observed_only``: a non-finite value is live only when an equation of this walk
        observes it or it is in ``outputs`` (``_reaches``); with a walk stopped at a prefix
        (``stop_at``) and ``outputs`` the program's results the prefix computed, these are
        the flags that hold whatever the rest of the program does, while the default (nothing
        masked when the walk did not return) flags every equation the rest could leave live.
        """
        hit = self._flags.get(observed_only)
        if hit is not None:
            return hit
        m = len(self.recs)
        if m == 0:
            z = jnp.zeros((1,), bool)
            self._flags[observed_only] = (z, z, z)
            return self._flags[observed_only]
        codes = self.codes()
        in_static = np.zeros(m, np.int8)
        out_static = np.zeros(m, np.int8)
        live = np.zeros(m, bool)
        gi, si, go, so = [], [], [], []
        via: list[tuple[int, tuple[int, ...]] | None] = []  # per input edge (``edge_active``)
        for k, rec in enumerate(self.recs):
            if rec[0] == "given" or rec[2] is None:
                continue
            live[k] = True
            (ci, ii), (co, oi) = rec[1], rec[2]
            in_static[k], out_static[k] = ci, co
            gi += sorted(ii)
            si += [k] * len(ii)
            go += sorted(oi)
            so += [k] * len(oi)
            refs = self._refs_of.get(k)
            via += [
                None if refs is None else (k, tuple(p for p, r in enumerate(refs) if v in r))
                for v in sorted(ii)
            ]

        ins_v, ins_k = np.asarray(gi, np.int32), np.asarray(si, np.int32)
        outs_v, outs_k = np.asarray(go, np.int32), np.asarray(so, np.int32)
        active = self.edge_active(via)

        def gather_max(idx, seg, on=None):
            if not len(idx):
                return jnp.zeros((m,), np.int8)
            c = codes[idx] if on is None else jnp.where(on, codes[idx], jnp.int8(0))
            return jnp.maximum(jax.ops.segment_max(c, seg, m), jnp.int8(0))

        const = np.isin(ins_v, np.asarray(sorted(self.constants), np.int32))
        traced_in = gather_max(
            ins_v[~const], ins_k[~const], None if active is None else active[~const]
        )
        const_in = gather_max(ins_v[const], ins_k[const], None if active is None else active[const])
        cin = jnp.maximum(jnp.maximum(traced_in, const_in), jnp.asarray(in_static))
        traced_out = gather_max(outs_v, outs_k)
        cout = jnp.maximum(traced_out, jnp.asarray(out_static))
        edges = (ins_v, ins_k, outs_v, outs_k, active)
        reaches = self._reaches(codes, edges, traced_out > 0, observed_only)
        root = (cout > 0) & (cin == 0) & live & reaches
        nan = (cout == 2) & (cin < 2) & live & reaches
        carried = (jnp.asarray(in_static) > 0) | (const_in > 0)
        literal = (cout > 0) & (traced_in == 0) & carried & jnp.asarray(live) & reaches
        given = [(k, rec[1]) for k, rec in enumerate(self.recs) if rec[0] == "given"]
        if given:
            ks = np.asarray([k for k, _ in given])
            hit = jnp.stack([h for _, h in given])  # [n_given, 3]
            root = root.at[ks].set(hit[:, 0])
            nan = nan.at[ks].set(hit[:, 1])
            literal = literal.at[ks].set(hit[:, 2])
        if self.monitored:
            # What a probe statistic makes inside is monitoring, never the model's fault: an
            # inf it reads was made, and is flagged, outside the scope.
            quiet = np.asarray(self.monitored)
            root, nan, literal = (f.at[quiet].set(False) for f in (root, nan, literal))
        self._flags[observed_only] = (root, nan, literal)
        return self._flags[observed_only]

    def edge_active(self, via: Sequence[tuple[int, tuple[int, ...]] | None]) -> Any:
        """bool[#edges] on the device, or None when every edge is read: an input edge of a
        ``cond`` whose branch is known at run time only (``dynamic``) is read when the taken
        branch reads one of the operands that hold the value (``via``: the record and those
        operand positions)."""
        if all(v is None for v in via):
            return None
        dyn = [(e, v) for e, v in enumerate(via) if v is not None]
        got = jnp.stack([self._taken(k, positions) for _, (k, positions) in dyn])
        return jnp.ones(len(via), bool).at[np.asarray([e for e, _ in dyn])].set(got)

    def _reaches(self, codes: Any, edges: tuple, bad_out: Any, observed_only: bool = False) -> Any:
        """bool[#equations]: the equation's non-finite output is not *masked* (see below).

        A non-finite value is masked when it is read, and every equation that reads it is a
        ``select_n`` or ``cond`` (or float arithmetic that absorbs an inf: ``exp(-inf) = 0``,
        ``_ABSORBING``) whose results are finite, or whose non-finite results are
        masked themselves: it reaches none of the walk's results (``jnp.where(x > 0, jnp.log(x),
        0)``; a gear switch that passes FAST's value through only at FAST). A value that is
        returned, that nothing reads (a primal ``jax.grad`` drops), or that any other equation
        turns into a finite value (a comparison, ``isfinite``: it was *observed*) is live; an
        equation whose non-finite outputs are all masked is no root.

        A least fixed point over the walk's static value graph, on the device: each round moves
        liveness one equation back along chains of non-finite values, so the rounds follow the
        longest masked chain, each O(#edges). Without a ``select_n`` / ``cond`` nothing can be
        masked and nothing is computed.

        ``observed_only``: only the observed and the ``outputs`` values seed liveness (not the
        unread ones, which a later equation may read and mask); a lower bound of the liveness
        of any program this walk is a prefix of and whose results include ``outputs``.
        """
        m = len(self.recs)
        if not observed_only and (
            self.outputs is None or not any(r[0] == "mask" for r in self.recs)
        ):
            return jnp.ones((m,), bool)
        nv = len(self.vals)
        ins_v, ins_k, outs_v, outs_k, active = edges  # of the equations ``finalize`` flags
        kinds = [r[0] for r in self.recs]
        given = np.asarray([k == "given" for k in kinds])
        mask = np.asarray([k == "mask" for k in kinds])
        has_out = np.asarray([r[0] != "given" and r[2] is not None for r in self.recs])
        extra = [(v, k) for k in np.nonzero(given)[0] for v in sorted(self.recs[k][2][1])]
        if extra:  # a loop instrumented in place reads its operands too
            ins_v = np.concatenate([ins_v, np.asarray([v for v, _ in extra], np.int32)])
            ins_k = np.concatenate([ins_k, np.asarray([k for _, k in extra], np.int32)])
            if active is not None:
                active = jnp.concatenate([active, jnp.ones(len(extra), bool)])
        read = np.zeros(nv, bool)
        read[ins_v] = True
        dropped = sorted({v for r in self.recs if len(r) > 3 for v in r[3][1]})
        read[np.asarray(dropped, np.int64)] = True  # read by a known branch that drops them
        returned = np.zeros(nv, bool)
        returned[np.asarray(sorted(self.outputs or ()), np.int64)] = True
        nonfin = codes > 0

        def eqn_any(per_value):  # per equation: any of its outputs
            if not len(outs_v):
                return jnp.zeros((m,), bool)
            return jax.ops.segment_max(per_value[outs_v], outs_k, m) > 0

        def value_any(per_eqn):  # per value: any equation reading it
            if not len(ins_v):
                return jnp.zeros((nv,), bool)
            on = per_eqn[ins_k] if active is None else per_eqn[ins_k] & active
            return jax.ops.segment_max(on.astype(jnp.int8), ins_v, nv) > 0

        # An equation observes a value only if its own result is needed: FAST's probe
        # statistics of a site at SAFE read FAST's non-finite values into finite ones, but
        # only the gear ``cond`` reads those statistics, and it drops them.
        needed = self._needed()
        observes = jnp.asarray(given) | (jnp.asarray(has_out & ~mask) & needed & ~bad_out)
        # An unread result counts as live (a primal ``jax.grad`` drops), but not a dead copy
        # (``_copies``): ``vmap`` of a gear switch with a batched gear hands every branch each
        # operand through a ``select_n`` of it and its ``stop_gradient``, and the copies of
        # FAST's value that STABLE and SAFE do not read made FAST's dropped overflow a root.
        passes = np.zeros(nv, bool)
        for k, rec in enumerate(self.recs):
            if self.copy[k] and self.dead[k] and rec[2] is not None:
                passes[np.asarray(sorted(rec[2][1]), np.int64)] = True
        seed = returned if observed_only else returned | (~read & ~passes)
        base = nonfin & (jnp.asarray(seed) | value_any(observes))

        def grow(state):
            live, _ = state
            via = eqn_any((nonfin & live).astype(jnp.int8))
            new = base | (nonfin & value_any(via))
            return new, jnp.any(new != live)

        # The carry is made from ``base`` and ``nonfin``, so that inside a ``shard_map`` it
        # varies over the devices as the body's result does (a constant ``True`` does not, and
        # ``while_loop`` refuses the mismatch when a fault depends on ``axis_index``).
        live0 = base | (nonfin & False)
        seen = jnp.any(live0)
        again = seen | ~seen  # True, typed as the body's result
        live, _ = jax.lax.while_loop(lambda s: s[1], grow, (live0, again))
        return eqn_any((nonfin & live).astype(jnp.int8)) | jnp.asarray(given | ~has_out)

    def _needed(self) -> Any:
        """bool[#records]: the record's results (of any dtype) reach the walk's results
        through reads that are not dropped by a known branch; a backward pass over the links.

        Results nothing reads count as needed (as in ``_reaches``: a later program may read
        them; a prefix's lower bound keeps them too, as every observation counted before a
        dropped one was told apart), unless the equation is dead code of the program (``dead``:
        none of its results reaches the jaxpr's outputs, e.g. what a JVP rule computes for a
        tangent nobody uses: ``reduce_max``'s ``eq(x, max)`` over a masked row's ``-inf``, in a
        site at SAFE, made FAST's dropped ``-inf`` a root). A loop instrumented in place
        (``given``) is needed.

        A record's need is a Python bool, or a traced one where it depends on which operands a
        ``cond`` whose branch is known at run time only (``dynamic``) reads: FAST's statistics
        in a scanned site at STABLE, read by the gear switch, which drops them.

        Returns:
          A numpy array when no need is traced, else the same on the device.
        """
        read: set[int] = set()
        for reads, _, drops in self.links:
            read.update(reads, drops)
        need: dict[int, Any] = {w: True for w in self.output_ids}

        def either(a: Any, b: Any) -> Any:
            if a is True or b is True:
                return True
            if a is False:
                return b
            return a if b is False else jnp.logical_or(a, b)

        out: list[Any] = [True] * len(self.recs)
        for k in range(len(self.recs) - 1, -1, -1):
            reads, writes, _ = self.links[k]
            if self.dead[k]:
                out[k] = False
            elif self.recs[k][0] != "given":
                got: Any = not writes
                for w in writes:
                    got = either(got, True if w not in read else need.get(w, False))
                out[k] = got
            if out[k] is False:
                continue
            dyn = self.dynamic.get(k)
            for r in reads:
                on: Any = out[k]
                if dyn is not None and r in dyn[2] and r != dyn[3]:  # the index is always read
                    taken = self._taken(k, [p for p, o in enumerate(dyn[2]) if o == r])
                    on = taken if on is True else jnp.logical_and(on, taken)
                need[r] = either(need.get(r, False), on)
        static = np.asarray([x is not False for x in out], bool)
        traced = [k for k, x in enumerate(out) if not isinstance(x, bool)]
        if not traced:
            return static
        return jnp.asarray(static).at[np.asarray(traced)].set(jnp.stack([out[k] for k in traced]))

    def _taken(self, k: int, positions: Sequence[int]) -> Any:
        """Traced bool: the taken branch of ``dynamic`` record ``k`` reads one of its operands
        at ``positions`` (True for none: the index alone)."""
        if not positions:
            return jnp.asarray(True)
        index, used, _, _ = self.dynamic[k]
        return jnp.any(jnp.asarray(used[:, list(positions)])[index])

    def any_flags(self) -> Any:
        """bool[3]: whether any equation of this walk is flagged root / nan / literal."""
        return jnp.stack([jnp.any(f) for f in self.finalize()])


# Primitives whose output holds exactly the values of their inputs (each input element appears at
# least once, nothing is computed): the output is finite iff every input is, so the flags walk
# derives their code instead of reducing over them (a third of a train step's equations).
_PRESERVING = frozenset(
    {"reshape", "broadcast_in_dim", "transpose", "squeeze", "expand_dims", "copy", "copy_p"}
    | {"rev", "concatenate", "neg", "optimization_barrier"}
)


def preserves(eqn: Any) -> bool:
    """Whether ``eqn``'s outputs are finite exactly when all its inputs are."""
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


def walk(jaxpr: Any, consts: Sequence[Any], args: Sequence[Any], ctx: Ctx, ns: Any) -> list:
    """Evaluates ``jaxpr`` on ``consts`` and ``args`` in ``ctx.mode``; returns its outputs.

    Args:
      jaxpr: an open ``Jaxpr``.
      consts: values of its constvars; args: values of its invars.
      ctx: the walk's state; flat equations are numbered from ``ctx.count``.
      ns: the name stack the jaxpr is called under.
    """
    outs = _walk(jaxpr, consts, args, ctx, ns, [True] * len(jaxpr.outvars))
    if ctx.mode == "flags":  # what the walk returns is live (``Ctx._reaches``)
        ctx.outputs = frozenset().union(*(ctx.ref(o)[1] for o in outs))
        ctx.output_ids = frozenset(map(id, outs))
        ctx._pinned += list(outs)
    return outs


def _copies(jaxpr: Any) -> list[bool]:
    """Per equation of one jaxpr level: a ``select_n`` whose cases are all one value, or
    ``stop_gradient`` of it: a copy, whatever the predicate. ``vmap`` of a ``cond`` with a
    batched index hands each branch its operands through such selects."""
    source = {
        e.outvars[0]: e.invars[0]
        for e in jaxpr.eqns
        if e.primitive.name == "stop_gradient" and not jc.is_literal(e.invars[0])
    }
    out = []
    for e in jaxpr.eqns:
        cases = e.invars[1:] if e.primitive.name == "select_n" else []
        if not cases or any(jc.is_literal(c) for c in cases):
            out.append(False)
            continue
        cases = [source.get(v, v) for v in cases]
        out.append(all(c is cases[0] for c in cases))
    return out


def _dead_code(jaxpr: Any, live_out: Sequence[bool]) -> tuple[list[bool], list[list[bool]]]:
    """Static dead-code analysis of one jaxpr level: per equation, whether none of its results
    reaches a live output (``live_out``) and it has no effects; and which of its results do
    (passed on to a call's body). ``make_jaxpr`` keeps such code (a JVP rule's unused tangent
    work)."""
    live = {
        v for v, keep in zip(jaxpr.outvars, live_out, strict=True) if keep and not jc.is_literal(v)
    }
    dead = [False] * len(jaxpr.eqns)
    outs_live: list[list[bool]] = [[]] * len(jaxpr.eqns)
    for i in range(len(jaxpr.eqns) - 1, -1, -1):
        eqn = jaxpr.eqns[i]
        outs_live[i] = [v in live for v in eqn.outvars]
        if eqn.effects or any(outs_live[i]):
            live.update(v for v in eqn.invars if not jc.is_literal(v))
        else:
            dead[i] = True
    return dead, outs_live


def _walk(
    jaxpr: Any, consts: Sequence[Any], args: Sequence[Any], ctx: Ctx, ns: Any, live_out: Any
) -> list:
    env: dict[Any, Any] = {}
    dead, outs_live = _dead_code(jaxpr, live_out)
    copies = _copies(jaxpr)

    def read(a: Any) -> Any:
        return jc.literal_value(a) if jc.is_literal(a) else env[a]

    for v, x in zip(jaxpr.constvars, consts, strict=True):
        env[v] = x
    for v, x in zip(jaxpr.invars, args, strict=True):
        env[v] = x
    for i, eqn in enumerate(jaxpr.eqns):
        invals = [read(a) for a in eqn.invars]
        ens = jc.eqn_name_stack(eqn, ns)
        rule = rules.rule_for(eqn)
        if rule is not None and rule.kind == "call":
            body, body_consts = rule.body(eqn)
            outs = _walk(body, body_consts, invals, ctx, ens, outs_live[i])
        else:
            ctx._dead_now, ctx._copy_now = dead[i], copies[i]
            k = ctx.count
            if ctx.stop_at is not None and k >= ctx.stop_at:
                raise Stop({})
            ctx.count += 1
            if k in ctx.known:  # a gear switch: XLA compiles only the taken branch
                invals[0] = np.asarray(ctx.known[k], eqn.invars[0].aval.dtype)
            into = ctx.targets.get(k) if ctx.mode == "capture" else None
            if into is not None:
                ctx.payloads[k] = into(invals)
                if len(ctx.payloads) == len(ctx.targets):
                    raise Stop(ctx.payloads)
            if ctx.mode == "flags" and rule is not None and rule.eager:
                outs, steps, *body = rule.flags(eqn, invals, ens)
                ctx.steps[k] = steps
                if body and body[0] is not None:
                    ctx.bodies[k] = body[0]
                ctx.recs.append(("given", steps >= 0, ctx.union(invals)))
                ctx.link(invals, outs)
            elif ctx.mode == "flags":
                outs = _flags_eqn(eqn, invals, ens, ctx, ctx.known.get(k))
            else:
                outs = jc.bind_eqn(eqn, invals, ens)
            if ctx.mode == "capture" and k in ctx.targets:
                ctx.payloads[k] = [list(invals), list(outs)]
                if len(ctx.payloads) == len(ctx.targets):
                    raise Stop(ctx.payloads)
            if k in ctx.watch:
                ctx.watched[k] = [outs[p] for p in ctx.watch[k]]
        for v, o in zip(eqn.outvars, outs, strict=True):
            env[v] = o
    return [read(a) for a in jaxpr.outvars]


def _flags_eqn(eqn: Any, invals: list, ns: Any, ctx: Ctx, branch: int | None = None) -> list:
    """Binds ``eqn`` and records its flags from its inputs' and outputs' codes.

    A higher-order equation (loop, branch, map) is flagged like any other here, from its operands
    and results: a non-finite value made inside its body matters only if it reaches a result,
    and then the equation is flagged and the search instruments its body in a replay of its own
    (``Session.step_flags``). So the flags replay reduces only the level's own values.

    ``branch``: the known branch index of a ``cond`` (``branches.py``). Its inputs are then the
    operands that branch reads; the others are *dropped*: read, but by nothing that reaches a
    result (a site at SAFE drops FAST's value even when SAFE's own output is non-finite).
    """
    outs = jc.bind_eqn(eqn, invals, ns)
    if _MONITORED.search(str(ns)):  # one record per equation: the one appended below
        ctx.monitored.append(len(ctx.recs))
    if preserves(eqn):  # exact without a reduction: out finite <=> all inputs finite
        for o in outs:
            ctx.derive(o, ctx.union(invals))
        ctx.record(None, None)
        ctx.link(invals, outs)
    elif branch is not None:
        used = _reads(jc.cond_branches(eqn)[branch][0])
        ops = invals[1:]
        keep = [invals[0], *(x for x, u in zip(ops, used, strict=True) if u)]
        drop = [x for x, u in zip(ops, used, strict=True) if not u]
        ctx.recs.append(("mask", ctx.union(keep), ctx.union(outs), ctx.union(drop)))
        ctx.link(keep, outs, drop)
    elif eqn.primitive.name == "cond" and ctx.runtime_branches:
        # The branch is known at run time only (a gear switch in a loop body): the operands
        # the taken branch does not read are dropped as for a known branch, decided on the
        # device (``Ctx.edge_active``, ``Ctx._needed``).
        used = np.asarray([_reads(b[0]) for b in jc.cond_branches(eqn)], bool)
        i, n = jnp.asarray(invals[0], jnp.int32), len(used)
        index = jnp.where((i < 0) | (i >= n), n - 1, i)  # as XLA runs an index out of range
        _runtime_pick(ctx, invals, outs, index, used)
    elif eqn.primitive.name == "select_n" and not np.shape(invals[0]) and len(invals) > 2:
        # A scalar predicate returns one case whole, as a ``cond`` returns one branch's value:
        # the other cases are dropped, decided on the device. FAST's residuals of a site above
        # FAST (``ops.dispatch._fast_residuals``) are such a case: what the forward computes
        # from FAST's overflow for the backward (``x ** -2``: a finite 0 from an inf) only
        # looked observed while the backward was not replayed (the forward prefix).
        n = len(invals) - 1
        index = jnp.clip(jnp.asarray(invals[0], jnp.int32), 0, n - 1)
        _runtime_pick(ctx, invals, outs, index, np.eye(n, dtype=bool))
    else:
        name = eqn.primitive.name
        absorbs = name in _ABSORBING and all(inexact(o) for o in outs)
        kind = "mask" if name in _MASKING or absorbs else "eqn"
        ctx.record(ctx.union(invals), ctx.union(outs), kind)
        ctx.link(invals, outs)
    return outs


def _runtime_pick(ctx: Ctx, invals: list, outs: list, index: Any, used: np.ndarray) -> None:
    """Records an equation that returns what one of its ``used.shape[0]`` ways reads, the way
    ``index`` chosen on the device (``used[b, p]``: way ``b`` reads operand ``p`` of
    ``invals[1:]``): a ``cond`` or a scalar ``select_n``."""
    ctx.record(ctx.union(invals), ctx.union(outs), "mask")
    ctx.dynamic[len(ctx.recs) - 1] = (index, used, tuple(map(id, invals[1:])), id(invals[0]))
    ctx._refs_of[len(ctx.recs) - 1] = [ctx.ref(x)[1] for x in invals[1:]]
    ctx.link(invals, outs)


def _reads(jaxpr: Any) -> list[bool]:
    """Per invar of ``jaxpr``: whether any equation or output reads it."""
    read = {id(a) for e in jaxpr.eqns for a in e.invars if not jc.is_literal(a)}
    read |= {id(a) for a in jaxpr.outvars if not jc.is_literal(a)}
    return [id(v) in read for v in jaxpr.invars]


# Equations that can drop an operand: a non-finite value that only reaches such equations, and
# is dropped by them, never reaches a result (``jnp.where(x > 0, jnp.log(x), 0)``; a gear switch
# that passes FAST's value through only at FAST).
_MASKING = frozenset({"select_n", "cond"})
# Float arithmetic whose finite result for an infinite operand is the one it gives every value
# past the dtype's limit: ``exp(-inf) = 0`` (so is ``exp(-65520)``), ``tanh(inf) = 1``,
# ``max(-inf, x) = x``. A finite result of one absorbs the inf: nothing was lost, and it does not
# *observe* it, as a comparison or ``isfinite`` does (fp16 flax attention fills masked logits
# with the dtype's minimum, and ``fill - rowmax`` rounds to ``-inf`` on the way to ``exp``: no
# fault). Not ``1 / inf = 0`` or ``rsqrt(inf) = 0``: their finite result is wrong for the value
# that overflowed (``x * rsqrt(mean(x*x))`` zeroing a row is the fault), so they observe it. A
# non-finite result carries the operand on; a NaN operand gives a NaN result here.
_ABSORBING = frozenset(
    {"exp", "exp2", "expm1", "tanh", "logistic", "atan", "erf", "erfc", "sign"}
    | {"max", "min", "clamp", "reduce_max", "reduce_min"}
)


# ``probe.MONITOR_SCOPE`` as a whole component of a name stack (``a/nan2safe_monitor``,
# ``vmap(nan2safe_monitor)``), not inside another scope's name.
_MONITORED = re.compile(rf"(^|[/(]){re.escape(MONITOR_SCOPE)}($|[/)])")

MODES = ("root", "nan", "literal")  # the three flags, in the order of ``Ctx.finalize``


def no_step() -> Any:
    """int32[3] of -1: no flagged step yet for any of the three flags."""
    return jnp.full((3,), -1, jnp.int32)


def first_step(first: Any, hit: Any, step: Any) -> Any:
    """Per flag: ``step`` if nothing was flagged before (``first < 0``) and ``hit``; else
    ``first`` (``first`` int32[3], ``hit`` bool[3])."""
    return jnp.where((first < 0) & hit, step, first)
