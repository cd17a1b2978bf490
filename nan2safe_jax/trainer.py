"""Trainer: the host loop around the jitted step — ring buffer, checkpoints, tier 2, events.

The loop dispatches step t and only then reads the metrics of step t-1 (one transfer), so the
host never stalls the device between steps (docs/design.md, "Data flow"). When step t-1 turns
out non-finite, ``incidents.decide`` says what to do; if that changes the state (new gears, or a
rollback to the newest finite checkpoint), the in-flight step t ran on the old state: its result
is dropped and its batch queued again behind any batches the rollback replays. Every decision
lands in ``events.jsonl``.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import importlib
import json
import logging
import math
import numbers
import os
import pickle
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from nan2safe_jax import compile_cache as compile_cache_lib
from nan2safe_jax import gear as gear_lib
from nan2safe_jax import incidents, programs
from nan2safe_jax import optax as guard_lib
from nan2safe_jax import sharding as sharding_lib
from nan2safe_jax import site as site_lib
from nan2safe_jax import watchdog as watchdog_lib
from nan2safe_jax import workdir as workdir_lib
from nan2safe_jax.checkpoint import (
    Checkpointer,
    CheckpointSaveError,
    SkippedCheckpoint,
    state_is_finite,
)
from nan2safe_jax.config import Config
from nan2safe_jax.gear import Gear
from nan2safe_jax.numerics import _is_key
from nan2safe_jax.runlog import EventLog
from nan2safe_jax.spikes import Spike, SpikeWatch
from nan2safe_jax.train import TrainState, make_train_step
from nan2safe_jax.workdir import WorkdirLock, check_shared, check_workdir

log = logging.getLogger(__name__)

_LOGGED = ("loss", "risk", "loss_scale", "grad_norm", "nonfinite")
_END = object()  # the batch iterator ran out
# A run of several processes ends a process in which no step finished for this long (see
# ``Trainer(hang_timeout_s=)``): a generous default; the first step's compile counts, and tier
# 2 and a rollback each start the clock again.
HANG_TIMEOUT_S = 1800.0
_HANG_LOG_S = 5.0  # how long the watchdog waits for its event to be written before the exit


class NanIncidentError(RuntimeError):
    """Raised after ``cfg.max_incidents`` non-finite incidents; ``.report`` is the last one,
    ``.history`` the per-step metrics of the interrupted ``fit`` call."""

    def __init__(self, message: str, report=None):
        super().__init__(message)
        self.report = report
        self.history: list[dict] = []  # the metrics of the interrupted fit call


@dataclasses.dataclass
class _Restart:
    """Tier 2 (or the spike watch) replaced the state: train on from ``state``."""

    state: TrainState
    replay: list = dataclasses.field(default_factory=list)  # batches to run first, in order
    discard: int = 0  # new batches to skip after those (the data that led into a loss spike)
    rolled_back: bool = False  # ``state`` is a checkpoint's, not this step's
    # For a ``fit`` fed again from the restored step (the replay was not run: ``fit`` was left
    # by an exception): (batches to train first, batches to skip then).
    refed_skip: tuple[int, int] = (0, 0)

    @property
    def in_place(self) -> bool:
        """The step's own result with something changed (gears, the learning rate): its batch
        goes to the ring buffer and a checkpoint due at this step saves ``state`` (only a
        rollback replays or skips batches)."""
        return not self.rolled_back


@dataclasses.dataclass
class _Step:
    """A dispatched step: what the host needs once its metrics are readable."""

    step: int
    batch: Any
    before: TrainState
    after: TrainState
    metrics: dict
    replayed: bool  # a batch replayed after a rollback


class _HeldByEveryCheckpoint(Exception):
    """``Trainer._restore_newest``: every checkpoint at or before the step holds what
    ``refuse`` refuses (a weight made huge before the oldest one kept): no restore removes
    it."""

    def __init__(self, steps: list[int]):
        super().__init__(f"every checkpoint ({', '.join(map(str, steps))}) holds it")
        self.steps = steps


# Events said through ``logging`` too (logger ``nan2safe_jax.trainer``), by level; a ``locate``
# is logged where it is decided (``_incident``), a checkpoint or a skip at DEBUG. Before, only
# the locate was: a skipped NaN batch, a downshift, a rollback and a recovery reached neither
# the console nor the log (newuser51).
_EVENT_LEVELS = {
    **dict.fromkeys(
        ("rollback", "polluted_input", "damaged", "error", "stop_restore", "spike", "transient",
         "clipping"),
        logging.WARNING,
    ),
    **dict.fromkeys(
        ("downshift", "recover", "safe_enter", "safe_exit", "resume", "lr_restore", "data_end"),
        logging.INFO,
    ),
    "locate": None,  # logged by ``_incident`` with its report
}  # fmt: skip
_EVENT_FIELDS = (
    "from", "to", "site", "layer", "scope", "steps", "to_step", "replayed", "dropped",
    "passed_over", "leaf", "rows", "trigger", "reason", "detail", "cause",
)  # fmt: skip


def _echo_event(record: dict) -> None:
    """Logs one event record (``EventLog.echo``) at its type's level."""
    kind = record.get("type")
    level = _EVENT_LEVELS.get(kind, logging.DEBUG)
    if level is None or not log.isEnabledFor(level):
        return

    def short(v) -> str:  # a list of thousands of rows, a multi-line detail: one short line
        text = " ".join(str(v).split())
        return text if len(text) <= 160 else text[:157] + "..."

    shown = [k for k in _EVENT_FIELDS if k in record and (k != "layer" or record[k] is not None)]
    fields = "  ".join(f"{k}={short(record[k])}" for k in shown)
    log.log(level, "step %s: %s  %s", record.get("step"), kind, fields)


def _safe_sites(site_gears: dict) -> list[str]:
    """The sites in SAFE, by name; a stacked site's layers in SAFE as ``name[i]`` (the action
    line's form) unless every layer is (newuser52: a scanned stack with one layer in SAFE read
    ``['blocks.attn']``, as if the whole stack were)."""
    out = []
    for name, gears in site_gears.items():
        safe = np.asarray(gears) >= Gear.SAFE
        if safe.ndim == 0 or safe.all():
            out.extend([name] if safe.all() else [])
            continue
        out.extend(site_lib.layer_name(name, at) for at in np.argwhere(safe))
    return out


def _held_everywhere(keystr: str, steps) -> str:
    return (
        f"the parameter {keystr} is near overflow in every checkpoint kept (steps "
        f"{', '.join(map(str, steps))})"
    )


def _refusing(huge: tuple[str, float] | None):
    """``Trainer._restore_newest``'s ``refuse`` for a rollback from a parameter made huge
    (``incidents.huge_state_leaf``): a checkpoint that still holds it; None for no refusal."""
    if huge is None:
        return None
    keystr, top = huge
    return lambda state: incidents.holds_huge(state, keystr, top)


def _compile_cache(setting, workdir: Path) -> Path | None:
    """``Trainer(compile_cache=...)``: the cache directory in use (None: JAX's cache is off)."""
    if setting is False:
        return compile_cache_lib.current()
    if setting is True:  # the default: a cache the user set already is kept, unremarked
        user = compile_cache_lib.set_by_user()
        setting = compile_cache_lib.current() if user else workdir / "compile_cache"
    if not isinstance(setting, (str, os.PathLike)):
        raise ValueError(
            f"compile_cache must be True, False or a directory, got {type(setting).__name__}"
        )
    return compile_cache_lib.enable(setting)


def _host(metrics: dict) -> dict:
    """One device->host transfer of a step's metrics, as plain Python values."""
    m = jax.device_get(metrics)
    out = {k: float(m[k]) for k in _LOGGED}
    out.update(
        step=int(m["step"]),
        gear=int(m["gear"]),
        next_gear=int(m["next_gear"]),
        finite=bool(m["finite"]),
        overflow=bool(m["overflow"]),
        incident=bool(m["incident"]),
        skipped=bool(m["skipped"]),
        polluted=bool(m["polluted"]),
        bad_update=bool(m["bad_update"]),
        bad_rest=bool(m["bad_rest"]),
        site_gears={k: np.asarray(v).tolist() for k, v in m["site_gears"].items()},
        probe_risk={k: float(v) for k, v in m["probe_risk"].items()},
    )
    if "aux" in m:  # ``has_aux``: the loss function's scalars (not its arrays: logits...)
        out["aux"] = jax.tree_util.tree_map(_host_scalar, m["aux"])
    return out


def _host_scalar(x):
    """A Python number for a scalar; None for an array (each step would log all of it)."""
    return x.item() if np.ndim(x) == 0 and hasattr(x, "item") else None


def _owned(x):
    """``x``, or a copy of it when it is a numpy array the caller may write again."""
    return np.array(x, copy=True) if isinstance(x, np.ndarray) else x


def _config_changes(recorded: dict, config: dict) -> dict:
    """``{field: [old, new]}`` for each config field that differs from the run record
    ``recorded`` (empty when the record holds no config)."""
    old = recorded.get("config")
    if not isinstance(old, dict):
        return {}
    new = json.loads(json.dumps(config))  # the record's own types (tuples as lists)
    return {k: [old.get(k), v] for k, v in new.items() if old.get(k) != v}


def load_factory(spec: str):
    """Imports ``"package.module:function"`` and returns the function."""
    if ":" not in spec:
        raise ValueError(f"factory must look like 'package.module:function', got {spec!r}")
    mod, fn = spec.split(":", 1)
    return getattr(importlib.import_module(mod), fn)


