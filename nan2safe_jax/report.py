"""The run's record: a JSONL event log, the one-picture dashboard and a summary table.

A trainer writes two append-only files in its workdir:

* ``metrics.jsonl``: one JSON object per logged step (``step``, ``time``, ``loss``, ``risk``,
  ``gear``, ``next_gear``, ``loss_scale``, ``grad_norm``, ``nonfinite``, ``skipped``, ``finite``,
  ``safe_sites``, ``site_gears``).
* ``events.jsonl``: one JSON object per event, always with ``type``, ``step`` and ``time``
  (``downshift``, ``skip``, ``locate``, ``safe_enter``, ``safe_exit``, ``recover``,
  ``checkpoint``, ``resume``, ``transient``, ``polluted_input``, ``error``).

Non-finite floats are written as Python's ``json`` writes them (bare ``NaN`` / ``Infinity``
tokens); the readers also accept the strings ``"NaN"``, ``"Infinity"``, ``"-Infinity"`` in numeric
metric fields. A process killed mid-write can leave a partial last line: the readers skip any line
that does not parse, with a warning, and :class:`EventLog` starts a fresh line when it reopens such
a file, so a resumed run never glues its first record onto the fragment.

Example::

    with EventLog("runs/x") as log:
        log.log_metrics({"step": 0, "loss": 2.3, "risk": 0.0, "gear": 0})
        log.append("downshift", 0, **{"from": 0, "to": 1, "risk": 1.0, "probes": ["attn"]})
    dashboard("runs/x")        # runs/x/dashboard.png
    print_summary("runs/x")
"""

from __future__ import annotations

import dataclasses
import enum
import json
import math
import os
import threading
import time
import warnings
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

__all__ = [
    "EVENTS_FILE",
    "METRICS_FILE",
    "DASHBOARD_FILE",
    "EventLog",
    "read_events",
    "read_metrics",
    "dashboard",
    "summary",
    "print_summary",
    "write_tensorboard",
]

EVENTS_FILE = "events.jsonl"
METRICS_FILE = "metrics.jsonl"
DASHBOARD_FILE = "dashboard.png"

GEAR_NAMES = ("FAST", "STABLE", "SAFE")
MAX_POINTS = 5000  # per plotted series; above this the series is decimated (extremes kept)

# Event type -> (colour, line width, legend label) of its vertical line on the dashboard.
_EVENT_STYLE = {
    "downshift": ("tab:orange", 1.2, "downshift"),
    "locate": ("tab:red", 1.6, "incident located"),
    "recover": ("tab:green", 1.2, "recover"),
    "checkpoint": ("0.7", 0.5, "checkpoint"),
    "resume": ("tab:blue", 1.4, "resume"),
    "transient": ("tab:purple", 1.0, "transient (not reproducible)"),
    "polluted_input": ("tab:brown", 1.2, "polluted input"),
    "error": ("black", 1.2, "error"),
}
_MAX_EVENT_LINES = {"checkpoint": 60}  # per type (default 400); more are thinned evenly
_MAX_SITE_ROWS = 12
_NONFINITE_STRINGS = {
    "nan": math.nan,
    "+nan": math.nan,
    "-nan": math.nan,
    "inf": math.inf,
    "+inf": math.inf,
    "-inf": -math.inf,
    "infinity": math.inf,
    "+infinity": math.inf,
    "-infinity": -math.inf,
}
# Metric fields that may hold a non-finite float written as a string.
_FLOAT_FIELDS = ("loss", "risk", "loss_scale", "grad_norm", "nonfinite", "time")


# ---------------------------------------------------------------------------------------------
# JSON conversion


