"""TensorBoard export of a run (optional: needs ``tensorboardX``)."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

from nan2safe_jax.runlog.events import _as_float
from nan2safe_jax.runlog.summary import _load

_SUFFIX = ".nan2safe"  # marks the event files this module wrote (and may replace)


def write_tensorboard(workdir: str | os.PathLike, logdir: str | os.PathLike | None = None) -> bool:
    """Writes the run's scalars and events for TensorBoard, if ``tensorboardX`` is installed.

    Scalars ``loss``, ``risk``, ``gear``, ``loss_scale``, ``grad_norm``, ``nonfinite`` per step
    (finite values only) and each event as text under ``events/<type>``.

    Args:
      workdir: the run directory.
      logdir: where to write; default ``workdir/tensorboard``.

    Each call replaces the files an earlier call wrote there (``*.nan2safe``), so running
    ``nan2safe report`` again does not show every point twice.

    Returns:
      True when written; False when ``tensorboardX`` is not importable (nothing is written).
    """
    try:
        from tensorboardX import SummaryWriter
    except ImportError:
        return False
    wd = Path(workdir)
    run = _load(wd)
    out = Path(logdir) if logdir is not None else wd / "tensorboard"
    for old in out.glob(f"events.out.tfevents.*{_SUFFIX}") if out.is_dir() else []:
        old.unlink(missing_ok=True)
    writer = SummaryWriter(str(out), filename_suffix=_SUFFIX)
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
