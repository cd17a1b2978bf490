"""Every JAX-internal name the replay localizer touches, in one place (and the one
``numerics.sum_of_squares`` reads a traced value's producer with).

The localizer walks jaxprs equation by equation, which has no fully public API: it needs the
jaxpr classes (``jax.extend.core``), ``Primitive.bind`` with the equation's bind parameters (what
``jax._src.core.eval_jaxpr`` does), the source info of each equation (``jax._src.source_info_util``)
and the parameter layout of the control-flow primitives. A JAX upgrade should only touch this file.
Tested on jax 0.10.x; written to also accept the 0.11 spellings noted inline.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import jax

try:  # public since jax 0.4.3x
    from jax.extend.core import ClosedJaxpr, Jaxpr, JaxprEqn, Literal, Var
except ImportError:  # pragma: no cover - older/newer layouts
    from jax._src.core import ClosedJaxpr, Jaxpr, JaxprEqn, Literal, Var  # type: ignore

from jax._src import source_info_util as _siu

__all__ = [
    "CALL_PRIMITIVES",
    "ClosedJaxpr",
    "Jaxpr",
    "JaxprEqn",
    "Literal",
    "Var",
    "bind_eqn",
    "call_body",
    "cond_branches",
    "empty_name_stack",
    "eqn_name_stack",
    "eqn_user_frames",
    "eqn_user_source",
    "has_sub_jaxpr",
    "sub_jaxprs",
    "is_literal",
    "jit_with_options",
    "literal_value",
    "open_jaxpr",
    "scan_params",
    "shard_map",
    "shard_map_params",
    "traced_producer",
    "while_params",
]

# Higher-order primitives that simply call a jaxpr once with their operands (after ``num_consts``
# leading constants, which are ordinary operands here). Evaluating the inner jaxpr gives the same
# primal values, so the localizer inlines them. Names across versions: ``pjit`` became ``jit``
# (0.7), ``checkpoint``/``remat2`` (remat), ``custom_vjp_call_jaxpr`` became ``custom_vjp_call``.
CALL_PRIMITIVES = frozenset(
    {
        "jit",
        "pjit",
        "closed_call",
        "core_call",
        "call",
        "remat2",
        "checkpoint",
        "remat",
        "custom_jvp_call",
        "custom_vjp_call",
        "custom_vjp_call_jaxpr",
        "custom_lin",
    }
)
_CALL_JAXPR_KEYS = ("jaxpr", "call_jaxpr", "fun_jaxpr")


def open_jaxpr(j: Any) -> tuple[Any, Sequence[Any]]:
    """``(Jaxpr, consts)`` of a ClosedJaxpr or of an open Jaxpr (no consts)."""
    if isinstance(j, ClosedJaxpr) or (hasattr(j, "jaxpr") and hasattr(j, "consts")):
        return j.jaxpr, list(j.consts)
    return j, []


def call_body(eqn: Any) -> tuple[Any, Sequence[Any]] | None:
    """The ``(Jaxpr, consts)`` a call-like equation evaluates, or None if it is not call-like."""
    if eqn.primitive.name not in CALL_PRIMITIVES:
        return None
    for key in _CALL_JAXPR_KEYS:
        j = eqn.params.get(key)
        if j is not None and (hasattr(j, "eqns") or hasattr(j, "jaxpr")):
            jaxpr, consts = open_jaxpr(j)
            if len(jaxpr.invars) == len(eqn.invars):
                return jaxpr, consts
    return None


def sub_jaxprs(eqn: Any) -> list[Any]:
    """The open jaxprs ``eqn``'s parameters hold (a body, branches, a custom rule's jaxpr),
    directly or in a tuple or list."""
    out = []
    for v in eqn.params.values():
        for x in v if isinstance(v, (tuple, list)) else (v,):
            if isinstance(x, (Jaxpr, ClosedJaxpr)):
                out.append(open_jaxpr(x)[0])
    return out


def has_sub_jaxpr(eqn: Any) -> bool:
    """Whether any parameter of ``eqn`` is a jaxpr (a higher-order primitive: ``pallas_call``,
    ``shard_map``, ``custom_transpose``, ``linear_call``, ``run_state``, ``xla_pmap`` ...)."""
    return bool(sub_jaxprs(eqn))


def _scan_counts(p: dict[str, Any]) -> tuple[int, int]:
    """``(num_consts, num_carry)`` of a scan: explicit in jax 0.10; in jax >= 0.11 the params
    hold ``ft_in = (consts, carry, xs)`` groups instead (constant carries are hoisted into the
    consts and forwarded outputs are dropped from the equation, matching the body)."""
    if "num_consts" in p:
        return p["num_consts"], p["num_carry"]
    ft_in = p["ft_in"]  # a jax._src.flattree.FlatTree of (consts, carry, xs) groups
    consts, carry, _ = ft_in.unpack() if hasattr(ft_in, "unpack") else ft_in
    return len(consts), len(carry)


def scan_params(eqn: Any) -> dict[str, Any]:
    """Normalized parameters of a ``scan`` equation."""
    p = eqn.params
    jaxpr, consts = open_jaxpr(p["jaxpr"])
    return dict(
        jaxpr=jaxpr,
        consts=consts,
        num_consts=_scan_counts(p)[0],
        num_carry=_scan_counts(p)[1],
        length=p["length"],
        reverse=p.get("reverse", False),
        unroll=p.get("unroll", 1),
    )


def while_params(eqn: Any) -> dict[str, Any]:
    """Normalized parameters of a ``while`` equation."""
    p = eqn.params
    cj, cc = open_jaxpr(p["cond_jaxpr"])
    bj, bc = open_jaxpr(p["body_jaxpr"])
    return dict(
        cond_jaxpr=cj,
        cond_consts=cc,
        body_jaxpr=bj,
        body_consts=bc,
        cond_nconsts=p["cond_nconsts"],
        body_nconsts=p["body_nconsts"],
    )


def cond_branches(eqn: Any) -> list[tuple[Any, Sequence[Any]]]:
    """``[(Jaxpr, consts)]`` of each branch of a ``cond`` equation (index is operand 0)."""
    return [open_jaxpr(b) for b in eqn.params["branches"]]


def is_literal(atom: Any) -> bool:
    return isinstance(atom, Literal)


def literal_value(atom: Any) -> Any:
    return atom.val


def empty_name_stack() -> Any:
    return _siu.new_name_stack()


def eqn_name_stack(eqn: Any, outer: Any) -> Any:
    """The full name stack of ``eqn`` when its jaxpr is called under name stack ``outer``."""
    return outer + eqn.source_info.name_stack


def eqn_user_source(eqn: Any) -> str | None:
    """``"file.py:LINE"`` of the innermost non-JAX frame that traced ``eqn``, or None."""
    tb = eqn.source_info.traceback
    if tb is None:
        return None
    frame = _siu.user_frame(tb)
    if frame is None:
        return None
    return f"{frame.file_name}:{frame.start_line}"


def eqn_user_frames(eqn: Any) -> list[tuple[str, int]]:
    """``[(file, line)]`` of the non-JAX frames that traced ``eqn``, innermost first."""
    tb = eqn.source_info.traceback
    if tb is None:
        return []
    return [(f.file_name, f.start_line) for f in _siu.user_frames(tb)]


def bind_eqn(eqn: Any, invals: Sequence[Any], name_stack: Any) -> list[Any]:
    """Applies ``eqn``'s primitive to ``invals``, as ``jax._src.core.eval_jaxpr`` does."""
    params = eqn.primitive.get_bind_params(eqn.params)
    subfuns: Sequence[Any] = ()
    if isinstance(params, tuple):  # jax < 0.5: (subfuns, bind_params)
        subfuns, params = params
    ctx = getattr(eqn, "ctx", None)
    manager = ctx.manager if ctx is not None else contextlib.nullcontext()
    with _siu.user_context(eqn.source_info.traceback, name_stack=name_stack), manager:
        ans = eqn.primitive.bind(*subfuns, *invals, **params)
    return list(ans) if eqn.primitive.multiple_results else [ans]