def _jsonable(obj: Any) -> Any:
    """``obj`` as plain JSON types: NumPy / JAX scalars -> Python, arrays -> (nested) lists.

    Tuples and sets become lists, mapping keys become strings, dataclasses and objects with a
    ``to_dict()`` (e.g. ``replay.Report``) become dicts, enums become their value. Non-finite
    floats stay floats (written as ``NaN`` / ``Infinity``). Anything else becomes ``str(obj)``.
    """
    if obj is None or isinstance(obj, (bool, str)):
        return obj
    if isinstance(obj, enum.Enum):
        return _jsonable(obj.value)
    if isinstance(obj, int):
        return int(obj)
    if isinstance(obj, float):
        return float(obj)
    if isinstance(obj, np.generic):
        return _jsonable(obj.item())
    if isinstance(obj, Mapping):
        return {str(_jsonable(k)): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple, set, frozenset)):
        items = sorted(obj, key=str) if isinstance(obj, (set, frozenset)) else obj
        return [_jsonable(v) for v in items]
    if isinstance(obj, os.PathLike):
        return os.fspath(obj)
    to_dict = getattr(obj, "to_dict", None)
    if callable(to_dict):
        return _jsonable(to_dict())
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: _jsonable(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if hasattr(obj, "__array__"):  # np.ndarray, jax.Array (device -> host copy), ...
        return _jsonable(np.asarray(obj).tolist())
    if isinstance(obj, bytes):
        return obj.decode("utf-8", "replace")
    return str(obj)


def _dumps(record: Mapping[str, Any]) -> str:
    return json.dumps(_jsonable(record), allow_nan=True, separators=(",", ":"))


def _as_float(value: Any) -> float:
    """A metric value as a float: numbers, ``"NaN"``/``"Infinity"`` strings; else NaN."""
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        v = _NONFINITE_STRINGS.get(value.strip().lower())
        if v is not None:
            return v
        try:
            return float(value)
        except ValueError:
            return math.nan
    return math.nan


def _as_int(value: Any, default: int = 0) -> int:
    v = _as_float(value)
    return int(v) if math.isfinite(v) else default


# ---------------------------------------------------------------------------------------------
# reading


def _resolve(workdir: str | os.PathLike, name: str) -> Path:
    """``workdir/name``, or ``workdir`` itself when it is a file."""
    p = Path(workdir)
    return p if p.is_file() else p / name


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    records = []
    with open(path, encoding="utf-8", errors="replace") as f:
        lines = f.read().split("\n")
    last = len(lines) - 1
    while last >= 0 and not lines[last].strip():
        last -= 1
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            where = "truncated last line" if i == last else f"unreadable line {i + 1}"
            warnings.warn(
                f"{path}: skipping {where} ({e.msg}); a killed process can leave one: "
                f"{line[:60]!r}",
                RuntimeWarning,
                stacklevel=3,
            )
            continue
        if isinstance(rec, dict):
            records.append(rec)
        else:
            warnings.warn(
                f"{path}: skipping line {i + 1}: expected a JSON object, got {type(rec).__name__}",
                RuntimeWarning,
                stacklevel=3,
            )
    return records


def read_events(workdir: str | os.PathLike) -> list[dict[str, Any]]:
    """The events of ``workdir/events.jsonl`` in file order; ``[]`` when the file is missing.

    Lines that do not parse (a truncated last line from a killed process) are skipped with a
    ``RuntimeWarning``. ``workdir`` may also be the path of the file itself.
    """
    events = _read_jsonl(_resolve(workdir, EVENTS_FILE))
    for ev in events:
        if "risk" in ev:
            ev["risk"] = _as_float(ev["risk"])
    return events


def read_metrics(workdir: str | os.PathLike) -> list[dict[str, Any]]:
    """The per-step records of ``workdir/metrics.jsonl`` in file order; ``[]`` when missing.

    Float fields written as strings (``"NaN"``, ``"Infinity"``, ``"-Infinity"``) come back as
    floats. Lines that do not parse are skipped with a ``RuntimeWarning``. After a rollback the
    same step can appear more than once; :func:`dashboard` and :func:`summary` keep the last.
    """
    records = _read_jsonl(_resolve(workdir, METRICS_FILE))
    for rec in records:
        for k in _FLOAT_FIELDS:
            if isinstance(rec.get(k), str):
                rec[k] = _as_float(rec[k])
    return records


# ---------------------------------------------------------------------------------------------
# writing


class EventLog:
    """Append-only writer of ``events.jsonl`` and ``metrics.jsonl`` in ``workdir``.

    One file handle per file, opened in append mode at construction (both files are created);
    every line is flushed as it is written, so a crash loses at most the line being written.
    Thread-safe. Use as a context manager or call :meth:`close`.

    Args:
      workdir: the run directory; created if missing.

    Example::

        with EventLog(workdir) as log:
            log.append("locate", 12, report=report, action="site blocks.0.attn -> SAFE")
            log.append("downshift", 7, **{"from": 0, "to": 1, "risk": 1.0, "probes": ["loss"]})
    """

    def __init__(self, workdir: str | os.PathLike):
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._events = self._open(self.workdir / EVENTS_FILE)
        self._metrics = self._open(self.workdir / METRICS_FILE)

    @staticmethod
    def _open(path: Path):
        f = open(path, "a+b")  # held open for the life of the log
        # A killed writer can leave a line without its newline: start a fresh line so the next
        # record is not glued onto the fragment (the reader then skips only the fragment).
        if f.tell() > 0:
            f.seek(-1, os.SEEK_END)
            if f.read(1) != b"\n":
                f.write(b"\n")
                f.flush()
        return f

    @property
    def closed(self) -> bool:
        return self._events.closed

    def _write(self, f, record: Mapping[str, Any]) -> None:
        line = (_dumps(record) + "\n").encode("utf-8")
        with self._lock:
            if f.closed:
                raise ValueError(f"EventLog({str(self.workdir)!r}) is closed; open a new one")
            f.write(line)
            f.flush()

    def append(self, type: str, step: int, **fields: Any) -> dict[str, Any]:
        """Writes one event line and returns the record as written.

        Args:
          type: the event type (``"downshift"``, ``"locate"``, ...).
          step: the training step the event belongs to.
          **fields: the event's fields; ``time`` defaults to now. Pass ``from`` (a Python
            keyword) as ``**{"from": g}``. Values are converted to JSON types (see module doc).
        """
        if not isinstance(type, str) or not type:
            raise ValueError(f"event type must be a non-empty string, got {type!r}")
        record = {"type": type, "step": _jsonable(step), "time": time.time()}
        record.update(fields)
        record = _jsonable(record)
        self._write(self._events, record)
        return record

    def log_metrics(self, record: Mapping[str, Any]) -> None:
        """Writes one metrics line (``time`` defaults to now); values converted to JSON types."""
        if "time" not in record:
            record = {**record, "time": time.time()}
        self._write(self._metrics, record)

    @property
    def events(self) -> list[dict[str, Any]]:
        """Every event in ``events.jsonl`` (including those of earlier runs in this workdir)."""
        return read_events(self.workdir)

    @property
    def metrics(self) -> list[dict[str, Any]]:
        """Every record in ``metrics.jsonl``."""
        return read_metrics(self.workdir)

    def close(self) -> None:
        with self._lock:
            self._events.close()
            self._metrics.close()

    def __enter__(self) -> EventLog:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open"
        return f"EventLog({str(self.workdir)!r}, {state})"


# ---------------------------------------------------------------------------------------------
# shared analysis


@dataclasses.dataclass
class _Run:
    """Metrics as arrays (one entry per step, last record of a step wins) plus the events."""

    workdir: Path
    raw: list[dict[str, Any]]  # metrics.jsonl in file order, including re-runs of a step
    records: list[dict[str, Any]]  # deduplicated (last record of a step wins), sorted by step
    events: list[dict[str, Any]]
    step: np.ndarray  # i64[n]
    loss: np.ndarray  # f64[n]
    risk: np.ndarray  # f64[n]
    gear: np.ndarray  # i64[n]
    skipped: np.ndarray  # bool[n]


def _load(workdir: str | os.PathLike) -> _Run:
    wd = Path(workdir)
    raw = read_metrics(wd)
    by_step: dict[int, dict[str, Any]] = {}
    for rec in raw:
        try:
            by_step[int(rec["step"])] = rec
        except (KeyError, TypeError, ValueError):
            continue
    records = [by_step[s] for s in sorted(by_step)]
    n = len(records)
    step = np.fromiter((int(r["step"]) for r in records), np.int64, n)
    loss = np.fromiter((_as_float(r.get("loss")) for r in records), np.float64, n)
    risk = np.fromiter((_as_float(r.get("risk", 0.0)) for r in records), np.float64, n)
    gear = np.fromiter((_as_int(r.get("gear", 0)) for r in records), np.int64, n)
    skipped = np.fromiter((bool(r.get("skipped", False)) for r in records), bool, n)
    events = [e for e in read_events(wd) if isinstance(e.get("step"), (int, float))]
    return _Run(wd, raw, records, events, step, loss, risk, gear, skipped)


def _report_of(event: Mapping[str, Any]) -> dict[str, Any]:
    rep = event.get("report")
    return rep if isinstance(rep, dict) else {}


def _incident_label(event: Mapping[str, Any]) -> str:
    """``"blocks.1.attn: div (0/0)"`` for a locate event; shorter forms when fields are missing."""
    rep = _report_of(event)
    diagnosis = rep.get("diagnosis")
    if rep.get("reproducible") is False:
        return "not reproducible"
    if diagnosis == "polluted input":
        return f"polluted input {rep.get('input_path') or ''}".rstrip()
    where = rep.get("site") or rep.get("name_stack") or rep.get("source") or "?"
    prim = rep.get("primitive") or "?"
    detail = [d for d in (diagnosis,) if d]
    if rep.get("direction") == "backward":
        detail.append("backward")
    return f"{where}: {prim}" + (f" ({', '.join(detail)})" if detail else "")


def _max_gear(g: Any) -> int:
    """The highest gear in a ``site_gears`` value: an int or (nested) list of ints."""
    if isinstance(g, list):
        if not g:
            return 0
        if isinstance(g[0], list):
            return max(_max_gear(v) for v in g)
        try:
            m = max(g)
        except TypeError:  # mixed contents
            return max(_max_gear(v) for v in g)
        return _max_gear(m)
    if isinstance(g, (int, float)) and not isinstance(g, bool):
        return int(g) if math.isfinite(g) else 0
    return 0


def _site_rows(run: _Run) -> dict[str, list[tuple[float, float]]]:
    """Per site that entered SAFE: the ``(start, width)`` step intervals it spent in SAFE.

    Metrics are the source (``safe_sites``; ``site_gears`` when a record has no ``safe_sites``);
    sites known only from ``safe_enter`` / ``safe_exit`` events get intervals from those.
    """
    rows: dict[str, list[tuple[float, float]]] = {}
    steps = run.step
    open_: dict[str, int] = {}
    for i, rec in enumerate(run.records):
        in_safe = set()
        for s in rec.get("safe_sites") or ():
            in_safe.add(str(s))
        if "safe_sites" not in rec:  # the trainer's own list wins; else derive it
            for s, g in (rec.get("site_gears") or {}).items():
                if _max_gear(g) >= 2:
                    in_safe.add(str(s))
        for s in in_safe:
            open_.setdefault(s, i)
        for s in [s for s in open_ if s not in in_safe]:
            a = open_.pop(s)
            rows.setdefault(s, []).append((float(steps[a]), float(steps[i] - steps[a])))
    for s, a in open_.items():
        rows.setdefault(s, []).append((float(steps[a]), float(steps[-1] - steps[a] + 1)))

    last = float(steps[-1]) + 1 if len(steps) else None
    from_events: dict[str, list[tuple[float, float]]] = {}
    entered: dict[str, dict[str, Any]] = {}
    for ev in sorted(run.events, key=lambda e: e["step"]):
        site = ev.get("site")
        if site is None:
            continue
        site = str(site)
        if ev.get("type") == "safe_enter":
            entered[site] = ev
        elif ev.get("type") == "safe_exit" and site in entered:
            a = float(entered.pop(site)["step"])
            from_events.setdefault(site, []).append((a, max(float(ev["step"]) - a, 1.0)))
    for site, ev in entered.items():
        a = float(ev["step"])
        end = a + float(ev["steps"]) if isinstance(ev.get("steps"), (int, float)) else last
        end = a + 1.0 if end is None else end
        from_events.setdefault(site, []).append((a, max(end - a, 1.0)))
    for site, iv in from_events.items():
        rows.setdefault(site, iv)
    return rows


def _decimate(y: np.ndarray, max_points: int = MAX_POINTS) -> np.ndarray:
    """Indices of ``y`` to plot: all when short, else each bucket's min and max (spikes kept)."""
    n = len(y)
    if n <= max_points:
        return np.arange(n)
    edges = np.linspace(0, n, max_points // 2 + 1).astype(np.int64)
    keep = [0, n - 1]
    yf = np.where(np.isfinite(y), y, np.nan)
    for a, b in zip(edges[:-1], edges[1:], strict=True):
        seg = yf[a:b]
        ok = ~np.isnan(seg)
        if not ok.any():
            keep.append(a)
            continue
        idx = np.flatnonzero(ok)
        keep.append(a + idx[np.argmin(seg[ok])])
        keep.append(a + idx[np.argmax(seg[ok])])
    return np.unique(np.asarray(keep, np.int64))


def _decimate_steps(g: np.ndarray, max_points: int = MAX_POINTS) -> np.ndarray:
    """Indices of a step signal to plot: every change point, plus an even stride."""
    n = len(g)
    if n <= max_points:
        return np.arange(n)
    change = np.flatnonzero(np.diff(g) != 0) + 1
    stride = np.linspace(0, n - 1, max_points // 2).astype(np.int64)
    return np.unique(np.concatenate([[0, n - 1], change, change - 1, stride]))


# ---------------------------------------------------------------------------------------------
# summary


def _median_step_seconds(records: list[dict[str, Any]]) -> float | None:
    """Median of (time difference / step difference) over consecutive records going forward."""
    rates = []
    prev = None
    for rec in records:
        t, s = _as_float(rec.get("time")), rec.get("step")
        if not isinstance(s, (int, float)) or not math.isfinite(t):
            prev = None
            continue
        if prev is not None and s > prev[0] and t > prev[1]:
            rates.append((t - prev[1]) / (s - prev[0]))
        prev = (s, t)
    return float(np.median(rates)) if rates else None


def summary(workdir: str | os.PathLike) -> dict[str, Any]:
    """Counts and headline numbers of a run, from its ``metrics.jsonl`` and ``events.jsonl``.

    Returns:
      A dict with ``steps`` (distinct steps logged), ``records`` (metric lines, including steps
      re-run after a rollback), ``first_step``, ``last_step``, ``final_loss``, ``min_loss``
      (finite only), ``nonfinite_losses``, ``skipped`` (steps whose update was skipped, from the
      metrics, or from ``skip`` events when metrics carry no ``skipped`` field),
      ``skip_reasons``, ``downshifts``, ``incidents`` (one dict per ``locate`` event: step, site,
      primitive, diagnosis, direction, kind, source, action, replays, seconds, reproducible,
      label), ``incidents_located``, ``safe_entries``, ``safe_sites``, ``safe_exits``,
      ``recoveries``, ``checkpoints``, ``resumes``, ``transients``, ``polluted_inputs``,
      ``errors``, ``final_gear``, ``seconds_per_step`` (median) and ``wall_seconds``.
    """
    return _summarize(_load(workdir))


def _summarize(run: _Run) -> dict[str, Any]:
    raw, events = run.raw, run.events

    def count(t: str) -> int:
        return sum(1 for e in events if e.get("type") == t)

    finite = run.loss[np.isfinite(run.loss)]
    skip_events = [e for e in events if e.get("type") == "skip"]
    reasons: dict[str, int] = {}
    for e in skip_events:
        r = str(e.get("reason", "?"))
        reasons[r] = reasons.get(r, 0) + 1
    has_skip_field = any("skipped" in r for r in run.records)
    incidents = []
    for e in events:
        if e.get("type") != "locate":
            continue
        rep = _report_of(e)
        incidents.append(
            {
                "step": e.get("step"),
                "site": rep.get("site"),
                "primitive": rep.get("primitive"),
                "diagnosis": rep.get("diagnosis"),
                "direction": rep.get("direction"),
                "kind": rep.get("kind"),
                "source": rep.get("source"),
                "action": e.get("action"),
                "replays": rep.get("replays"),
                "seconds": rep.get("seconds"),
                "reproducible": rep.get("reproducible", True),
                "label": _incident_label(e),
            }
        )
    times = [t for t in (_as_float(r.get("time")) for r in raw) if math.isfinite(t)]
    safe_sites = sorted({str(e["site"]) for e in events if e.get("type") == "safe_enter"})
    return {
        "workdir": str(run.workdir),
        "steps": len(run.records),
        "records": len(raw),
        "first_step": int(run.step[0]) if len(run.step) else None,
        "last_step": int(run.step[-1]) if len(run.step) else None,
        "final_loss": float(run.loss[-1]) if len(run.loss) else None,
        "min_loss": float(finite.min()) if len(finite) else None,
        "nonfinite_losses": int((~np.isfinite(run.loss)).sum()),
        "skipped": int(run.skipped.sum()) if has_skip_field else len(skip_events),
        "skip_reasons": reasons,
        "downshifts": count("downshift"),
        "incidents_located": len(incidents),
        "incidents": incidents,
        "safe_entries": count("safe_enter"),
        "safe_sites": safe_sites,
        "safe_exits": count("safe_exit"),
        "recoveries": count("recover"),
        "checkpoints": count("checkpoint"),
        "resumes": count("resume"),
        "transients": count("transient"),
        "polluted_inputs": count("polluted_input"),
        "errors": count("error"),
        "final_gear": int(run.gear[-1]) if len(run.gear) else None,
        "seconds_per_step": _median_step_seconds(raw),
        "wall_seconds": (max(times) - min(times)) if len(times) > 1 else None,
    }


def _fmt(x: Any, spec: str = ".4g") -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return format(x, spec)
    return str(x)


def print_summary(workdir: str | os.PathLike, console=None) -> dict[str, Any]:
    """Prints :func:`summary` as rich tables (headline numbers, then one row per incident).

    Args:
      workdir: the run directory.
      console: a ``rich.console.Console``; a new one on stdout when None.

    Returns:
      The summary dict.
    """
    from rich.console import Console
    from rich.table import Table

    console = Console() if console is None else console
    s = summary(workdir)
    t = Table(title=f"nan2safe run: {Path(workdir).name}", show_header=False, title_justify="left")
    t.add_column("what", style="bold")
    t.add_column("value", justify="right")
    steps = f"{s['steps']}"
    if s["records"] != s["steps"]:
        steps += f" ({s['records'] - s['steps']} re-run after rollback)"
    if s["first_step"] is not None:
        steps += f"  [{s['first_step']}..{s['last_step']}]"
    t.add_row("steps run", steps)
    t.add_row("final loss", _fmt(s["final_loss"]))
    t.add_row("min loss", _fmt(s["min_loss"]))
    t.add_row("non-finite losses", str(s["nonfinite_losses"]))
    reasons = ", ".join(f"{k} {v}" for k, v in sorted(s["skip_reasons"].items()))
    t.add_row("skipped steps", f"{s['skipped']}" + (f" ({reasons})" if reasons else ""))
    t.add_row("downshifts", str(s["downshifts"]))
    t.add_row("incidents located", str(s["incidents_located"]))
    sites = ", ".join(s["safe_sites"])
    t.add_row("SAFE entries", f"{s['safe_entries']}" + (f" ({sites})" if sites else ""))
    t.add_row("recoveries", str(s["recoveries"]))
    t.add_row("checkpoints", str(s["checkpoints"]))
    if s["resumes"]:
        t.add_row("resumes", str(s["resumes"]))
    extra = (
        ("transients", "transient (not reproduced)"),
        ("polluted_inputs", "polluted inputs"),
        ("errors", "errors"),
    )
    for key, label in extra:
        if s[key]:
            t.add_row(label, str(s[key]))
    if s["final_gear"] is not None:
        g = s["final_gear"]
        t.add_row("final gear", GEAR_NAMES[g] if 0 <= g < len(GEAR_NAMES) else str(g))
    sps = s["seconds_per_step"]
    t.add_row("time per step (median)", "-" if sps is None else f"{sps * 1e3:.1f} ms")
    if s["wall_seconds"] is not None:
        t.add_row("wall time", f"{s['wall_seconds']:.1f} s")
    console.print(t)

    if s["incidents"]:
        it = Table(title="incidents", title_justify="left")
        for col in ("step", "site", "primitive", "diagnosis", "pass", "source", "replays", "s"):
            right = col in ("step", "replays", "s")
            it.add_column(col, justify="right" if right else "left", overflow="fold")
        for inc in s["incidents"]:
            diag = inc["diagnosis"] or "-"
            if inc["reproducible"] is False:
                diag = "not reproducible"
            it.add_row(
                _fmt(inc["step"]),
                _fmt(inc["site"]),
                _fmt(inc["primitive"]),
                diag,
                _fmt(inc["direction"]),
                _fmt(_short_source(inc["source"])),
                _fmt(inc["replays"]),
                _fmt(inc["seconds"], ".2f"),
            )
        console.print(it)
    return s


# ---------------------------------------------------------------------------------------------
# dashboard


def _plural(n: int, one: str, many: str | None = None) -> str:
    return f"{n} {one if n == 1 else (many or one + 's')}"


def _summary_line(s: Mapping[str, Any]) -> str:
    parts = [_plural(s["steps"], "step")]
    if s["final_loss"] is not None:
        parts.append(f"final loss {_fmt(s['final_loss'])}")
    parts.append(f"{s['skipped']} skipped")
    parts.append(_plural(s["downshifts"], "downshift"))
    parts.append(_plural(s["incidents_located"], "incident") + " located")
    parts.append(_plural(s["safe_entries"], "SAFE entry", "SAFE entries"))
    parts.append(_plural(s["recoveries"], "recovery", "recoveries"))
    if s["seconds_per_step"] is not None:
        parts.append(f"{s['seconds_per_step'] * 1e3:.1f} ms/step")
    return " · ".join(parts)


def _event_steps(events: Iterable[Mapping[str, Any]], type_: str) -> np.ndarray:
    x = np.asarray([float(e["step"]) for e in events if e.get("type") == type_], np.float64)
    most = _MAX_EVENT_LINES.get(type_, 400)
    if len(x) > most:
        x = x[np.linspace(0, len(x) - 1, most).astype(np.int64)]
    return x


def _plain_log_formatter(**kwargs):
    """A ``LogFormatter`` that keeps matplotlib's choice of labelled ticks, printed with ``%g``."""
    from matplotlib.ticker import LogFormatter

    class PlainLogFormatter(LogFormatter):
        def __call__(self, x, pos=None):
            return f"{x:g}" if super().__call__(x, pos) else ""

    return PlainLogFormatter(**kwargs)


def _figure(workdir: str | os.PathLike):
    """The dashboard as a ``matplotlib.figure.Figure`` (not saved; no pyplot, no display).

    Three panels on one shared step axis: loss, risk score, gear timeline (global gear plus one
    row per site that entered SAFE). Events are vertical lines across all panels.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D
    from matplotlib.ticker import MaxNLocator

    run = _load(workdir)
    s = _summarize(run)
    sites = _site_rows(run)
    site_names = sorted(sites, key=lambda k: (min(a for a, _ in sites[k]), k))
    hidden_sites = max(len(site_names) - _MAX_SITE_ROWS, 0)
    site_names = site_names[:_MAX_SITE_ROWS]

    gear_h = 1.6 + 0.28 * len(site_names)
    fig = Figure(figsize=(13.5, 7.0 + 0.28 * len(site_names)), layout="constrained")
    FigureCanvasAgg(fig)
    ax_loss, ax_risk, ax_gear = fig.subplots(
        3, 1, sharex=True, gridspec_kw={"height_ratios": [3.0, 1.6, gear_h]}
    )
    title = f"nan2safe — {run.workdir.resolve().name or run.workdir}"
    fig.suptitle(f"{title}\n{_summary_line(s)}", fontsize=11)

    step = run.step.astype(np.float64)
    n = len(step)

    # (1) loss
    finite = np.isfinite(run.loss)
    positive = bool(finite.any() and (run.loss[finite] > 0).all())
    if n:
        idx = _decimate(run.loss)
        y = np.where(finite, run.loss, np.nan)[idx]
        ax_loss.plot(step[idx], y, color="tab:blue", lw=1.0, marker="." if n == 1 else None)
        if positive:
            ax_loss.set_yscale("log")
            # plain numbers ("0.6", "3") instead of 6e-01 / 3x10^0 on a 1-2 decade loss range
            ax_loss.yaxis.set_major_formatter(_plain_log_formatter())
            ax_loss.yaxis.set_minor_formatter(
                _plain_log_formatter(labelOnlyBase=False, minor_thresholds=(2, 0.5))
            )
        bad = step[~finite]
        if len(bad):
            ax_loss.plot(
                bad,
                np.full(len(bad), 0.96),
                "x",
                color="red",
                ms=7,
                mew=1.8,
                transform=ax_loss.get_xaxis_transform(),
                clip_on=False,
                label="non-finite loss",
                zorder=5,
            )
        skipped_ok = step[run.skipped & finite]
        if len(skipped_ok):
            ax_loss.plot(
                skipped_ok,
                np.full(len(skipped_ok), 0.03),
                "|",
                color="0.35",
                ms=8,
                transform=ax_loss.get_xaxis_transform(),
                label="skipped update",
                zorder=4,
            )
    else:
        ax_loss.text(
            0.5, 0.5, "no metrics logged", ha="center", va="center", transform=ax_loss.transAxes
        )
    ax_loss.set_ylabel("loss" + (" (log)" if positive else ""))

    # (2) risk
    if n:
        idx = _decimate(run.risk)
        ax_risk.plot(step[idx], run.risk[idx], color="tab:purple", lw=1.0, drawstyle="steps-post")
        if n == 1:
            ax_risk.plot(step, run.risk, ".", color="tab:purple")
    ax_risk.axhline(1.0, color="red", ls="--", lw=0.9)
    ax_risk.text(
        0.002,
        1.0,
        " trigger",
        color="red",
        fontsize=8,
        va="bottom",
        transform=ax_risk.get_yaxis_transform(),
    )
    ax_risk.set_ylim(-0.05, 1.15)
    ax_risk.set_yticks([0.0, 0.5, 1.0])
    ax_risk.set_ylabel("risk")

    # (3) gear timeline: global gear at y = 0..2, one row per SAFE site below it
    if n:
        idx = _decimate_steps(run.gear)
        xs, gs = step[idx], run.gear[idx].astype(np.float64)
        xs, gs = np.append(xs, xs[-1] + 1), np.append(gs, gs[-1])  # step s spans [s, s + 1)
        ax_gear.fill_between(xs, 0, gs, step="post", color="tab:orange", alpha=0.15, lw=0)
        ax_gear.step(xs, gs, where="post", color="tab:orange", lw=1.6, label="global gear")
    yticks, ylabels = [0, 1, 2], list(GEAR_NAMES)
    for j, site in enumerate(site_names):
        y = -1.0 - j
        ax_gear.broken_barh(sites[site], (y - 0.35, 0.7), facecolors="tab:red", alpha=0.8)
        # a marker at each entry, so a stay of a few steps in a long run still shows
        starts = [a for a, _ in sites[site]]
        ax_gear.plot(starts, [y] * len(starts), "|", color="tab:red", ms=12, mew=2.0)
        yticks.append(y)
        ylabels.append(site)
    if hidden_sites:
        ylabels[-1] += f" (+{hidden_sites} more)"
    if site_names:
        ax_gear.axhline(-0.5, color="0.5", lw=0.6)
        ax_gear.text(
            0.002,
            -0.5,
            " sites in SAFE",
            fontsize=8,
            color="0.3",
            va="top",
            transform=ax_gear.get_yaxis_transform(),
        )
    ax_gear.set_yticks(yticks, ylabels, fontsize=8)
    ax_gear.set_ylim(-0.6 - len(site_names), 2.5)
    ax_gear.set_ylabel("gear")
    ax_gear.set_xlabel("step")

    # events: vertical lines across all panels
    handles = []
    for type_, (color, lw, label) in _EVENT_STYLE.items():
        x = _event_steps(run.events, type_)
        if not len(x):
            continue
        for ax in (ax_loss, ax_risk, ax_gear):
            ax.vlines(x, 0, 1, transform=ax.get_xaxis_transform(), colors=color, lw=lw, alpha=0.75)
        handles.append(Line2D([], [], color=color, lw=max(lw, 1.0), label=label))
    for e in run.events:
        if e.get("type") != "locate":
            continue
        ax_loss.annotate(
            _incident_label(e),
            xy=(float(e["step"]), 0.9),
            xycoords=ax_loss.get_xaxis_transform(),
            xytext=(-3, 0),
            textcoords="offset points",
            rotation=90,
            ha="right",
            va="top",
            fontsize=8,
            color="darkred",
            bbox={"boxstyle": "round,pad=0.15", "fc": "white", "ec": "none", "alpha": 0.75},
            zorder=6,
        )

    if n:
        lo, hi = float(step[0]), float(step[-1]) + 1
    else:
        ev = [float(e["step"]) for e in run.events]
        lo, hi = (min(ev), max(ev) + 1) if ev else (0.0, 1.0)
    ev_steps = [float(e["step"]) for e in run.events]
    if ev_steps:
        lo, hi = min(lo, min(ev_steps)), max(hi, max(ev_steps) + 1)
    pad = max((hi - lo) * 0.01, 0.5)
    ax_gear.set_xlim(lo - pad, hi + pad)
    ax_gear.xaxis.set_major_locator(MaxNLocator(integer=True))

    own, own_labels = ax_loss.get_legend_handles_labels()
    if own or handles:
        fig.legend(
            own + handles,
            own_labels + [h.get_label() for h in handles],
            loc="outside right upper",
            fontsize=8,
            frameon=False,
        )
    for ax in (ax_loss, ax_risk, ax_gear):
        ax.grid(True, axis="y", alpha=0.25)
    return fig


def dashboard(workdir: str | os.PathLike, path: str | os.PathLike | None = None) -> Path:
    """Draws the run's dashboard to ``path`` (default ``workdir/dashboard.png``).

    Three panels on a shared step axis: (1) loss, log scale when every finite loss is positive,
    non-finite losses as red crosses at the top; (2) the tier-1 risk score with the trigger line
    at 1.0; (3) the global gear (FAST / STABLE / SAFE) and one row per site that entered SAFE.
    Events are vertical lines across all panels (downshift orange, locate red with the culprit
    ``site: primitive (diagnosis)``, recover green, checkpoint grey, resume blue). Series longer
    than 5000 points are decimated keeping each bucket's extremes and every gear change.

    Raises:
      FileNotFoundError: when ``workdir`` does not exist.
    """
    wd = Path(workdir)
    if not wd.is_dir():
        raise FileNotFoundError(
            f"run directory {str(wd)!r} does not exist; pass the Trainer's workdir"
        )
    out = Path(path) if path is not None else wd / DASHBOARD_FILE
    out.parent.mkdir(parents=True, exist_ok=True)
    fig = _figure(wd)
    fig.savefig(out, dpi=110)
    return out


# ---------------------------------------------------------------------------------------------
# TensorBoard (optional)


def write_tensorboard(workdir: str | os.PathLike, logdir: str | os.PathLike | None = None) -> bool:
    """Writes the run's scalars and events for TensorBoard, if ``tensorboardX`` is installed.

    Scalars ``loss``, ``risk``, ``gear``, ``loss_scale``, ``grad_norm``, ``nonfinite`` per step
    (finite values only) and each event as text under ``events/<type>``.

    Args:
      workdir: the run directory.
      logdir: where to write; default ``workdir/tensorboard``.

    Returns:
      True when written; False when ``tensorboardX`` is not importable (nothing is written).
    """
    try:
        from tensorboardX import SummaryWriter
    except ImportError:
        return False
    wd = Path(workdir)
    run = _load(wd)
    writer = SummaryWriter(str(Path(logdir) if logdir is not None else wd / "tensorboard"))
    try:
        for rec in run.records:
            st = int(rec["step"])
            for key in ("loss", "risk", "gear", "loss_scale", "grad_norm", "nonfinite"):
                if key in rec:
                    v = _as_float(rec[key])
                    if math.isfinite(v):
                        writer.add_scalar(key, v, st)
        for e in run.events:
            fields = {k: v for k, v in e.items() if k not in ("type", "step", "time")}
            writer.add_text(f"events/{e.get('type', '?')}", json.dumps(fields), int(e["step"]))
    finally:
        writer.close()
    return True


def _short_source(source):
    """``/long/path/to/file.py:123`` -> ``file.py:123`` (the table is narrow)."""
    if not source:
        return source
    return str(source).replace("\\", "/").rsplit("/", 1)[-1]