class Trainer:
    """The host loop with both tiers, checkpoints and events.

    Use it as a context manager (``with Trainer(...) as t:``) or call ``close()``: it holds the
    orbax checkpoint manager and the event log open.

    Args:
      model: an ``nnx.Module``; ``nan2safe.nn`` modules are sites with their own gear.
      tx: an optax transformation (wrapped in ``nan2safe.optax.guard`` when it is not one).
      loss_fn: ``loss_fn(model, batch) -> scalar`` (or ``-> (scalar, aux)`` with ``has_aux``).
      cfg: thresholds (by default the guard's own when ``tx`` is a guard, else ``Config()``).
      workdir: run directory: ``checkpoints/``, ``events.jsonl``, ``metrics.jsonl``,
        ``incidents/``. Created when missing; resumed from when it holds checkpoints.
      lr_schedule: the optimizer's schedule, for the detector's cool-down (optional; see
        ``make_train_step`` for the count it is called with).
      factory: ``"module:function"`` returning ``(model, tx, loss_fn, cfg)``; recorded so that
        ``nan2safe locate WORKDIR --step N`` can rebuild the step offline (None, resuming,
        keeps the one the workdir recorded).
      resume: resume from the newest good checkpoint in ``workdir`` (default True). False on
        a workdir that holds checkpoints is a ``ValueError``: a new run there would overwrite
        and mix them.
      progress: show a progress bar with loss, gear and loss scale.
      mesh: a ``jax.sharding.Mesh``; alone it means ``nan2safe.sharding.data_parallel(mesh)``.
      rules: ``nan2safe.sharding.data_parallel(...)`` / ``fsdp(...)``. The initial (or resumed)
        state is placed on the mesh, each batch is split over the data axis, checkpoints restore
        onto the current mesh (whatever mesh saved them), and tier 2 replays the failing step on
        one device from gathered arguments; its ``locate`` event gains ``"shards"`` (which data
        shard, devices and processes hold the bad batch rows). Under ``jax.distributed`` every
        process runs this loop and passes its own rows of each batch.
      has_aux: ``loss_fn`` returns ``(loss, aux)``; ``aux`` lands in the metrics as ``"aux"``,
        and its scalar leaves in the history and ``metrics.jsonl`` (array leaves read None
        there: a ``(loss, logits)`` aux would log the logits every step).
      compile_cache: where JAX's persistent compilation cache keeps the compiled step, so a
        restarted run loads it instead of compiling it again: True (the default) for
        ``workdir/compile_cache``, a directory, or False to leave JAX's cache as it is. A cache
        the process already uses (``JAX_COMPILATION_CACHE_DIR``) is kept
        (``nan2safe_jax.compile_cache``). ``trainer.compile_cache`` is the directory in use.
      hang_timeout_s: while ``fit`` runs, a process in which no step finishes for this many
        seconds logs an ``error`` event and exits with code 124 (``nan2safe_jax.watchdog``): a
        peer that hangs without dying keeps its heartbeats going, and the others would wait
        in its collective forever. ``"auto"`` (the default): ``HANG_TIMEOUT_S`` (30 minutes)
        in a run of several processes, none in one process; None: never. The clock starts
        with ``fit`` and again after each finished step and when tier 2 or a rollback starts:
        give more than the first step's compile, a tier-2 replay or a checkpoint restore of
        your model takes. The watchdog's thread runs only while ``fit`` does.

    Raises:
      ValueError: bad workdir, config or compile_cache, or another process's trainer holds
        the workdir (a trainer of this process that holds it is closed: the new one takes the
        workdir over; ``nan2safe_jax.workdir``).
      CheckpointMismatchError: the workdir's checkpoints were written for a different model
        (a ``ValueError``; the checkpoints and ``run.json`` are left as they are).
    """

    def __init__(
        self,
        model,
        tx,
        loss_fn: Callable,
        cfg: Config | None = None,
        workdir: str | os.PathLike | None = None,
        *,
        lr_schedule: Callable | None = None,
        factory: str | None = None,
        resume: bool = True,
        progress: bool = False,
        mesh=None,
        rules: sharding_lib.Rules | None = None,
        has_aux: bool = False,
        compile_cache: bool | str | os.PathLike = True,
        hang_timeout_s: float | None | str = "auto",
    ):
        self.cfg = guard_lib.config_of(tx, cfg)
        if not isinstance(self.cfg, Config):
            raise ValueError(f"cfg must be a nan2safe.Config, got {type(self.cfg).__name__}")
        number = isinstance(hang_timeout_s, (int, float)) and not isinstance(hang_timeout_s, bool)
        if not (hang_timeout_s in (None, "auto") or number and 0 < hang_timeout_s < math.inf):
            raise ValueError(
                f"hang_timeout_s must be a number of seconds > 0, 'auto' or None, got "
                f"{hang_timeout_s!r}"
            )
        self.workdir = check_workdir(workdir)
        # A run of several processes: one shared workdir and one Config, or each process would
        # wait for the others at a different step (a silent hang).
        check_shared(self.workdir)
        sharding_lib.agree_fields(dataclasses.asdict(self.cfg), "the Trainer's Config")
        self.compile_cache = _compile_cache(compile_cache, self.workdir)
        try:  # from here a failure closes what is open (the cache directory above too)
            self.loss_fn = loss_fn
            self.progress = progress
            self.rules = sharding_lib.resolve(mesh, rules)
            self.state = TrainState.create(model, tx, self.cfg)
            if self.rules is not None:
                self.state = sharding_lib.shard_state(self.state, self.rules)
            self.step_fn = make_train_step(
                loss_fn, lr_schedule=lr_schedule, rules=self.rules, has_aux=has_aux
            )
            # Held until ``close``: a second trainer would overwrite this run's checkpoints.
            # Another process's trainer holding it raises here; one of this process is closed
            # at the end, once this one has resumed (``nan2safe_jax.workdir``).
            self._lock = WorkdirLock(sharding_lib.log_dir(self.workdir))
            self._watchdog = None  # runs only while ``fit`` does
            if hang_timeout_s == "auto":
                hang_timeout_s = HANG_TIMEOUT_S if jax.process_count() > 1 else None
            self.hang_timeout_s = hang_timeout_s
            self._open(factory, has_aux, resume)
        except BaseException:
            self.close()
            raise

    def _open(self, factory, has_aux: bool, resume: bool) -> None:
        """The rest of ``__init__``: checkpoints, event log, resume, then the workdir's hold."""
        holder = self._lock.holder
        if holder is not None and not holder.closed:
            try:  # its last saves, before this one reads the checkpoints
                holder.checkpoints.wait()
            except CheckpointSaveError:
                pass  # that save never finished: the resume below says so
        self.checkpoints = Checkpointer(self.workdir / "checkpoints")
        self.log = EventLog(sharding_lib.log_dir(self.workdir))  # one log per process
        self.log.echo = _echo_event
        # (step, batch) of the latest finished steps: what a rollback replays.
        self.ring: collections.deque = collections.deque(maxlen=self.cfg.ring_size)
        self.incidents = 0
        self._polluted_streak = 0  # polluted batches in a row (``_stop_past_polluted_streak``)
        self._scale_matters: dict = {}  # ``_loss_scale_matters``, per program and batch dtypes
        self.rollbacks = 0
        self._checkpoint_due = False  # a checkpoint waiting past skipped steps (``_finish``)
        # (cause, checkpoint, whether it dropped the replay) of the last rollback for damage or
        # a huge weight (its keystr)
        self._rolled_back_for: tuple[str, int, bool] | None = None
        # (checkpoint, ``_failures`` then) of the last restore, until a step applies on it
        # (``_passed_over``)
        self._restored: tuple[int, int] | None = None
        # Steps that raised an incident since the newest checkpoint: one failing again on a
        # rollback's replay is the same incident, not counted again (newuser51).
        self._failed_steps: set[int] = set()
        self._failures = 0  # failed steps, each replay's too (``_passed_over`` counts them)
        # The checkpoint of the last tier-2 rollback, and the one whose replay showed a batch
        # (not the state) at fault: a batch failed there again in SAFE (``_incident``).
        self._rolled_back_to: int | None = None
        self._batches_at_fault: int | None = None
        # (keystr, range top, checkpoint steps) of a weight every checkpoint kept held, once
        # the gears were tried in its place (``_downshift_where_no_checkpoint_helps``)
        self._huge_everywhere: tuple[str, float, list[int]] | None = None
        self._clipped: list[bool] | None = []  # FAST steps clipped (``_note_clipping``)
        self._skips_in_a_row = 0  # new batches skipped as at fault, no rollback in between
        self.spikes = SpikeWatch(self.cfg)
        self.spike_rollbacks = 0
        self._lr_left = 0  # steps left at the lowered learning rate after a loss spike
        # New batches a loss-spike rollback still has to skip (after ``_skip_in`` more are
        # trained), carried to the next ``fit`` when this one ran out of steps first.
        self._discard = 0
        self._skip_in = 0
        self.last_report = None
        self.step = 0
        # the state the newest checkpoint was saved from (``save``); weak: not kept alive
        self._checkpointed: Callable[[], Any] = lambda: None
        self._last_sites: dict[str, Any] = {}
        self._last_level: int | None = None
        recorded = workdir_lib.read_run_record(self.workdir) if resume else {}
        if factory is None:
            # Opening a run to read it back must not lose what `nan2safe locate` rebuilds from
            # (a new run, ``resume=False``, records its own).
            factory = recorded.get("factory")
        run = {"factory": factory, "config": dataclasses.asdict(self.cfg), "has_aux": has_aux}
        if resume:
            self._resume(run, recorded)
        else:
            self._refuse_another_runs_checkpoints()
        self._lock.take_over(self)
        # Written once the run is known to go on here: a refused resume keeps the old record.
        workdir_lib.write_run_record(self.workdir, run)

    def _refuse_another_runs_checkpoints(self) -> None:
        """``resume=False`` on a workdir that holds checkpoints: refused. The new run's saves
        would replace the old run's of the same steps and its keep-3 pruning delete the rest,
        the two runs' logs would read as one, and a later resume would pick up the old run's
        newest step over the new run's work.

        Raises:
          ValueError: naming the workdir, its checkpoints and what to do instead.
        """
        held = sorted(set(self.checkpoints.steps()) | set(self.checkpoints.unfinished()))
        if held:
            raise ValueError(
                f"resume=False: {str(self.workdir)!r} holds an earlier run's checkpoints (steps "
                f"{held}); starting over there would overwrite and mix them. Pass a new "
                "workdir, or resume=True to go on from them (delete the folder yourself to "
                "start over in it)"
            )

    # ------------------------------------------------------------------ lifetime

    def close(self) -> None:
        """Waits for pending checkpoints and background compiles, closes the checkpoint manager
        and the event log, and lets the workdir go (another trainer may then take it).

        A background compile cannot be stopped (``nan2safe_jax.programs``); one left running
        after ``close`` held gigabytes and slowed the next trainer's steps 2–3× (five
        create/fit/close cycles in a notebook: five compiles still running 49 s later)."""
        wait = getattr(getattr(self, "step_fn", None), "wait_compiled", None)
        if wait is not None:
            wait()
        failed = None
        log_ = getattr(self, "log", None)  # a trainer whose ``__init__`` failed part-way
        ckpt = getattr(self, "checkpoints", None)
        if ckpt is not None and not getattr(self, "_ckpt_closed", False):
            self._ckpt_closed = True
            try:
                ckpt.close()
            except CheckpointSaveError as err:  # raised once the workdir is let go
                failed = err
                if log_ is not None and not log_.closed:
                    self._log_save_error(err)
        if log_ is not None and not log_.closed:
            log_.close()
        lock = getattr(self, "_lock", None)
        if lock is not None:
            lock.release()
        if not getattr(self, "_cache_released", False):  # once: each Trainer counts one user
            self._cache_released = True
            compile_cache_lib.release(getattr(self, "compile_cache", None))
        dog = getattr(self, "_watchdog", None)
        if dog is not None:
            dog.stop()
        if failed is not None:
            raise failed

    def _on_hang(self, waited_s: float) -> None:
        """The watchdog's verdict: no step finished in ``hang_timeout_s``. Logged, then the
        process ends (``watchdog.exit_on_hang``): its main thread is blocked in a collective.

        The log is written from a thread of its own, waited for at most ``_HANG_LOG_S``: the
        main thread may hold the log's lock (stuck in a write to a dead filesystem), and a
        failed write must not keep the process alive."""

        def say() -> None:
            try:
                self.log.append(
                    "error",
                    self.step,
                    detail=f"no training step finished in {waited_s:.0f} s (hang_timeout_s): a "
                    "process of the run is most likely stuck; this process stops so the run "
                    "can be restarted",
                )
                self.log.close()
            except Exception:  # noqa: BLE001 - the exit below is what matters
                pass

        writer = threading.Thread(target=say, name="nan2safe-hang-log", daemon=True)
        writer.start()
        writer.join(_HANG_LOG_S)
        watchdog_lib.exit_on_hang(waited_s)

    def _beat(self) -> None:
        """The run is alive (a step finished, tier 2 or a rollback starts): the watchdog's
        clock starts again, so such host work gets a whole ``hang_timeout_s`` of its own."""
        if self._watchdog is not None:
            self._watchdog.beat()

    def save(self) -> bool:
        """Checkpoints the current state now, and waits until it is written.

        ``fit`` saves every ``checkpoint_every`` steps only, and ``close`` saves nothing: a run
        that ends between two checkpoints resumes from the older one unless this is called
        first. As every checkpoint, a state that is not finite is refused (an ``error`` event).
        In a run of several processes, every process calls it.

        Returns:
          Whether checkpoint ``self.step`` holds the current state (True at once when that
          checkpoint was saved from, or restored into, this very state; a state replaced since,
          e.g. with gears set by hand, is saved over it).

        Raises:
          ValueError: the trainer is closed.
          CheckpointSaveError: the checkpoint could not be written (a full disk; logged).
        """
        if self.closed:
            raise ValueError(f"this Trainer of {str(self.workdir)!r} is closed: nothing to save")
        if self.state is self._checkpointed() and self.step in self.checkpoints.steps():
            return True
        saved = self._checkpoint(self.step, self.state)
        self._join_saves(raise_error=True)
        return saved

    @property
    def closed(self) -> bool:
        log_ = getattr(self, "log", None)
        return log_ is None or log_.closed

    def __enter__(self) -> Trainer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _resume(self, run: dict, recorded: dict) -> None:
        """Restores the newest good checkpoint of the workdir, if any, and logs ``resume``.

        The ``resume`` event comes first, then an ``error`` for each checkpoint skipped or
        save that never finished, at that checkpoint's step: a summary reads the events before
        a ``resume`` at its step or later as work the resume lost (``runlog.summary``).

        Args:
          run: this trainer's ``run.json`` record; config fields that differ from the record
            the workdir holds are listed in the event (``config_changed``) and warned about.
          recorded: the record the workdir holds (``{}`` when none could be read).

        Raises:
          CheckpointMismatchError: the checkpoints were written for a different model.
        """
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            found = self.checkpoints.restore_latest(self.state)
        errors = [(_skipped_step(w.message, 0), str(w.message)) for w in caught]
        lost = [s for s in self.checkpoints.unfinished() if found is None or s > found[1]]
        if lost:
            at = "step 0" if found is None else f"checkpoint {found[1]}"
            errors.append(
                (
                    0 if found is None else int(found[1]),
                    f"{len(lost)} checkpoint save(s) never finished (steps {lost}: the run, or "
                    f"one of its processes, ended while they were written); resuming from {at}",
                )
            )
        if found is not None:
            self.state, step = found
            self.step = int(step)
            self._checkpointed = weakref.ref(self.state)
            changed = _config_changes(recorded, run["config"])
            if changed:
                warnings.warn(
                    f"resuming {str(self.workdir)!r} with a changed config: "
                    + ", ".join(f"{k} {old!r} -> {new!r}" for k, (old, new) in changed.items()),
                    stacklevel=4,  # the user's ``Trainer(...)`` (via __init__, _open)
                )
            self.log.append(
                "resume",
                self.step,
                from_step=self.step,
                path=str(self.checkpoints.path(step)),
                gear=int(self.state.gear.level),
                **({"config_changed": changed} if changed else {}),
            )
        for at_step, detail in errors:
            self.log.append("error", at_step, detail=detail)
            warnings.warn(detail, stacklevel=4)

    @property
    def events(self) -> list[dict]:
        """Every event so far, as dicts with a ``"type"`` key."""
        return self.log.events

    # ------------------------------------------------------------------ loop

    def fit(self, batches: Iterable, steps: int) -> list[dict]:
        """Trains on ``steps`` new batches (or until ``batches`` runs out: a ``data_end`` event).

        A run resumed from its workdir starts at ``self.step`` (the newest finite checkpoint's);
        ``fit`` draws new batches from whatever ``batches`` yields, so pass the data from that
        step on (``data[trainer.step:]``) and the steps that are left.

        A rollback replays the batches since the restored checkpoint from the ring buffer on
        top of those: each replayed step appears in the history again, with ``"replay": True``.
        A loss-spike rollback also skips the new batches that led into the spike; those it
        has not skipped when ``steps`` run out are skipped by the next ``fit`` (give it the
        same iterator: after such a skip ``trainer.step`` no longer indexes the data).

        Returns:
          Per-step metric dicts (host values), in the order the steps ran.

        Raises:
          NanIncidentError: more than ``cfg.max_incidents`` non-finite incidents.
        """
        if not isinstance(steps, numbers.Integral) or isinstance(steps, bool) or steps < 0:
            raise ValueError(f"steps must be an int >= 0, got {steps!r}")
        steps = int(steps)
        if self.closed:
            raise ValueError(
                f"this Trainer of {str(self.workdir)!r} is closed (a newer Trainer may hold the "
                "workdir): create a new one to go on"
            )
        history: list[dict] = []
        bar = _Progress(steps, self.step) if self.progress else None
        source = iter(batches)
        queued: collections.deque = collections.deque()  # (batch, is_replay) to run first
        drawn = 0
        inflight: _Step | None = None
        finishing = False
        left_cleanly = False
        if self.hang_timeout_s is not None:
            self._watchdog = watchdog_lib.Watchdog(self.hang_timeout_s, self._on_hang)
            self._watchdog.arm()
        try:
            if self.step == 0 and steps > 0 and not self.checkpoints.steps():
                # The state training starts from is the first good checkpoint: a fault that
                # repeats, or a state damaged, before checkpoint ``checkpoint_every`` can still
                # be rolled back (to step 0, replaying the ring buffer) instead of trained on.
                self._checkpoint(0, self.state)
            while True:
                if queued:
                    batch, replayed = queued.popleft()
                elif drawn < steps:
                    batch, replayed = next(source, _END), False
                    drawn += batch is not _END
                    if batch is _END:  # said once: ``fit`` returns early, not an error
                        self.log.append("data_end", self.step, drawn=drawn, steps=steps)
                        steps = drawn
                else:
                    batch = _END
                if batch is not _END and not replayed and self._discard > 0:
                    if self._skip_in == 0:
                        self._discard -= 1
                        continue
                    self._skip_in -= 1
                running = None if batch is _END else self._dispatch(batch, replayed)
                done, inflight = inflight, running
                if done is not None:
                    finishing = True  # an exception inside finishes nothing more on the way out
                    restart = self._finish(done, history, bar)
                    finishing = False
                    self._beat()
                    if restart is not None:
                        # The state was replaced: the step just dispatched ran on the old one.
                        # Drop it; run the replayed batches, then this one again.
                        again = [] if running is None else [(batch, replayed)]
                        queued.extendleft(reversed([*restart.replay, *again]))
                        self._discard += restart.discard
                        self._skip_in = 0
                        self.state, inflight = restart.state, None
                        self.step = int(restart.state.step)
                        continue
                if running is None:
                    break
            left_cleanly = True
        except NanIncidentError as err:
            err.history = history
            raise
        except jax.errors.JaxRuntimeError as err:  # multi-process: a peer died mid-collective
            lost = sharding_lib.lost_process_error(err)
            if lost is None:
                if inflight is not None and not finishing:
                    self._finish_before_raising(inflight, history, bar, err)
                raise
            self.log.append("error", self.step, detail=str(lost))
            raise lost from err
        except BaseException as err:  # the data, the loss function, Ctrl-C
            if isinstance(err, CheckpointSaveError):  # from any wait: a rollback's too
                self._log_save_error(err)
            if inflight is not None and not finishing:
                self._finish_before_raising(inflight, history, bar, err)
            raise
        finally:
            if self._watchdog is not None:  # no thread outlives ``fit``
                self._watchdog.stop()
                self._watchdog = None
            if bar:
                bar.close()
            self._join_saves(raise_error=left_cleanly)
        return history

    def _join_saves(self, raise_error: bool) -> None:
        """Waits for the checkpoint saves in the background; a failed one (a full disk) is
        logged as an ``error`` at its step and raised as ``CheckpointSaveError`` (an
        ``OSError``), unless ``fit`` is already left by another exception, which it would
        hide."""
        try:
            self.checkpoints.wait()
        except CheckpointSaveError as err:
            self._log_save_error(err)
            if raise_error:
                raise

    def _log_save_error(self, err: CheckpointSaveError) -> None:
        """Logs ``err`` as an ``error`` event at its step, once (orbax raises a failed save
        once, wherever the next wait is: a rollback's restore too)."""
        if getattr(err, "logged", False):
            return
        err.logged = True
        step = self.step if err.step is None else err.step
        try:  # the log may sit on the full disk too
            # ``failed_checkpoint``: the report counts the save's ``checkpoint`` event as failed
            self.log.append("error", step, detail=str(err), failed_checkpoint=err.step)
        except OSError:
            log.warning("%s", err)

    def _finish_before_raising(self, done: _Step, history: list, bar, err: BaseException):
        """Finishes the step in flight when ``fit`` is left by an exception (the data source
        raised, ``loss_fn`` failed on a new batch, Ctrl-C): that step has trained (the state
        and the counter moved on), so its record, its checkpoint and, for a fault, tier 2 are
        due. Without this a resume started a step short and a fault in that step went
        unhandled, its downshift and loss-scale cut kept. A state tier 2 replaces (new gears,
        a rollback) becomes the trainer's; its replayed batches are not run (the next ``fit``
        goes on from ``self.step``, and after a loss-spike rollback skips the spike's batches
        among those it is fed from there). A failure here is logged, and ``err`` raised all
        the same.
        Not in a run of several processes: the step's checkpoint and tier 2 are collective, and
        the other processes, which did not fail, are not there to join them.
        """
        if jax.process_count() > 1 or self.log.closed:  # (closed: the watchdog ended the run)
            return
        try:
            restart = self._finish(done, history, bar)
            if restart is not None:
                self.state, self.step = restart.state, int(restart.state.step)
                if not restart.in_place:  # fed again from ``self.step``: skip the spike's data
                    self._skip_in, self._discard = restart.refed_skip
        except Exception as also:  # noqa: BLE001 - the first exception is the one raised
            detail = f"finishing step {done.step} after {type(err).__name__}: {also!r}"
            try:
                self.log.append("error", self.step, detail=detail)
            except Exception:  # noqa: BLE001 - nor may the log of it hide the first
                log.warning(detail)

    def _dispatch(self, batch, replayed: bool) -> _Step:
        """Runs the step on the current state (asynchronously) and advances the counter.

        The batch is kept (tier 2 replays it, the ring buffer holds it) as a copy of its numpy
        leaves: a loader that refills one buffer for every batch would otherwise change it
        under the replay, which then runs another batch (a fault reads as "transient") and a
        rollback replays the newest batch in place of each since the checkpoint.
        """
        if not replayed:
            batch = jax.tree_util.tree_map(_owned, batch)
        before = self.state
        self.state, metrics = self.step_fn(before, batch)
        step = _Step(self.step, batch, before, self.state, metrics, replayed)
        self.step += 1
        return step

    def _finish(self, done: _Step, history: list, bar) -> _Restart | None:
        """Everything the host does once step ``done``'s metrics are readable.

        Returns:
          None to carry on, or a ``_Restart`` when the state was replaced (new gears, a
          rollback, the learning rate back after a loss spike).
        """
        m = _host(done.metrics)
        if not m["skipped"]:
            self._restored = None  # a step trained on the restored checkpoint: it holds
            self._skips_in_a_row = 0
            self._note_clipping(done, m)
        decided = None
        if m["overflow"] and not self._loss_scale_matters(done):
            decided = self._overflow_decision(done, m)
        m["time"] = time.time()
        m["safe_sites"] = _safe_sites(m["site_gears"])
        if done.replayed:
            m["replay"] = True
        history.append(m)
        if bar:
            bar.update(m)
        if m["skipped"]:
            self.log.append("skip", done.step, reason=_skip_reason(m), loss=m["loss"])
        # The metrics line is written once the step is decided: tier 2, a rollback or a stop
        # change its record (``incident``, ``next_gear``), and it must read as the history's.
        try:
            restart = self._act(done, m, decided)
        except BaseException:
            with contextlib.suppress(OSError, ValueError):  # the error in flight is the news
                self._log_metrics(done, m)
            raise
        self._log_metrics(done, m)
        return restart

    def _log_metrics(self, done: _Step, m: dict) -> None:
        """Step ``done``'s line of ``metrics.jsonl``, every ``log_every`` steps and at every
        incident or polluted batch."""
        if (done.step + 1) % self.cfg.log_every == 0 or m["incident"] or m["polluted"]:
            self.log.log_metrics(
                {k: m[k] for k in m if k not in ("probe_risk",)} | {"step": done.step}
            )

    def _act(self, done: _Step, m: dict, decided) -> _Restart | None:
        """``_finish``'s decisions for step ``done``: tier 2 (``decided``, when
        ``_overflow_decision`` made it), the spike watch, the learning rate's return, the
        checkpoint; ``m`` is corrected in place. The gear events
        come last: a rollback of any kind (tier 2, a loss spike, a damaged state at the
        checkpoint) sets the next step's gears to the restored checkpoint's, so a downshift
        the failed step chose, which never took effect, is not logged (review29b)."""
        restart = None
        # A SAFE stay that ended before this step is logged before an incident of this step
        # can start the next one: the log reads exit, then enter.
        self._safe_exits(done.step, m)
        if m["incident"] or m["polluted"]:
            restart = self._incident(done, m, decided)
        else:
            self._polluted_streak = 0
        if restart is None:
            spike = self.spikes.update(
                done.step, m["loss"], not m["skipped"], overflow=bool(m["overflow"])
            )
            restart = None if spike is None else self._spike(done, spike)
        if restart is None and self._lr_left > 0:
            self._lr_left -= 1
            if self._lr_left == 0:
                self.log.append("lr_restore", done.step, lr_scale=1.0)
                restart = _Restart(done.after.replace(lr_scale=jnp.ones([], jnp.float32)))
        try:
            if restart is None or restart.in_place:
                restart = self._checkpoint_at(done, m, restart)
        finally:  # a failed save still logs the gears the step took
            if restart is not None and not restart.in_place:
                # The next step runs at the restored checkpoint's gears (with the decision's).
                m["next_gear"] = int(restart.state.gear.level)
            self._gear_events(done.step, m)
        return restart

    def _checkpoint_at(self, done: _Step, m: dict, restart: _Restart | None) -> _Restart | None:
        """The checkpoint due after step ``done``, if one is: saved, waiting for an applied
        step, or (its state not finite) a rollback, returned in place of ``restart``."""
        if self._checkpoint_due:
            self._hold_ring()
        self.ring.append((done.step, done.batch))
        on_time = (done.step + 1) % self.cfg.checkpoint_every == 0
        state = done.after if restart is None else restart.state
        if (on_time or self._checkpoint_due) and m["skipped"] and not m["polluted"]:
            # A checkpoint is a state the run trained to: one due while the steps refuse
            # the state waits for the next applied step. A finite state that every step
            # refuses (a weight made huge by a bad update, loss ~1e30, each step skipped)
            # was saved at the due step, and the rollbacks restored it instead of the good
            # checkpoint before it (newuser46). A polluted batch says nothing of the state.
            # A state that is not finite is still rolled back at the due step (the skips
            # after it leave the state as it was: it is checked once).
            self._checkpoint_due = True
            if on_time and not state_is_finite(state):
                self.log.append("error", done.step + 1, detail="state not finite")
                restart = self._damaged(done, state, m) or restart
        elif on_time or self._checkpoint_due:
            self._checkpoint_due = False
            if not self._checkpoint(done.step + 1, state):
                restart = self._damaged(done, state, m) or restart
        return restart

    def _hold_ring(self) -> None:
        """While a checkpoint waits (``_finish``), the ring buffer keeps the batches since the
        last one, so that a rollback to it replays every step: it grows by one batch per
        waiting step, up to twice ``ring_size`` (past that a rollback lists the oldest as
        ``missing``), and ``_checkpoint`` brings it back to ``ring_size``."""
        if len(self.ring) >= (self.ring.maxlen or 0) and self.ring.maxlen < 2 * self.cfg.ring_size:
            self.ring = collections.deque(self.ring, maxlen=self.ring.maxlen + 1)

    def _checkpoint(self, step: int, state) -> bool:
        """Saves ``state`` as checkpoint ``step``; False (logged) when it is not finite.

        Raises:
          CheckpointSaveError: this save, or the one before it in the background, failed
            (logged).
        """
        try:
            saved = self.checkpoints.save(step, state)
        except CheckpointSaveError as err:
            self._log_save_error(err)
            raise
        if saved:
            self._checkpoint_due = False  # ``save()`` too: nothing waits past this one
            self._failed_steps = {s for s in self._failed_steps if s >= step}
            if self.ring.maxlen != self.cfg.ring_size:  # ``_hold_ring`` grew it
                self.ring = collections.deque(self.ring, maxlen=self.cfg.ring_size)
            self._checkpointed = weakref.ref(state)
            self.log.append("checkpoint", step, path=str(self.checkpoints.path(step)))
            return True
        self.log.append("error", step, detail="state not finite: no checkpoint")
        return False

    def _damaged(self, done: _Step, state, m: dict) -> _Restart | None:
        """The state step ``done`` left is not finite although the step raised no incident
        (a value no check of the step reads, e.g. an optimizer's moment): it is never trained
        on. Rolls back to the newest finite checkpoint (None, logged, when there is none);
        ``m``: the step's metrics, as in ``_stop_past_max_incidents``."""
        local = state if self.rules is None else sharding_lib.to_local(state)
        report = incidents.damaged_report(local)
        decision = incidents.Decision(
            "damaged",
            report,
            restore=True,
            action="the state is damaged: roll back to the newest finite checkpoint",
        )
        self.log.append("damaged", done.step, report=report.to_dict(), action=decision.action)
        self.incidents += 1  # bounded like any incident: damage that never stops ends the run
        self._failures += 1
        self._stop_past_max_incidents(done, decision, m)
        return self._rollback(done, decision, m)

    def _stop_past_max_incidents(self, done: _Step, decision, m: dict) -> None:
        """Raises ``NanIncidentError`` (logged) once ``incidents`` passes ``max_incidents``, or
        once more than ``max_incidents`` batches in a row were polluted input: each of those is
        skipped and not counted as an incident, but a data pipeline that yields nothing usable
        would otherwise skip every step, forever.

        Stopped for incidents, the trainer is left on the newest finite checkpoint (as
        ``_rollback`` picks it; a ``stop_restore`` event), as a resume would be: the state the
        steps kept failing on is never trained on by a ``fit`` after the error (the one before
        each located step is in the workdir's ``incidents/``). Stopped for polluted input, the
        state stays: the data was at fault, not the state.

        Args:
          done: the failed step.
          decision: its tier-2 decision (its report goes into the error).
          m: the step's metrics, written to ``metrics.jsonl`` after this: a stop that leaves
            the trainer on a checkpoint sets ``next_gear`` to the checkpoint's level (the gear
            the failed step chose never takes effect), as a rollback does.
        """
        step_no = done.step
        limit = self.cfg.max_incidents
        if self.incidents > limit:
            detail = f"{self.incidents} incidents: stopping"
            why = f"{self.incidents} non-finite incidents (max_incidents={limit})"
        elif self._polluted_streak > limit:
            detail = f"{self._polluted_streak} batches in a row were polluted input: stopping"
            why = f"{detail} (more than max_incidents={limit}): the data yields no usable batch"
        else:
            return
        self.log.append("error", step_no, detail=detail)
        found = None
        if self.incidents > limit:
            try:
                found = self._restore_newest(
                    step_no, _refusing(incidents.huge_state_leaf(decision.report))
                )
            except _HeldByEveryCheckpoint as held:  # each as bad as the state the run has
                self._leave_before(done)
                why += f"; the trainer is left before step {step_no}: {held} (the huge weight)"
            except Exception as err:  # noqa: BLE001 - a failed restore must not hide the stop
                self.log.append("error", step_no, detail=f"no restore at the stop: {err!r}")
        if found is not None:
            state, ckpt, extra = found
            self._leave_on(step_no, state, ckpt, extra)
            m["next_gear"] = int(self.state.gear.level)
            why += f"; the trainer is left on checkpoint {ckpt}"
        hint = "" if decision.hint is None else f"\n{decision.hint}"
        raise NanIncidentError(f"{why}; last report:\n{decision.report}{hint}", decision.report)

    def _gear_events(self, step_no: int, m: dict) -> None:
        if m["next_gear"] > m["gear"] and m["next_gear"] == Gear.STABLE:
            fired = [k for k, v in m["probe_risk"].items() if v > 0]
            top = max((m["probe_risk"][k] for k in fired), default=0.0)
            self.log.append(
                "downshift",
                step_no,
                **{"from": m["gear"], "to": m["next_gear"]},
                risk=m["risk"],
                probes=fired,  # every probe with a risk; ``trigger``: those at the highest
                trigger=[k for k in fired if m["probe_risk"][k] == top],
                cause=_downshift_cause(m),
            )
        elif m["next_gear"] < m["gear"] and m["next_gear"] == Gear.FAST:
            self.log.append("recover", step_no, to=m["next_gear"])

    def _safe_exits(self, step_no: int, m: dict) -> None:
        """``safe_exit`` for each site in SAFE at the step before that ran ``step_no`` out of it.

        The whole model's SAFE stay (``safe_enter`` with ``scope: "global"``) ends in one
        ``safe_exit`` of the same scope, not one per site: the sites were in SAFE through it.
        """
        was_level = self._last_level
        if was_level is not None and was_level >= Gear.SAFE and m["gear"] < Gear.SAFE:
            self.log.append("safe_exit", step_no, site=None, scope="global")
        else:
            for name, g in m["site_gears"].items():
                was = self._last_sites.get(name)
                if was is not None and np.max(was) >= Gear.SAFE and np.max(g) < Gear.SAFE:
                    self.log.append("safe_exit", step_no, site=name)
        self._last_sites, self._last_level = m["site_gears"], m["gear"]

    # ------------------------------------------------------------------ tier 2

    def _loss_scale_matters(self, done: _Step) -> bool:
        """``incidents.loss_scale_matters`` for the program that ran ``done``, traced once per
        program and batch dtypes (at the run's first overflow)."""
        program = programs.program_for(self.step_fn, done.before)
        leaves, treedef = jax.tree_util.tree_flatten(done.batch)
        key = (id(program), treedef, tuple(str(getattr(x, "dtype", type(x))) for x in leaves))
        if key not in self._scale_matters:
            self._scale_matters[key] = incidents.loss_scale_matters(
                program, done.before, done.batch
            )
        return self._scale_matters[key]

    def _overflow_decision(self, done: _Step, m: dict):
        """Tier 2 for a loss-scale "overflow" (a finite loss, non-finite gradients) of a step
        with no float16 or float8 value, where no loss scale brings a gradient back into range
        that was not in it unscaled: a NaN made by the model (a ``0/0`` in a backward rule, a
        zero-variance norm whose NaN the compiled forward dropped) is an incident, as a
        non-finite loss is. It is one when the replay names an equation of the model: the
        record says ``incident``, and the new gears are one down at least (FAST -> STABLE, as
        the step moves them for an incident). The step's verdict stands when the replay names
        the step's own sum of squares (finite gradients whose squares pass f32's range: the
        scale's business, which halving cures; unless they would at the smallest scale too,
        ``incidents.no_scale_cures``) or stays finite.

        Returns:
          ``(decision, (before, batch), t0)`` for ``_incident``, or None.
        """
        self._beat()
        t0 = time.perf_counter()
        inputs = self._tier2_inputs(done)
        decision = self._decide(done, m, inputs)
        report = decision.report
        where = [getattr(report, k, None) for k in ("site", "primitive")]
        sharding_lib.agree([decision.kind, *where], "tier-2 decision")  # multi-process only
        bookkeeping = report.primitive is not None and incidents.in_step_bookkeeping(report)
        cured = bookkeeping and not incidents.no_scale_cures(
            report, m["loss_scale"], self.cfg.loss_scale_min
        )
        sharding_lib.agree(cured, "loss-scale verdict")  # multi-process only
        if decision.kind == "transient" or cured:
            return None
        m["overflow"], m["incident"] = False, True
        if decision.gear is not None:
            level = int(np.max(np.asarray(decision.gear.level)))
            if level < Gear.STABLE:
                gs = gear_lib.set_level(decision.gear, Gear.STABLE, self.cfg)
                decision, level = dataclasses.replace(decision, gear=gs), int(Gear.STABLE)
            m["next_gear"] = max(int(np.max(m["next_gear"])), level)
        return decision, inputs, t0

    def _tier2_inputs(self, done: _Step) -> tuple:
        """``(state before, batch)`` of step ``done`` as tier 2 replays them: whole arrays."""
        before, batch = done.before, done.batch
        if self.rules is not None:
            # Replay on one device: the bisection evaluates single equations, which need whole
            # arrays; every process gathers and replays alike, so all reach the same decision.
            # Multi-process: each process holds its own rows; the global batch first.
            batch = sharding_lib.shard_batch(batch, self.rules)
            before, batch = sharding_lib.to_local((before, batch))
        return before, batch

    def _decide(self, done: _Step, m: dict, inputs: tuple) -> incidents.Decision:
        before, batch = inputs
        # The step itself: tier 2 replays the programs ``programs.replay_programs`` picks.
        return incidents.decide(self.step_fn, before, batch, done.after, m, self.cfg)

    def _incident(self, done: _Step, m: dict, decided=None) -> _Restart | None:
        """Tier 2 for one failing step: decide, log, act. See ``nan2safe_jax.incidents``.

        ``decided``: what ``_overflow_decision`` already decided for this step."""
        self._beat()
        if decided is None:
            t0 = time.perf_counter()
            inputs = self._tier2_inputs(done)
            decision = self._decide(done, m, inputs)
        else:
            decision, inputs, t0 = decided
        before, batch = inputs
        report = decision.report
        where = [getattr(report, k, None) for k in ("site", "primitive")]
        sharding_lib.agree([decision.kind, *where], "tier-2 decision")  # multi-process only
        # A batch reported as polluted input is skipped, and nothing else changes: a data
        # pipeline's NaN every few hundred steps must not end a long run at ``max_incidents``.
        # A step failing again on a rollback's replay is the incident already counted.
        again = done.replayed and done.step in self._failed_steps
        self.incidents += int(decision.kind != "polluted_input" and not again)
        if decision.kind != "polluted_input":
            self._failed_steps.add(done.step)
            self._failures += 1
        self._polluted_streak = (
            self._polluted_streak + 1 if decision.kind == "polluted_input" else 0
        )
        self.last_report = report
        rd = report.to_dict()
        rd["seconds"] = rd.get("seconds") or time.perf_counter() - t0
        if decision.kind == "polluted_input":
            rows = report.channels.get(0, [])
            # the rows are of the batch leaf itself: its axis 0 is the batch
            extra = {} if self.rules is None else {"shards": self._shards(report, batch, True)}
            self.log.append(
                "polluted_input", done.step, report=rd, leaf=report.input_path, rows=rows, **extra
            )
        elif decision.kind == "transient":
            self.log.append(
                "transient",
                done.step,
                detail=getattr(report, "reason", None)
                or "replay produced no non-finite value: suspect hardware or non-determinism",
            )
        elif decision.kind in ("located", "repeat"):
            self._save_incident(done.step, before, batch)
            extra = {} if self.rules is None else {"shards": self._shards(report, batch)}
            if decision.hint is not None:  # the culprit is in no site: no gear reaches it
                extra["hint"] = decision.hint
                log.warning("step %d: %s", done.step, decision.hint)
            self.log.append("locate", done.step, report=rd, action=decision.action, **extra)
            self._log_safe_enters(done.step, decision)
            log.info("step %d: %s\n%s", done.step, decision.action, report)
        else:  # damaged
            self.log.append("damaged", done.step, report=rd, action=decision.action)
        self._stop_past_max_incidents(done, decision, m)
        if decision.restore and decision.kind == "repeat" and done.replayed:
            # The same batch fails in SAFE again on the replay after a rollback: the batch, not
            # the state, is at fault. Another rollback would loop; its step stays skipped. It
            # shows the batches at fault for later ones (``_shown_batches_at_fault``) only
            # when it failed before the rollback (a new failure points at the state or the
            # gears) and the replay trained on the checkpoint first (``_restored`` cleared: a
            # checkpoint every replayed step fails on may hold the fault, ``_passed_over``).
            shown = again and self._restored is None
            self._batches_at_fault = self._rolled_back_to if shown else None
            self.log.append(
                "error", done.step, detail="fails again after a rollback: batch skipped"
            )
        elif decision.restore and decision.kind == "repeat" and self._shown_batches_at_fault(done):
            self._skips_in_a_row += 1
            # A new batch fails in SAFE, and the rollback to the newest checkpoint already showed
            # failures there are the batches', not the state's: another would only replay the
            # batches known to fail (newuser51: a 4-step burst of bad batches outside any site
            # made 9 incidents, two rollbacks to one checkpoint, and the run stopped).
            self.log.append(
                "error",
                done.step,
                detail=(
                    "fails again in SAFE: batch skipped (the rollback to checkpoint "
                    f"{self._batches_at_fault} showed batches, not the state, at fault)"
                ),
            )
        elif decision.restore and decision.kind != "damaged" and self._holds_huge_everywhere(done):
            # A rollback would restore a checkpoint holding the weight: the gears in place
            # again (a SAFE stay that ran out), or the stop once SAFE did not help. (A damaged
            # state is rolled back all the same.)
            return self._downshift_where_no_checkpoint_helps(done, decision, *self._huge_everywhere)
        elif decision.restore:
            self._skips_in_a_row = 0
            restart = self._rollback(done, decision, m)
            if restart is not None:
                return restart
        if decision.revert:
            m["next_gear"] = m["gear"]  # no downshift happened, after all
            before = done.before
            return _Restart(done.after.replace(gear=before.gear, opt_state=before.opt_state))
        if decision.gear is not None:
            return _Restart(done.after.replace(gear=decision.gear))
        return None

    _CLIP_STEPS = 50  # FAST steps ``_note_clipping`` reads before it says anything

    def _note_clipping(self, done: _Step, m: dict) -> None:
        """Says once (a ``clipping`` event, a warning) when ``cfg.clip_norm`` clipped at least
        90% of the first ``_CLIP_STEPS`` applied FAST steps: then training is not plain
        optax's. newuser51's healthy CNN (gradient norm ~3.9) was clipped at 1.0 on 150 of 150
        steps and ended at a higher loss than its plain loop, with nothing said."""
        clip = self.cfg.clip_norm
        if clip is None or self._clipped is None or done.replayed or int(m["gear"]) != 0:
            return
        self._clipped.append(bool(m["grad_norm"] > clip))
        if len(self._clipped) < self._CLIP_STEPS:
            return
        share = sum(self._clipped) / len(self._clipped)
        self._clipped = None  # said once, or never
        if share >= 0.9:
            detail = (
                f"clip_norm={clip} clipped {100 * share:.0f}% of the first {self._CLIP_STEPS} "
                f"FAST steps (gradient norm {m['grad_norm']:.3g} at step {done.step}): training "
                "is not plain optax's. Raise it, or pass Config(clip_norm=None) to clip nothing"
            )
            self.log.append("clipping", done.step, detail=detail, share=share)

    def _log_safe_enters(self, step_no: int, decision) -> None:
        """The ``safe_enter`` events of ``decision`` (a second for the site that made the
        culprit's near-overflow input)."""
        if decision.enter is None:
            return
        enter = dict(decision.enter)
        also = enter.pop("also", None)
        self.log.append("safe_enter", step_no, **enter)
        if also is not None:
            self.log.append("safe_enter", step_no, **also, cause="magnitude origin")

    def _shown_batches_at_fault(self, done: _Step) -> bool:
        """Whether the checkpoint a rollback from step ``done`` would restore (the newest at or
        before it, once pending saves are written) is the one whose replay showed a batch at
        fault (``_incident``), and fewer than two batches in a row were skipped on that
        ground since (a state damaged after it, by a moment no check names, still gets its
        rollback). Every process decides alike (``sharding.agree``)."""
        if self._batches_at_fault is None or self._skips_in_a_row >= 2:
            return False
        self.checkpoints.wait()
        newest = max((s for s in self.checkpoints.steps() if s <= done.step), default=None)
        shown = newest == self._batches_at_fault
        sharding_lib.agree(shown, "batch at fault")  # multi-process only
        return shown

    def _holds_huge_everywhere(self, done: _Step) -> bool:
        """Whether the state step ``done`` started from still holds the weight every
        checkpoint held (``_downshift_where_no_checkpoint_helps``); forgets it once not."""
        everywhere = self._huge_everywhere
        if everywhere is None:
            return False
        if incidents.holds_huge(done.before, *everywhere[:2]):
            return True
        self._huge_everywhere = None
        return False

    def _rollback(self, done: _Step, decision, m: dict) -> _Restart | None:
        """Restores the newest finite checkpoint at or before step ``done`` with the new gears.

        The step counter goes back to the checkpoint's, and the batches since then (the ring
        buffer's, then the failing one) are queued again, so step ``n`` always trains on the
        ``n``-th batch. Batches the ring no longer holds are listed as ``missing`` in the event.
        ``m``: the failed step's metrics (a stop here sets their ``next_gear``, as
        ``_stop_past_max_incidents`` does).

        Returns:
          The restored state and the batches to replay, or None (logged) when no finite
          checkpoint exists.
        """
        self._beat()
        huge = incidents.huge_state_leaf(decision.report)
        try:
            found = self._restore_newest(done.step, _refusing(huge))
        except _HeldByEveryCheckpoint as held:
            return self._downshift_where_no_checkpoint_helps(done, decision, *huge, held.steps)
        if found is None:
            self.log.append("error", done.step, detail="no finite checkpoint to roll back to")
            return None
        state, ckpt, extra = found
        self._rolled_back_to = int(ckpt)
        self._checkpoint_due = False  # the run starts over from a checkpoint
        if decision.gear is not None:
            state = state.replace(gear=decision.gear)
        replay = [(s, b) for s, b in self.ring if ckpt <= s < done.step]
        replay.append((done.step, done.batch))
        have = {s for s, _ in replay}
        missing = [s for s in range(ckpt, done.step + 1) if s not in have]
        kept = [(s, b) for s, b in self.ring if s < ckpt]
        self.ring = collections.deque(kept, maxlen=self.ring.maxlen)
        self.rollbacks += 1
        cause = "damaged" if decision.kind == "damaged" else huge and huge[0]
        if cause:
            last = self._rolled_back_for
            again = last is not None and last[:2] == (cause, ckpt)
            if again and last[2]:
                self._stop_where_batches_do_not_matter(done, decision, state, ckpt, extra, m)
            if again:
                # The replay after the last rollback to this checkpoint damaged the state, or
                # made the same weight huge, again: one of its batches does it (a bad update
                # replays as it ran), and no check names which. Another replay would loop;
                # those batches are dropped instead.
                extra["dropped"] = [s for s, _ in replay]
                replay = []
            self._rolled_back_for = (cause, ckpt, again)
        self.log.append(
            "rollback",
            done.step,
            to_step=int(ckpt),
            path=str(self.checkpoints.path(ckpt)),
            cause=decision.kind,
            replayed=len(replay),
            missing=missing,
            action=decision.action,
            **extra,
        )
        return _Restart(state, [(b, True) for _, b in replay], rolled_back=True)

    def _leave_on(self, step_no: int, state, ckpt: int, extra: dict) -> None:
        """A stop's last act: the trainer is left on checkpoint ``ckpt`` (``state``), as a
        resume would be, with the batches after it out of the ring (a ``stop_restore``)."""
        self._move_to(state, ckpt)
        self.log.append("stop_restore", step_no, to_step=int(ckpt), **extra)

    def _stop_where_batches_do_not_matter(self, done: _Step, decision, state, ckpt, extra, m):
        """The fault came back after the batches replayed into it were dropped (``_rollback``):
        it follows the step count, not the data (a learning-rate schedule, or any function of
        the optimizer's step, replays as it ran), and another rollback would drop the new
        batches too, training nothing (newuser50: ``fit`` returned after 27 of 60 steps).
        Stops, on the restored checkpoint, with ``NanIncidentError``."""
        detail = (
            f"step {done.step} failed again after the batches replayed into it were dropped: "
            "the fault follows the step count, not the data (a learning-rate schedule, or "
            "anything else the optimizer's step count drives, replays as it ran after a "
            "rollback)"
        )
        self.log.append("error", done.step, detail=detail)
        self._leave_on(done.step, state, ckpt, extra)
        m["next_gear"] = int(self.state.gear.level)  # the gear the trainer is left at
        raise NanIncidentError(
            f"{detail}; the trainer is left on checkpoint {ckpt}; last report:\n{decision.report}",
            decision.report,
        )

    def _downshift_where_no_checkpoint_helps(
        self, done: _Step, decision, keystr: str, top: float, steps
    ) -> _Restart:
        """The parameter the incident named huge is so in every checkpoint kept: no rollback
        removes it. The gears may still carry the run (SAFE's f32 arithmetic saturated back:
        a dense layer's fp16 output past 65504 from a kernel grown too large, the stand-in of
        ``examples/nnx_cnn.py``): the culprit's site (or the whole model, unsited) goes to
        SAFE in place, as if the weight had not been named (``incidents.downshift_in_place``).
        Once that site already ran in SAFE, or a later incident asks for a rollback while the
        state still holds the weight (``_incident``), nothing is left: the run stops
        (``_stop_where_no_checkpoint_helps``)."""
        gears = (done.before.gear, done.after.gear)
        if self.rules is not None:
            gears = sharding_lib.to_local(gears)
        instead = incidents.downshift_in_place(decision.report, *gears, self.cfg)
        if instead.kind == "repeat" or instead.gear is None:
            self._stop_where_no_checkpoint_helps(done, decision, keystr, steps)
        # (the weight as first named: a later decision's report may not name it)
        self._huge_everywhere = (keystr, top, list(steps))
        detail = f"{_held_everywhere(keystr, steps)}: no rollback removes it; instead, "
        self.log.append("error", done.step, detail=detail + instead.action)
        self._log_safe_enters(done.step, instead)
        return _Restart(done.after.replace(gear=instead.gear))

    def _stop_where_no_checkpoint_helps(self, done: _Step, decision, keystr: str, steps):
        """The parameter the incident named huge (``incidents.huge_state_leaf``) is huge in
        every checkpoint kept, back to the oldest: it was made before that one (by its
        initialisation, or a growth slower than the checkpoints kept). No rollback removes it,
        and no gear does (``incidents._downshift``): restoring the oldest anyway would replay
        into the same fault, then drop the replayed batches, then stop naming the step count
        (helper-80). Once SAFE in place did not help either (``_downshift_where_no_checkpoint_
        helps``), stops with ``NanIncidentError`` naming the weight and the checkpoints, none
        deleted, the trainer left on the state the failed step started from
        (``_leave_before``: finite, the weight in it)."""
        detail = (
            f"{_held_everywhere(keystr, steps)}: it was made before the oldest, so no rollback "
            "removes it, and SAFE in place did not help. Rescale or re-initialise it in "
            "trainer.state and trainer.save() it before fit() again (a resume restores the "
            "newest checkpoint, which holds it), or start from a new workdir; look at what grew "
            "it (the learning rate, the initialisation)"
        )
        self.log.append("error", done.step, detail=detail)
        self._leave_before(done)
        raise NanIncidentError(
            f"{detail}; the trainer is left before step {done.step}; last report:\n"
            f"{decision.report}",
            decision.report,
        )

    def _leave_before(self, done: _Step) -> None:
        """A stop that restores no checkpoint leaves the trainer on the state failed step
        ``done`` started from, at its step: the step after it, already dispatched on the
        failed step's result (``fit`` runs one step ahead), was never checked, and neither
        batch is in the ring."""
        self._move_to(done.before, done.step)

    def _move_to(self, state, step: int) -> None:
        """The trainer on ``state`` at ``step``, the batches from ``step`` on out of the ring."""
        self.state, self.step = state, int(step)
        self._checkpoint_due = False
        self.ring = collections.deque(
            [(s, b) for s, b in self.ring if s < step], maxlen=self.ring.maxlen
        )

    def _passed_over(self) -> list[int]:
        """The checkpoint a restore now passes over: the one the last rollback (or stop)
        restored, once two steps since have failed and none applied. Not a resume's: its
        first rollback, after a fault located and repeated in SAFE (two incidents), would pass
        a good checkpoint over where a run that never stopped restores it.

        Such a checkpoint is a finite state the steps refuse (a weight made ×1e15: every step
        an incident), and restoring it again would loop until ``max_incidents``. The
        checkpoint-wait in ``_finish`` keeps most of them from being written, not one saved
        from a bad update at the due step itself, or by ``save()``. One failure is not enough:
        a rollback's first replayed step may fail at another site, on a good checkpoint.
        """
        if self._restored is None:
            return []
        ckpt, failures_then = self._restored
        return [ckpt] if self._failures - failures_then >= 2 else []

    @contextlib.contextmanager
    def _logging_warnings(self, step_no: int):
        """Logs (as ``error`` events) the warnings the checkpoint reads inside the block
        raised, a checkpoint skipped as corrupt or not finite, even when the block raises."""
        caught: list = []
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                yield
        finally:
            for w in caught:
                self.log.append("error", _skipped_step(w.message, step_no), detail=str(w.message))

    def _restore_newest(self, step_no: int, refuse=None) -> tuple[TrainState, int, dict] | None:
        """The newest finite checkpoint at or before ``step_no`` that ``_passed_over`` does
        not pass over (then those after it are deleted, a timeline abandoned), or None.

        ``refuse(state)``: the checkpoint still holds the damage the incident named (a weight a
        bad update made huge, saved since: it is finite); passed over at once for an older
        one. When every checkpoint is refused, none is restored or deleted:
        ``_HeldByEveryCheckpoint`` (with the steps refused) is raised.

        Returns:
          ``(state, checkpoint step, extra)``: ``extra`` for the event
          (``passed_over``, ``deleted_checkpoints``) when a checkpoint was passed over.
        """
        self.checkpoints.wait()
        passed = self._passed_over()
        with self._logging_warnings(step_no):
            before = passed[0] - 1 if passed else step_no
            found = self.checkpoints.restore_latest(self.state, before=before)
            if found is None and passed:  # none older: the one there is, all the same
                passed = []
                found = self.checkpoints.restore_latest(self.state, before=step_no)
            refused = []
            while found is not None and refuse is not None and refuse(found[0]):
                refused.append(int(found[1]))
                older = self.checkpoints.restore_latest(self.state, before=found[1] - 1)
                if older is None:  # (a checkpoint passed over before is no better)
                    raise _HeldByEveryCheckpoint(sorted(set(refused + passed)))
                passed.append(int(found[1]))
                found = older
        if found is None:
            return None
        state, ckpt = found
        extra = {}
        if passed:
            deleted = self.checkpoints.delete_after(ckpt)
            extra = {"passed_over": passed, "deleted_checkpoints": deleted}
        if self._restored is None or self._restored[0] != ckpt:
            self._restored = (int(ckpt), self._failures)
        return state, int(ckpt), extra

    def _spike(self, done: _Step, spike: Spike) -> _Restart | None:
        """Loss-spike rollback: the checkpoint before the spike, without the data that led in.

        Restores the newest finite checkpoint at or before the spike's first step, replays the
        ring buffer up to that step, then skips ``cfg.spike_skip_batches`` batches from it (those
        the ring holds, then new ones) and, with ``cfg.spike_lr_steps``, lowers the learning
        rate by ``cfg.spike_lr_factor`` for that many steps. At most
        ``cfg.spike_max_rollbacks`` times; every decision is an event.
        """
        cfg = self.cfg
        seen = dict(start=spike.start, loss=spike.loss, baseline=spike.baseline)
        # Carrying on, the spike's level becomes the baseline: logged once, not every
        # ``spike_steps`` steps of the plateau.
        carry_on = "carry on; this loss level is the new baseline"
        if self.spike_rollbacks >= cfg.spike_max_rollbacks:
            self.spikes.accept(spike.loss)
            self.log.append("spike", done.step, **seen, action=f"rollback cap reached: {carry_on}")
            return None
        self.checkpoints.wait()
        found = self.checkpoints.restore_latest(self.state, before=spike.start)
        if found is None:
            self.spikes.accept(spike.loss)
            self.log.append(
                "spike", done.step, **seen, action=f"no checkpoint before the spike: {carry_on}"
            )
            return None
        state, ckpt = found
        if self._restored is None or self._restored[0] != ckpt:
            self._restored = (int(ckpt), self._failures)
        # the batches after the spike are skipped: a step number holds another batch now
        self._failed_steps.clear()
        self._rolled_back_to, self._batches_at_fault = int(ckpt), None
        replay = [(s, b) for s, b in self.ring if ckpt <= s < spike.start]
        have = {s for s, _ in replay}
        missing = [s for s in range(ckpt, spike.start) if s not in have]
        dropped = len([s for s, _ in self.ring if s >= spike.start]) + 1  # + the current one
        discard = max(0, cfg.spike_skip_batches - dropped)
        lowered = cfg.spike_lr_steps > 0 and cfg.spike_lr_factor < 1
        if lowered:
            state = state.replace(lr_scale=jnp.asarray(cfg.spike_lr_factor, jnp.float32))
            self._lr_left = len(replay) + cfg.spike_lr_steps
        self.ring = collections.deque(
            [(s, b) for s, b in self.ring if s < ckpt], maxlen=self.ring.maxlen
        )
        deleted = self.checkpoints.delete_after(ckpt)
        self._checkpoint_due = False  # the run starts over from a checkpoint
        self.spikes.reset_streak()
        self.spike_rollbacks += 1
        self.rollbacks += 1
        self.log.append("spike", done.step, **seen, action=f"roll back to step {ckpt}")
        self.log.append(
            "rollback",
            done.step,
            to_step=int(ckpt),
            path=str(self.checkpoints.path(ckpt)),
            cause="loss_spike",
            replayed=len(replay),
            missing=missing,
            skipped_batches=dropped + discard,
            lr_factor=cfg.spike_lr_factor if lowered else 1.0,
            lr_steps=cfg.spike_lr_steps if lowered else 0,
            deleted_checkpoints=deleted,
            action=f"skip {dropped + discard} batches from step {spike.start}",
        )
        return _Restart(
            state,
            [(b, True) for _, b in replay],
            discard=discard,
            rolled_back=True,
            refed_skip=(spike.start - ckpt, dropped + discard),
        )

    def _shards(self, report, batch, of_batch: bool = False) -> dict:
        """Which data shard / devices held the culprit's bad rows (its axis 0 = the batch);
        ``of_batch``: the report's rows are a batch leaf's own (a polluted input)."""
        sizes = {np.shape(x)[0] for x in jax.tree_util.tree_leaves(batch) if np.ndim(x) > 0}
        rows = report.channels.get(0)
        shape = (next(iter(sizes)),) if of_batch and len(sizes) == 1 else report.output_shape
        if len(sizes) != 1 or not rows or not shape or shape[0] != next(iter(sizes)):
            return {
                "shards": None,
                "note": "the culprit's output has no batch axis 0: rows cannot be attributed",
            }
        return sharding_lib.shards_of(rows, shape[0], self.rules.mesh, self.rules.data_axis)

    def _save_incident(self, step_no: int, state, batch) -> None:
        """Keeps the state before the bad step and its batch for ``nan2safe locate``."""
        d = self.workdir / "incidents" / f"step_{step_no}"
        d.mkdir(parents=True, exist_ok=True)
        host_batch = jax.tree_util.tree_map(_host_leaf, batch)
        if jax.process_index() == 0:  # the batch is whole (gathered) and alike everywhere
            with open(d / "batch.pkl", "wb") as f:
                pickle.dump(host_batch, f)
            leaves = jax.tree_util.tree_leaves(host_batch, is_leaf=_is_saved_key)
            arrays = [x.data if _is_saved_key(x) else x for x in leaves]
            np.savez(d / "batch.npz", **{f"{i:05d}": x for i, x in enumerate(arrays)})
        ckpt = Checkpointer(d / "state", async_save=False)
        try:
            ckpt.save(step_no, sharding_lib.host_arrays(state), finite=True)
        finally:
            ckpt.close()


