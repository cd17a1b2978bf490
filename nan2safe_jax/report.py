"""Old home of the run record; it now lives in ``nan2safe_jax.runlog`` (kept as an alias).

``nan2safe_jax.report.X`` keeps working for every name it used to have; new code imports from
``nan2safe_jax.runlog`` (the localizer's result is ``nan2safe_jax.replay.Report``, unrelated).
"""

from nan2safe_jax.runlog.dashboard import (
    _EVENT_STYLE,
    _MAX_EVENT_LINES,
    _MAX_SITE_ROWS,
    DASHBOARD_FILE,
    MAX_POINTS,
    _decimate,
    _decimate_steps,
    _event_steps,
    _figure,
    _max_gear,
    _plain_log_formatter,
    _plural,
    _site_rows,
    _summary_line,
    dashboard,
)
from nan2safe_jax.runlog.events import (
    _FLOAT_FIELDS,
    _NONFINITE_STRINGS,
    EVENTS_FILE,
    METRICS_FILE,
    EventLog,
    _as_float,
    _as_int,
    _dumps,
    _jsonable,
    _read_jsonl,
    _resolve,
    read_events,
    read_metrics,
)
from nan2safe_jax.runlog.summary import (
    GEAR_NAMES,
    _fmt,
    _incident_label,
    _load,
    _median_step_seconds,
    _report_of,
    _Run,
    _short_source,
    _summarize,
    print_summary,
    summary,
)
from nan2safe_jax.runlog.tensorboard import write_tensorboard

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

_COMPAT = (
    GEAR_NAMES,
    MAX_POINTS,
    _EVENT_STYLE,
    _FLOAT_FIELDS,
    _MAX_EVENT_LINES,
    _MAX_SITE_ROWS,
    _NONFINITE_STRINGS,
    _Run,
    _as_float,
    _as_int,
    _decimate,
    _decimate_steps,
    _dumps,
    _event_steps,
    _figure,
    _fmt,
    _incident_label,
    _jsonable,
    _load,
    _max_gear,
    _median_step_seconds,
    _plain_log_formatter,
    _plural,
    _read_jsonl,
    _report_of,
    _resolve,
    _short_source,
    _site_rows,
    _summarize,
    _summary_line,
)
