"""The localizer's result: which equation made the first non-finite value, where, and why.

Statistics, the channel scan and the diagnosis are computed on the host with NumPy from the values
the last replay captured (the culprit's inputs and outputs only), so they cost no compiles.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from nan2safe_jax.runlog.events import to_jsonable

DIAGNOSES = (
    "overflow",
    "0/0",
    "division by ~0",
    "log/sqrt domain",
    "polluted input",
    "damaged state",
    "constant",
    "index out of range",
    "other",
)
NOT_REPRODUCIBLE = "not reproducible: suspect hardware or non-determinism"
CHANNEL_LIMIT = 64  # indices kept per axis in Report.channels

# Primitives whose non-finite result from finite inputs means "argument outside the domain".
_DOMAIN_PRIMS = frozenset(
    {"log", "log1p", "sqrt", "rsqrt", "pow", "acos", "asin", "atanh", "acosh", "lgamma", "digamma"}
    | {"igamma", "igammac", "erf_inv", "cbrt", "logistic"}
)
# Primitives whose NaN from finite inputs comes from an overflowed intermediate.
_ARITH_PRIMS = frozenset(
    {"add", "sub", "mul", "dot_general", "reduce_sum", "cumsum", "conv_general_dilated", "exp"}
    | {"exp2", "expm1", "add_any", "reduce_precision", "convert_element_type", "tanh", "logistic"}
    | {"fft"}
)


@dataclasses.dataclass(frozen=True)
class EqnRef:
    """A short record of one equation (used for ``Report.first_nan``)."""

    primitive: str
    source: str | None
    name_stack: str
    site: str | None
    direction: str
    eqn_path: tuple
    user_source: str | None = None

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["eqn_path"] = _path_to_json(self.eqn_path)
        return d

    def __str__(self) -> str:
        return (
            f"{self.primitive} at {self.source} [{self.direction}] path={path_str(self.eqn_path)}"
        )


@dataclasses.dataclass(frozen=True)
class Report:
    """Where the first non-finite value of a program came from.

    Attributes:
      primitive: name of the culprit primitive (``"div"``, ``"dot_general"``); None when an input
        argument was already non-finite (``diagnosis == "polluted input"``) or when the replay did
        not reproduce any non-finite value.
      source: ``"file.py:LINE"`` of the innermost non-JAX frame that traced the equation.
      name_stack: the equation's full name stack (``jvp(...)``, ``transpose(...)``, named scopes).
      site: the nan2safe site named in the name stack (``nan2safe[<site>]``), or None.
      direction: ``"backward"`` if the name stack contains a ``transpose(`` (the equation was
        emitted while transposing, i.e. it computes cotangents), else ``"forward"``; None when
        no equation is blamed (polluted input, damaged state, not reproducible).
      kind: ``"inf"`` or ``"nan"`` — what the culprit's output holds (``"nan"`` if both); for a
        polluted input, what the batch holds: also ``"huge"`` (finite values past 2**64),
        ``"label"`` (out of range) or ``"empty"`` (no rows).
      first_nan: when ``kind == "inf"``, the first equation that produced a NaN from NaN-free
        inputs (often the ``inf - inf`` after an overflow), else None.
      eqn_path: equation indices from the top-level jaxpr down to the culprit; entering a sub-jaxpr
        appends its index, a loop iteration appends ``("iter", t)`` (t indexes the scanned axis /
        counts while-iterations), a ``cond`` appends ``("branch", b)``.
      inputs: per-input statistics (shape, dtype, min, max, max_abs, min_abs, nonfinite, literal).
      channels: ``{axis: sorted indices along that axis holding non-finite output values}``, at
        most ``CHANNEL_LIMIT`` (the first ones) per axis.
      channels_truncated: ``{axis: number of bad indices}`` for each axis whose list in
        ``channels`` was cut at ``CHANNEL_LIMIT``; empty when every list is complete.
      diagnosis: one of ``DIAGNOSES`` (or ``NOT_REPRODUCIBLE``).
      explanation: a human sentence with the numbers behind the diagnosis.
      replays: number of jitted segment evaluations this localization ran.
      seconds: wall time of the localization, including every compile.
      reproducible: False when the replay did not reproduce the production step (``locate_step``):
        it produced no non-finite value at all, or its outputs' finiteness differs.
      reason: why ``reproducible`` is False.
      user_source: ``"file.py:LINE"`` of the innermost frame outside JAX, Flax and nan2safe_jax
        that traced the equation: for an equation of a ``nan2safe.nn`` site (whose ``source`` is a
        line of nan2safe_jax), the model code that called the site.
      shard: inside a ``shard_map``, the linear index of the shard whose body made the value.
      input_path: for ``"polluted input"``, the ``jax.tree_util.keystr`` of the first bad argument.
      magnitude: when an input of the culprit was already near overflow (``replay.magnitude``):
        ``fraction`` of its dtype's range it reached, and where that value was made: ``origin``
        (an ``EqnRef`` dict: the first equation, walking back, whose inputs were far from their
        range) or ``argument`` (the ``keystr`` of the program's argument it is), with the
        ``max_abs`` and ``origin_fraction`` of the value made there and ``inputs_max_abs``, the
        largest input of the origin equation, and ``origin_input`` the argument that input is
        (a learned scale an ``exp`` reads); ``layer``: the slice of a stacked argument a
        scanned body's input is (a scanned layer's weight); else None.
    """

    primitive: str | None
    source: str | None
    name_stack: str
    site: str | None
    direction: str | None
    kind: str | None
    first_nan: EqnRef | None
    eqn_path: tuple
    inputs: list[dict[str, Any]]
    channels: dict[int, list[int]]
    diagnosis: str
    explanation: str
    replays: int
    seconds: float
    reproducible: bool = True
    input_path: str | None = None
    output_shape: tuple[int, ...] | None = None
    channels_truncated: dict[int, int] = dataclasses.field(default_factory=dict)
    user_source: str | None = None
    reason: str | None = None
    shard: int | None = None
    device: str | None = None
    magnitude: dict[str, Any] | None = None

    @classmethod
    def no_equation(cls, **fields: Any) -> Report:
        """A report that blames no equation (polluted input, not reproducible)."""
        base = dict(
            primitive=None,
            source=None,
            name_stack="",
            site=None,
            direction=None,  # no equation, so neither pass (newuser51: read as a located op)
            first_nan=None,
            eqn_path=(),
        )
        return cls(**{**base, **fields})

    def to_dict(self) -> dict[str, Any]:
        """A JSON-safe dict (``json.dumps(report.to_dict())`` works)."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["eqn_path"] = _path_to_json(self.eqn_path)
        d["first_nan"] = self.first_nan.to_dict() if self.first_nan else None
        d["channels"] = {str(k): [int(i) for i in v] for k, v in self.channels.items()}
        d["channels_truncated"] = {str(k): int(v) for k, v in self.channels_truncated.items()}
        d["inputs"] = [_json_safe(s) for s in self.inputs]
        d["output_shape"] = list(self.output_shape) if self.output_shape is not None else None
        return to_jsonable(d)  # the run record's JSON policy (nan2safe_jax.runlog.events)

    def __str__(self) -> str:
        lines = []
        if self.diagnosis in ("polluted input", "damaged state"):
            lines.append(f"{self.diagnosis}: {self.input_path} holds {self.kind} values")
            if self.explanation:  # which rows, which labels, out of what range
                lines.append(f"  {self.explanation}")
        elif not self.reproducible:
            lines.append(self.diagnosis)
            if self.reason and self.reason != self.diagnosis:
                lines.append(f"  reason: {self.reason}")
        else:
            lines.append(
                f"{self.kind} first produced by `{self.primitive}` ({self.direction}) "
                f"at {self.source}"
            )
            if self.user_source and self.user_source != self.source:
                lines.append(f"  called from: {self.user_source}")
            lines.append(f"  name stack: {self.name_stack or '-'}   site: {self.site or '-'}")
            lines.append(f"  eqn path: {path_str(self.eqn_path)}")
            if self.shard is not None:
                lines.append(f"  shard: {self.shard} (device {self.device or '-'})")
            for i, s in enumerate(self.inputs):
                lines.append(f"  input {i}: {_stats_str(s)}")
            if self.output_shape is not None:
                lines.append(f"  output {self.output_shape}: non-finite at")
                for ax, idx in self.channels.items():
                    lines.append(f"    axis {ax}: {_abbrev(idx, self.channels_truncated.get(ax))}")
            if self.first_nan is not None:
                lines.append(f"  first NaN: {self.first_nan}")
            if self.magnitude is not None:
                lines.append(f"  near overflow: {magnitude_sentence(self.magnitude)}")
            lines.append(f"  diagnosis: {self.diagnosis} — {self.explanation}")
        lines.append(f"  ({self.replays} replays, {self.seconds:.2f} s)")
        return "\n".join(lines)


def magnitude_sentence(m: dict[str, Any]) -> str:
    """``Report.magnitude`` in words."""
    head = f"its input was already at {100 * m['fraction']:.2g}% of its dtype's range"
    origin = m.get("origin")
    if origin is not None:
        where = origin.get("user_source") or origin.get("source") or "?"
        site = f" (site {origin['site']!r})" if origin.get("site") else ""
        made = f" (the largest: {m['origin_input']})" if m.get("origin_input") else ""
        return (
            f"{head}, a value made by `{origin['primitive']}` at {where}{site} "
            f"(max |x| {m['max_abs']:.3g}) from inputs no larger than "
            f"{m['inputs_max_abs']:.3g}{made}"
        )
    if m.get("argument") is not None:
        layer = f", layer {m['layer']} of the stack" if m.get("layer") is not None else ""
        return (
            f"{head}; it comes from the argument {m['argument']}{layer} "
            f"(max |x| {m['max_abs']:.3g})"
        )
    return f"{head}; it was made where the replay does not look (a loop's result, a constant)"


# ---------------------------------------------------------------------------------------------
# statistics, channels, diagnosis (host side)


def direction_of(name_stack: str) -> str:
    """``"backward"`` when the equation was emitted by transposition (cotangent computation)."""
    return "backward" if "transpose(" in name_stack else "forward"


def _as_np(x: Any) -> np.ndarray:
    a = np.asarray(x)
    if a.dtype.kind == "V" or a.dtype.name in ("bfloat16",) or a.dtype.kind == "f":
        try:
            return a.astype(np.float64)
        except (TypeError, ValueError):
            return a
    return a


def _is_inexact(x: Any) -> bool:
    try:
        return np.issubdtype(np.asarray(x).dtype, np.inexact) or "float" in str(np.asarray(x).dtype)
    except TypeError:
        return False


def array_stats(x: Any, literal: bool = False) -> dict[str, Any]:
    """Shape, dtype, min, max, max_abs, min_abs and count of non-finite elements of ``x``."""
    try:
        raw = np.asarray(x)
    except TypeError:  # e.g. a PRNG key array (extended dtype): no numeric statistics
        return {"shape": list(np.shape(x)), "dtype": str(x.dtype), "literal": literal}
    out: dict[str, Any] = {"shape": list(raw.shape), "dtype": str(raw.dtype), "literal": literal}
    if raw.size == 0 or raw.dtype.kind in "biuV" and not _is_inexact(raw):
        out.update(min=None, max=None, max_abs=None, min_abs=None, nonfinite=0)
        if raw.size and raw.dtype.kind in "biu":
            out.update(min=float(raw.min()), max=float(raw.max()))
        return out
    a = _as_np(raw)
    fin = np.isfinite(a)
    out["nonfinite"] = int(a.size - fin.sum())
    out["nan"] = int(np.isnan(a).sum())
    if fin.any():
        f = a[fin]
        real = not np.iscomplexobj(f)  # a complex array has no order: only its moduli
        out.update(
            min=float(f.min()) if real else None,
            max=float(f.max()) if real else None,
            max_abs=float(np.abs(f).max()),
            min_abs=float(np.abs(f).min()),
        )
    else:
        out.update(min=None, max=None, max_abs=None, min_abs=None)
    return out


def channel_scan(
    x: Any, nan_only: bool = False, limit: int = CHANNEL_LIMIT
) -> tuple[dict[int, list[int]], dict[int, int]]:
    """``({axis: first <= limit sorted indices holding a non-finite (or NaN) value},
    {axis: total count, for the axes cut at limit})`` of ``x``."""
    a = _as_np(np.asarray(x))
    bad = np.isnan(a) if nan_only else ~np.isfinite(a)
    chans: dict[int, list[int]] = {}
    cut: dict[int, int] = {}
    for ax in range(bad.ndim):
        other = tuple(i for i in range(bad.ndim) if i != ax)
        hit = np.nonzero(bad.any(axis=other) if other else bad)[0]
        chans[ax] = [int(i) for i in hit[:limit]]
        if len(hit) > limit:
            cut[ax] = int(len(hit))
    return chans, cut


def channels_of(x: Any, nan_only: bool = False) -> dict[int, list[int]]:
    """``{axis: sorted indices along axis holding a non-finite (or NaN) value}`` of ``x``, at most
    ``CHANNEL_LIMIT`` per axis (see ``channel_scan`` for the counts of the cut axes)."""
    return channel_scan(x, nan_only)[0]


def _finfo_max(dtype: str) -> float | None:
    try:
        import jax.numpy as jnp

        return float(jnp.finfo(dtype).max)
    except Exception:  # noqa: BLE001 - non-float dtype
        return None


def diagnose(
    primitive: str, invals: Sequence[Any], out: Any, kind: str, in_stats: Sequence[dict]
) -> tuple[str, str]:
    """Classifies why ``primitive`` turned finite ``invals`` into a non-finite ``out``."""
    out_np = _as_np(np.asarray(out))
    dtype = str(np.asarray(out).dtype)
    fmax = _finfo_max(dtype)
    max_in = max((s["max_abs"] or 0.0 for s in in_stats if s.get("max_abs") is not None), default=0)
    bad = ~np.isfinite(out_np)
    where = "nan" if kind == "nan" else "inf"
    n_bad = int(bad.sum())

    if primitive == "div" and len(invals) == 2:
        num = _broadcast(invals[0], out_np.shape)
        den = _broadcast(invals[1], out_np.shape)
        if num is not None and den is not None:
            nan = np.isnan(out_np)
            zz = nan & (num == 0) & (den == 0)
            if zz.any():
                return "0/0", (
                    f"{int(zz.sum())} of {n_bad} non-finite outputs are 0/0 (numerator and "
                    "denominator both zero, e.g. a fully masked softmax row)"
                )
            if kind == "inf" and bad.any():
                d = np.abs(den[bad])
                n = np.abs(num[bad])
                # ~0 only when the denominator is what is small: a numerator near the dtype's
                # largest value divided by 0.8 (a dropout's 1/keep) is an overflow (below)
                if float(d.max()) < 1e-3:
                    return "division by ~0", (
                        f"{n_bad} outputs divide by |denominator| <= {float(d.max()):.3g} "
                        f"(numerator up to {float(n.max()):.3g})"
                    )
    if primitive == "sub" and kind == "nan" and len(invals) == 2:
        a = _broadcast(invals[0], out_np.shape)
        b = _broadcast(invals[1], out_np.shape)
        if a is not None and b is not None:
            masked = np.isnan(out_np) & np.isneginf(a) & np.isneginf(b)
            if masked.any():
                return "0/0", (
                    f"{int(masked.sum())} of {n_bad} NaNs are -inf - (-inf): rows whose every "
                    "entry is -inf (a fully masked softmax row: its max is -inf, x - max is NaN, "
                    "then exp/sum give 0/0)"
                )
    if primitive == "gather" and kind == "nan" and len(in_stats) >= 2:
        # A gather only copies values: NaN from a finite operand is JAX's fill for indices
        # past the end of the axis (negative ones wrap around, and fill nothing).
        lo, hi = in_stats[1].get("min"), in_stats[1].get("max")
        span = "" if lo is None or hi is None else f" (min {lo:g}, max {hi:g})"
        return "index out of range", (
            f"gather filled {n_bad} value(s) with NaN: its indices{span} reach past the axis "
            f"of the operand {tuple(np.shape(invals[0]))}, e.g. a label or token id outside "
            "the vocabulary (data, not the model: nan2safe.incidents.decide names the batch "
            "leaf and rows)"
        )
    if primitive in ("rsqrt",) and kind == "inf":
        return "division by ~0", (
            f"rsqrt of {n_bad} value(s) at or near zero "
            f"(min |input| = {in_stats[0]['min_abs']:.3g}); e.g. a variance of 0 with eps=0"
        )
    if primitive in ("pow", "integer_pow") and kind == "inf" and invals:
        # a negative power of ~0 (0 ** -0.5) divides by ~0; a positive one of a big value
        # overflows: told apart by the bases at the non-finite elements
        base = _broadcast(invals[0], out_np.shape)
        if base is not None and bad.any() and float(np.abs(base[bad]).max()) < 1e-6:
            return "division by ~0", f"negative power of a value near 0 on {n_bad} element(s)"
    if primitive in _DOMAIN_PRIMS and not (primitive == "pow" and kind == "inf"):
        lo = in_stats[0].get("min") if in_stats else None
        return "log/sqrt domain", (
            f"{primitive} outside its domain on {n_bad} element(s) (min input = {lo!r})"
        )
    share = f" ({100 * max_in / fmax:.3g}% of the max)" if fmax else ""
    if kind == "inf":
        return "overflow", (
            f"{n_bad} result(s) exceed the {dtype} range (max {fmax:.6g}); "
            f"max |input| = {max_in:.6g}{share}"
        )
    if primitive in _ARITH_PRIMS:
        return "overflow", (
            f"an intermediate inside {primitive} overflowed (inf - inf or 0 * inf) and gave "
            f"{n_bad} NaN(s); max |input| = {max_in:.6g}{share}"
        )
    return "other", f"{primitive} produced {n_bad} {where} value(s) from finite inputs"


def opaque_why(primitive: str, out: Any, kind: str, in_stats: Sequence[dict]) -> str:
    """The explanation for a higher-order primitive the replay cannot enter: what it made, not
    why (``diagnose``'s reasons are about one arithmetic op; a solve's zero pivot is no
    overflow)."""
    n_bad = int((~np.isfinite(_as_np(np.asarray(out)))).sum())
    max_in = max((s["max_abs"] or 0.0 for s in in_stats if s.get("max_abs") is not None), default=0)
    why = (
        f"could not enter {primitive}: the fault is inside it; it made {n_bad} {kind} value(s) "
        f"from finite inputs (max |input| = {max_in:.6g})"
    )
    if primitive == "custom_linear_solve":
        why += (
            "; a linear solve (jnp.linalg.solve, inv) gives this for a singular or "
            "ill-conditioned matrix"
        )
    return why


def _broadcast(x: Any, shape: tuple[int, ...]) -> np.ndarray | None:
    try:
        return np.broadcast_to(_as_np(np.asarray(x)), shape)
    except ValueError:
        return None


# ---------------------------------------------------------------------------------------------
# formatting


def _path_to_json(path: tuple) -> list:
    return [list(p) if isinstance(p, tuple) else p for p in path]


def path_str(path: tuple) -> str:
    return "/".join(f"{p[0]}={p[1]}" if isinstance(p, tuple) else str(p) for p in path) or "-"


def _abbrev(idx: list[int], total: int | None = None, n: int = 12) -> str:
    kept = f"{total} indices, first {len(idx)} kept" if total else f"{len(idx)} indices"
    if len(idx) <= n and not total:
        return str(idx)
    return f"{idx[: n // 2]} ... {idx[-n // 2 :]} ({kept})"


def _stats_str(s: dict) -> str:
    tag = " (literal)" if s.get("literal") else ""
    if s.get("max_abs") is None:
        return f"{s['dtype']}{s['shape']}{tag}, nonfinite={s.get('nonfinite', 0)}"
    order = f" min={s['min']:.4g} max={s['max']:.4g}" if s.get("min") is not None else ""
    return (
        f"{s['dtype']}{s['shape']}{tag}{order} "
        f"max|x|={s['max_abs']:.4g} min|x|={s['min_abs']:.4g} nonfinite={s['nonfinite']}"
    )


def _json_safe(d: dict) -> dict:
    return {k: (None if isinstance(v, float) and not np.isfinite(v) else v) for k, v in d.items()}
