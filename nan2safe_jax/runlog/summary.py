"""Run analysis and the summary table: counts and headline numbers of a run."""

from __future__ import annotations

import dataclasses
import math
import os
from collections import Counter
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from nan2safe_jax.runlog.events import _as_float, _as_int, read_events, read_metrics

GEAR_NAMES = ("FAST", "STABLE", "SAFE")


@dataclasses.dataclass
class _Run:
    """Metrics as arrays (one entry per step, last record of a step wins) plus the events."""

    workdir: Path
    raw: list[dict[str, Any]]  # metrics.jsonl in file order, including re-runs of a step
    records: list[dict[str, Any]]  # deduplicated (last record of a step wins), sorted by step
    events: list[dict[str, Any]]  # without ``lost``
    lost: list[dict[str, Any]]  # events of work a resume lost (``split_lost``)
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
    events, lost = split_lost(
        [e for e in read_events(wd) if isinstance(e.get("step"), (int, float))]
    )
    return _Run(wd, raw, records, events, lost, step, loss, risk, gear, skipped)


def split_lost(events: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Splits ``events`` (file order) into those that stand and those of work a resume re-ran.

    A run killed after checkpoint ``R`` resumes from it and runs steps ``R, R+1, ...`` again:
    what the killed process logged for those steps (an incident, its downshift, a checkpoint
    whose save may never have finished) is logged again by the run that resumed. Counted
    twice, one fault read as two. An event logged before a ``resume`` at step ``R``, at step
    ``R`` or later (a checkpoint: after ``R``, since checkpoint ``R`` is the one resumed from),
    that the resumed run logs again (same type, same step) is that re-run work. One the resumed
    run does not log again stands: a run reopened only to be read (a ``resume`` at its newest
    checkpoint, nothing trained after it) re-ran nothing.

    Returns:
      ``(standing, lost)``, each in file order.
    """
    resumes = [
        (lambda j, i=i: j - i, e["step"]) for i, e in enumerate(events) if e.get("type") == "resume"
    ]

    def counts(x: dict, r: int) -> bool:
        kind = x.get("type")
        if kind == "resume":  # each start stands, one after another at one step too
            return False
        return x["step"] > r or (x["step"] == r and kind != "checkpoint")

    lost = _ran_again(events, resumes, lambda x: (x.get("type"), x["step"]), counts)
    standing = [e for i, e in enumerate(events) if i not in lost]
    return standing, [e for i, e in enumerate(events) if i in lost]


def _ran_again(
    items: list[dict],
    resumes: list[tuple[Callable[[int], float], int]],
    key: Callable[[dict], Any],
    counts: Callable[[dict, int], bool],
) -> set[int]:
    """Indices of ``items`` that a resume ran again. For each resume ``(side, R)``
    (``side(i)``: below 0 for an item logged before it, above 0 for one after), an item logged
    before it that ``counts(item, R)`` (its step is ``R`` or later) and whose ``key`` an item
    logged after it has again is re-run work."""
    lost: set[int] = set()
    for side, r in resumes:
        again = {key(x) for i, x in enumerate(items) if side(i) > 0}
        lost |= {i for i, x in enumerate(items) if side(i) < 0 and counts(x, r) and key(x) in again}
    return lost


def _report_of(event: Mapping[str, Any]) -> dict[str, Any]:
    rep = event.get("report")
    return rep if isinstance(rep, dict) else {}


def _incident_label(event: Mapping[str, Any]) -> str:
    """``"blocks.1.attn: div (0/0)"`` for a locate event; shorter forms when fields are missing."""
    rep = _report_of(event)
    diagnosis = rep.get("diagnosis")
    if rep.get("reproducible") is False:
        return "not reproducible"
    if diagnosis in ("polluted input", "damaged state"):
        return f"{diagnosis} {rep.get('input_path') or ''}".rstrip()
    where = rep.get("site") or rep.get("name_stack") or rep.get("source") or "?"
    prim = rep.get("primitive") or "?"
    detail = [d for d in (diagnosis,) if d]
    if rep.get("direction") == "backward":
        detail.append("backward")
    return f"{where}: {prim}" + (f" ({', '.join(detail)})" if detail else "")


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
      (finite only), ``nonfinite_losses`` and ``skipped`` (over every logged run of a step,
      a step re-run after a rollback included; ``skipped`` from ``skip`` events when metrics
      carry no ``skipped`` field),
      ``skip_reasons``, ``downshifts``, ``incidents`` (one dict per ``locate`` event: step, site,
      primitive, diagnosis, direction, kind, source, user_source (the model line that called
      a built-in site, whose own ``source`` is a library line), action, replays, seconds,
      reproducible, label), ``incidents_located``, ``safe_entries``, ``safe_sites``, ``safe_exits``,
      ``recoveries``, ``checkpoints`` (written; ``checkpoints_failed``: saves that failed),
      ``resumes``, ``rollbacks``, ``transients``,
      ``polluted_inputs``, ``errors``, ``final_gear``, ``seconds_per_step`` (median) and
      ``wall_seconds``. Events of steps a resume ran again are not counted: ``lost_to_resume``
      counts them by type (``split_lost``).
    """
    return _summarize(_load(workdir))


def _step_runs(raw: list[dict], events: list[dict]) -> list[dict]:
    """The metric records that each stand for one run of a step. A run killed and resumed from
    checkpoint ``R`` logs steps ``R, R+1, ...`` again (newuser37: one skipped step counted as
    two): a record logged before a ``resume`` event at step ``R`` (by ``time``), for step ``R``
    or later, whose step the resumed run logs again, is that re-run work. A rollback runs its
    steps again on purpose, and each run counts."""
    times = [_as_float(x.get("time")) for x in raw]
    resumes = [
        (lambda j, t_r=float(e["time"]): times[j] - t_r, int(e["step"]))
        for e in events
        if e.get("type") == "resume" and isinstance(e.get("time"), (int, float))
    ]

    def counts(x: dict, r: int) -> bool:
        return isinstance(x.get("step"), (int, float)) and x["step"] >= r

    lost = _ran_again(raw, resumes, lambda x: x.get("step"), counts)
    return [x for i, x in enumerate(raw) if i not in lost]


def _failed_saves(events: list[dict]) -> list[dict]:
    """The ``checkpoint`` events whose write failed: each one the last logged for its step
    before an ``error`` event naming that step's checkpoint (``failed_checkpoint``). The event
    is logged once the save has started; a failure known then logs no ``checkpoint`` event, one
    found when the write is waited for comes after it."""
    last: dict[Any, dict] = {}
    failed: list[dict] = []
    for e in events:
        if e.get("type") == "checkpoint":
            last[e.get("step")] = e
        elif e.get("type") == "error" and e.get("failed_checkpoint") is not None:
            hit = last.pop(e["failed_checkpoint"], None)
            if hit is not None:
                failed.append(hit)
    return failed


def _summarize(run: _Run) -> dict[str, Any]:
    raw, events = run.raw, run.events

    def count(t: str) -> int:
        return sum(1 for e in events if e.get("type") == t)

    failed_saves = _failed_saves(events)
    finite = run.loss[np.isfinite(run.loss)]
    skip_events = [e for e in events if e.get("type") == "skip"]
    reasons = dict(Counter(str(e.get("reason", "?")) for e in skip_events))
    has_skip_field = any("skipped" in r for r in run.records)
    # Counted over every record, not only the last of each step: a step re-run after a
    # rollback was skipped (and its loss non-finite) the first time all the same.
    runs = _step_runs(raw, events + run.lost)
    skipped_runs = sum(1 for r in runs if bool(r.get("skipped", False)))
    nonfinite_runs = sum(1 for r in runs if not math.isfinite(_as_float(r.get("loss"))))
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
                "user_source": rep.get("user_source"),
                "action": e.get("action"),
                "replays": rep.get("replays"),
                "seconds": rep.get("seconds"),
                "reproducible": rep.get("reproducible", True),
                "label": _incident_label(e),
            }
        )
    times = [t for t in (_as_float(r.get("time")) for r in raw) if math.isfinite(t)]
    # The newest record written, not the highest step's: a run resumed from checkpoint R that
    # ended before the killed one's last step has its own last loss and gear (newuser40 read
    # the killed run's SAFE step as the final gear).
    last = next((r for r in reversed(raw) if isinstance(r.get("step"), (int, float))), None)
    safe_sites = sorted(
        {
            "global" if e.get("site") is None else str(e["site"])
            for e in events
            if e.get("type") == "safe_enter"
        }
    )
    return {
        "workdir": str(run.workdir),
        "steps": len(run.records),
        "records": len(raw),
        "first_step": int(run.step[0]) if len(run.step) else None,
        "last_step": int(run.step[-1]) if len(run.step) else None,
        "final_loss": None if last is None else _as_float(last.get("loss")),
        "min_loss": float(finite.min()) if len(finite) else None,
        "nonfinite_losses": nonfinite_runs,
        "skipped": skipped_runs if has_skip_field else len(skip_events),
        "skip_reasons": reasons,
        "downshifts": count("downshift"),
        "incidents_located": len(incidents),
        "incidents": incidents,
        "safe_entries": count("safe_enter"),
        "safe_sites": safe_sites,
        "safe_exits": count("safe_exit"),
        "recoveries": count("recover"),
        "checkpoints": count("checkpoint") - len(failed_saves),
        "checkpoints_failed": sum(
            1 for e in events if e.get("type") == "error" and e.get("failed_checkpoint") is not None
        ),
        "resumes": count("resume"),
        "rollbacks": count("rollback"),
        "rollback_causes": dict(
            Counter(str(e.get("cause")) for e in events if e.get("type") == "rollback")
        ),
        "rollback_skipped_batches": sum(
            int(e.get("skipped_batches") or 0) for e in events if e.get("type") == "rollback"
        ),
        "spikes": count("spike"),
        "transients": count("transient"),
        "polluted_inputs": count("polluted_input"),
        "errors": count("error"),
        "lost_to_resume": dict(Counter(str(e.get("type")) for e in run.lost)),
        "final_gear": None if last is None else _as_int(last.get("gear", 0)),
        "seconds_per_step": _median_step_seconds(raw),
        "wall_seconds": _wall_seconds(times, events),
    }