@dataclasses.dataclass(frozen=True)
class _SavedKey:
    """A typed PRNG key of a saved batch (NumPy cannot hold one): its raw data and its
    implementation's name, for ``jax.random.wrap_key_data``."""

    data: np.ndarray
    impl: str


def _is_saved_key(x) -> bool:
    return isinstance(x, _SavedKey)


def _host_leaf(x):
    """A batch leaf as the incident saves it: a NumPy array, or a typed key's ``_SavedKey``."""
    if _is_key(x):
        return _SavedKey(np.asarray(jax.random.key_data(x)), str(jax.random.key_impl(x)))
    return np.asarray(x)


def _device_leaf(x):
    """``_host_leaf`` undone for a key; other leaves as saved."""
    return jax.random.wrap_key_data(x.data, impl=x.impl) if _is_saved_key(x) else x


def _skipped_step(message, default: int) -> int:
    """The step of the checkpoint a caught warning skipped (``SkippedCheckpoint``), else
    ``default``."""
    return message.step if isinstance(message, SkippedCheckpoint) else default


def _downshift_cause(m: dict) -> str:
    """What moved the gears down: a non-finite step, the loss scale's overflow streak (past
    ``train.OVERFLOW_GRACE`` skips in a row), or tier 1's risk."""
    if m["incident"]:
        return "nonfinite"
    return "overflow" if m["overflow"] else "risk"


