"""The run's record on disk: JSON conversion, JSONL reading and the ``EventLog`` writer.

A trainer writes two append-only files in its workdir:

* ``metrics.jsonl``: one JSON object per logged step (``step``, ``time``, ``loss``, ``risk``,
  ``gear``, ``next_gear``, ``loss_scale``, ``grad_norm``, ``nonfinite``, ``skipped``, ``finite``,
  ``safe_sites``, ``site_gears``).
* ``events.jsonl``: one JSON object per event, always with ``type``, ``step`` and ``time``
  (``downshift``, ``skip``, ``locate``, ``safe_enter``, ``safe_exit``, ``recover``,
  ``checkpoint``, ``resume``, ``transient``, ``polluted_input``, ``damaged``, ``rollback``,
  ``error``, ``spike``, ``lr_restore``, ``data_end``).

Non-finite floats are written as Python's ``json`` writes them (bare ``NaN`` / ``Infinity``
tokens); the readers also accept the strings ``"NaN"``, ``"Infinity"``, ``"-Infinity"`` in numeric
metric fields. A process killed mid-write can leave a partial last line: the readers skip any line
that does not parse, with a warning, and :class:`EventLog` starts a fresh line when it reopens such
a file, so a resumed run never glues its first record onto the fragment.
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
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

EVENTS_FILE = "events.jsonl"
METRICS_FILE = "metrics.jsonl"

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


def to_jsonable(obj: Any) -> Any:
    """``obj`` as plain JSON types: the one JSON policy of the run record and of reports.

    NumPy / JAX scalars become Python numbers, arrays (nested) lists.

    Tuples and sets become lists, mapping keys become strings, dataclasses and objects with a
    ``to_dict()`` (e.g. ``replay.Report``) become dicts, enums become their value. Non-finite
    floats stay floats (written as ``NaN`` / ``Infinity``). Anything else becomes ``str(obj)``.

    Args:
      obj: any value.

    Returns:
      ``None``, bool, int, float, str, or lists / dicts of those.
    """
    if obj is None or isinstance(obj, (bool, str)):
        return obj
    if isinstance(obj, enum.Enum):
        return to_jsonable(obj.value)
    if isinstance(obj, int):
        return int(obj)
    if isinstance(obj, float):
        return float(obj)
    if isinstance(obj, np.generic):
        return to_jsonable(obj.item())
    if isinstance(obj, Mapping):
        return {str(to_jsonable(k)): to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple, set, frozenset)):
        items = sorted(obj, key=str) if isinstance(obj, (set, frozenset)) else obj
        return [to_jsonable(v) for v in items]
    if isinstance(obj, os.PathLike):
        return os.fspath(obj)
    to_dict = getattr(obj, "to_dict", None)
    if callable(to_dict):
        return to_jsonable(to_dict())
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_jsonable(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if hasattr(obj, "__array__"):  # np.ndarray, jax.Array (device -> host copy), ...
        return to_jsonable(np.asarray(obj).tolist())
    if isinstance(obj, bytes):
        return obj.decode("utf-8", "replace")
    return str(obj)


_jsonable = to_jsonable  # the old private name


def _dumps(record: Mapping[str, Any]) -> str:
    return json.dumps(to_jsonable(record), allow_nan=True, separators=(",", ":"))


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


class EventLog:
    """Append-only writer of ``events.jsonl`` and ``metrics.jsonl`` in ``workdir``.

    One file handle per file, opened in append mode at construction (both files are created);
    every line is flushed as it is written, so a crash loses at most the line being written.
    Thread-safe. Use as a context manager or call :meth:`close`. The events are also kept in
    memory (those already in the file when the log was opened, then every one appended), so
    :attr:`events` does not re-read the file.

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
        self._event_records = read_events(self.workdir)  # earlier runs in this workdir
        self._metrics = self._open(self.workdir / METRICS_FILE)
        # called with each record ``append`` writes (the Trainer logs its events with it)
        self.echo: Callable[[dict[str, Any]], None] | None = None

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
        record = {"type": type, "step": to_jsonable(step), "time": time.time()}
        record.update(fields)
        record = to_jsonable(record)
        self._write(self._events, record)
        kept = dict(record)
        if "risk" in kept:  # as read_events returns it
            kept["risk"] = _as_float(kept["risk"])
        with self._lock:
            self._event_records.append(kept)
        if self.echo is not None:
            self.echo(record)
        return record

    def log_metrics(self, record: Mapping[str, Any]) -> None:
        """Writes one metrics line (``time`` defaults to now); values converted to JSON types."""
        if "time" not in record:
            record = {**record, "time": time.time()}
        self._write(self._metrics, record)

    @property
    def events(self) -> list[dict[str, Any]]:
        """Every event in ``events.jsonl`` (including those of earlier runs in this workdir).

        Served from memory: a fresh list of the records as written (copies, so a caller may
        edit them), in file order.
        """
        with self._lock:
            return [dict(e) for e in self._event_records]

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