def _wall_seconds(times: list[float], events: list[dict]) -> float | None:
    """The time the run's processes spent logging: each process's span (the records between
    two ``resume`` events, by time), summed, without the gaps between a kill and its resume."""
    if len(times) < 2:
        return None
    cuts = sorted(
        float(e["time"])
        for e in events
        if e.get("type") == "resume" and isinstance(e.get("time"), (int, float))
    )
    spans: dict[int, list[float]] = {}
    for t in times:
        spans.setdefault(int(np.searchsorted(cuts, t)), []).append(t)
    return sum(max(ts) - min(ts) for ts in spans.values())


def _counted(counts: Mapping[str, int]) -> str:
    """``{"a": 2, "b": 1}`` as ``"a 2, b 1"``, in key order."""
    return ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))


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
        why = [w for w, n in (("a rollback", s["rollbacks"]), ("a resume", s["resumes"])) if n]
        steps += f" ({s['records'] - s['steps']} re-run after {' or '.join(why) or 'a restart'})"
    if s["first_step"] is not None:
        steps += f"  [{s['first_step']}..{s['last_step']}]"
    t.add_row("steps run", steps)
    t.add_row("final loss", _fmt(s["final_loss"]))
    t.add_row("min loss", _fmt(s["min_loss"]))
    t.add_row("non-finite losses", str(s["nonfinite_losses"]))
    reasons = _counted(s["skip_reasons"])
    t.add_row("skipped steps", f"{s['skipped']}" + (f" ({reasons})" if reasons else ""))
    t.add_row("downshifts", str(s["downshifts"]))
    t.add_row("incidents located", str(s["incidents_located"]))
    sites = ", ".join(s["safe_sites"])
    t.add_row("SAFE entries", f"{s['safe_entries']}" + (f" ({sites})" if sites else ""))
    t.add_row("recoveries", str(s["recoveries"]))
    failed = s.get("checkpoints_failed", 0)
    t.add_row("checkpoints", str(s["checkpoints"]) + (f" ({failed} more failed)" if failed else ""))
    if s["resumes"]:
        t.add_row("resumes", str(s["resumes"]))
    if s["spikes"]:
        t.add_row("loss spikes", str(s["spikes"]))
    if s["rollbacks"]:
        dropped = s["rollback_skipped_batches"]
        said = f"{s['rollbacks']} ({_counted(s['rollback_causes'])})" + (
            f"; loss-spike rollbacks skipped {dropped} batches" if dropped else ""
        )
        t.add_row("rollbacks", said)
    extra = (
        ("transients", "transient (not reproduced)"),
        ("polluted_inputs", "polluted inputs"),
        ("errors", "errors"),
    )
    for key, label in extra:
        if s[key]:
            t.add_row(label, str(s[key]))
    if s["lost_to_resume"]:
        t.add_row("events of work a resume re-ran", _counted(s["lost_to_resume"]))
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
                # the model's line where there is one (a built-in site's op is a library line)
                _fmt(_short_source(inc.get("user_source") or inc["source"])),
                _fmt(inc["replays"]),
                _fmt(inc["seconds"], ".2f"),
            )
        console.print(it)
    return s


def _short_source(source):
    """``/long/path/to/file.py:123`` -> ``file.py:123`` (the table is narrow)."""
    if not source:
        return source
    return str(source).replace("\\", "/").rsplit("/", 1)[-1]