def _skip_reason(m: dict) -> str:
    if m["polluted"]:
        return "polluted_input"
    if m["overflow"]:
        return "overflow"
    if m["bad_rest"]:
        return "variable"
    if m["bad_update"]:
        return "update"
    return "incident" if m["incident"] else "update"


def load_incident(workdir, step: int, template):
    """``(state, batch)`` saved by the trainer for the incident at ``step``.

    Args:
      workdir: the run directory.
      step: the step number of the incident (``incidents/step_<step>``).
      template: a ``TrainState`` of the same model (gives structure and dtypes).

    Raises:
      FileNotFoundError: no incident was saved for that step.
    """
    d = Path(workdir) / "incidents" / f"step_{step}"
    if not (d / "batch.pkl").exists():
        have = sorted(p.name for p in (Path(workdir) / "incidents").glob("step_*"))
        raise FileNotFoundError(f"no incident saved for step {step} in {workdir}; have {have}")
    with open(d / "batch.pkl", "rb") as f:
        batch = jax.tree_util.tree_map(_device_leaf, pickle.load(f), is_leaf=_is_saved_key)
    ckpt = Checkpointer(d / "state", async_save=False)
    try:
        found = ckpt.restore_latest(template)
    finally:
        ckpt.close()
    if found is None:
        raise FileNotFoundError(f"the state saved with incident {step} could not be restored")
    return found[0], batch


