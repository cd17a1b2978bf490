"""The run's record: the JSONL event log, the summary table, the dashboard and TensorBoard.

A trainer writes two append-only files in its workdir, ``metrics.jsonl`` (one line per logged
step) and ``events.jsonl`` (one line per decision); see ``runlog.events`` for their fields.
Everything else here reads them back.

- ``events``: JSON conversion (``to_jsonable``, the one JSON policy, also used by
  ``replay.Report.to_dict``), JSONL reading, the ``EventLog`` writer.
- ``summary``: run analysis, ``summary`` and ``print_summary``.
- ``dashboard``: the one-picture dashboard, one function per panel.
- ``tensorboard``: ``write_tensorboard``.

Example::

    with EventLog("runs/x") as log:
        log.log_metrics({"step": 0, "loss": 2.3, "risk": 0.0, "gear": 0})
        log.append("downshift", 0, **{"from": 0, "to": 1, "risk": 1.0, "probes": ["attn"]})
    dashboard("runs/x")        # runs/x/dashboard.png
    print_summary("runs/x")
"""

from nan2safe_jax.runlog.dashboard import DASHBOARD_FILE, MAX_POINTS, dashboard
from nan2safe_jax.runlog.events import (
    EVENTS_FILE,
    METRICS_FILE,
    EventLog,
    read_events,
    read_metrics,
    to_jsonable,
)
from nan2safe_jax.runlog.summary import print_summary, summary
from nan2safe_jax.runlog.tensorboard import write_tensorboard

__all__ = [
    "EVENTS_FILE",
    "METRICS_FILE",
    "DASHBOARD_FILE",
    "MAX_POINTS",
    "EventLog",
    "read_events",
    "read_metrics",
    "to_jsonable",
    "dashboard",
    "summary",
    "print_summary",
    "write_tensorboard",
]