def jit_with_options(fn: Any, compiler_options: dict[str, Any] | None) -> Any:
    """``jax.jit`` with XLA compiler options when given (``jax.jit(compiler_options=...)``)."""
    if compiler_options:
        return jax.jit(fn, compiler_options=compiler_options)
    return jax.jit(fn)


def shard_map_params(eqn: Any) -> dict[str, Any]:
    """Normalized parameters of a ``shard_map`` equation (jax.pmap lowers to one, jax >= 0.8):
    ``mesh``, ``in_specs``, ``out_specs``, ``axes`` (the manual mesh axes, in mesh order),
    ``check_vma`` and the body ``jaxpr`` (open) with its ``consts``."""
    p = eqn.params
    jaxpr, consts = open_jaxpr(p["jaxpr"])
    mesh = _auto_axes(p["mesh"])
    manual = p.get("newly_manual_axes", p.get("axis_names", frozenset(mesh.axis_names)))
    axes = tuple(a for a in mesh.axis_names if a in manual)
    return dict(
        mesh=mesh,
        in_specs=tuple(p["in_specs"]),
        out_specs=tuple(p["out_specs"]),
        axes=axes,
        check_vma=p.get("check_vma", p.get("check_rep", True)),
        jaxpr=jaxpr,
        consts=consts,
    )