class _Progress:
    """A progress bar on a terminal or in a notebook; elsewhere (a batch job's log file, where
    rich draws only once, at the end) a plain line every tenth of the run. It shows the
    trainer's step (``start`` + the steps trained), which a rollback moves back: counting the
    finished steps instead read ``step 105/150`` at step 67 after replays, and ``10/100`` at
    step 60 after a resume (newuser51)."""

    def __init__(self, total: int, start: int = 0):
        from rich.console import Console
        from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

        console = Console()
        self._total, self._done, self._start = total, 0, start
        self._lines = not (console.is_terminal or console.is_jupyter)
        if self._lines:
            return
        self._p = Progress(
            TextColumn("step {task.fields[step]}/{task.fields[last]}"),
            BarColumn(),
            TextColumn("{task.fields[info]}"),
            TimeRemainingColumn(),
        )
        self._task = self._p.add_task("train", total=total, info="", step=start, last=start + total)
        self._p.start()

    def update(self, m: dict) -> None:
        info = (
            f"loss {m['loss']:.4g}  gear {('FAST', 'STABLE', 'SAFE')[m['gear']]}  "
            f"scale {m['loss_scale']:.3g}"
        )
        self._done += 1
        step = int(m["step"]) + 1  # steps trained, as ``trainer.step`` counts them
        if m.get("replay"):
            info += "  (replayed after a rollback)"
        if not self._lines:
            done = min(max(step - self._start, 0), self._total)
            self._p.update(self._task, completed=done, info=info, step=step)
        elif self._done % max(1, self._total // 10) == 0 or step == self._start + self._total:
            print(f"step {step}/{self._start + self._total}  {info}", flush=True)

    def close(self) -> None:
        if not self._lines:
            self._p.stop()