def _auto_axes(mesh: Any) -> Any:
    """``mesh`` with every axis ``Auto``. A replay runs a ``shard_map`` again on arguments it
    gathered to one device; an ``Explicit`` axis (``jax.make_mesh``'s default in jax 0.10)
    makes ``shard_map`` check their sharding against ``in_specs`` and refuse them. The body
    runs with its axes manual either way."""
    types = getattr(mesh, "axis_types", None)
    auto = getattr(getattr(jax.sharding, "AxisType", None), "Auto", None)
    if not types or auto is None or not hasattr(mesh, "update") or all(t == auto for t in types):
        return mesh
    return mesh.update(axis_types=(auto,) * len(types))


def shard_map(fn: Any, mesh: Any, in_specs: Any, out_specs: Any, axes: Any, check_vma: bool):
    """``jax.shard_map`` (``jax.experimental.shard_map.shard_map`` before jax 0.7)."""
    sm = getattr(jax, "shard_map", None)
    if sm is not None:
        return sm(
            fn,
            mesh=mesh,
            in_specs=in_specs,
            out_specs=out_specs,
            axis_names=frozenset(axes),
            check_vma=check_vma,
        )
    from jax.experimental.shard_map import shard_map as old  # pragma: no cover

    return old(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_rep=check_vma)


def backends_initialized() -> bool:
    """Whether JAX has created a backend already (then device counts can no longer change)."""
    from jax._src import xla_bridge

    return bool(xla_bridge.backends_are_initialized())


def traced_producer(x: Any) -> tuple[str, list[Any], dict[str, Any]] | None:
    """``(primitive name, input tracers, params)`` of the equation that made ``x``, while the
    trace that holds ``x`` is still being built; None for anything else.

    ``numerics.sum_of_squares`` reads through a ``transpose`` with it. In jax 0.10 a jit
    trace's tracer keeps the equation it came from (``DynamicJaxprTracer.parent``, a
    ``TracingEqn`` whose ``in_tracers`` are the operands' tracers); a JAX without that
    attribute makes this None, and the caller keeps the value it has.
    """
    eqn = getattr(x, "parent", None)
    prim = getattr(eqn, "primitive", None)
    ins = getattr(eqn, "in_tracers", None)
    if prim is None or ins is None:
        return None
    return prim.name, list(ins), dict(getattr(eqn, "params", {}) or {})
