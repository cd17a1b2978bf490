"""Trainer: the host loop around the jitted step — tier 2, the ring buffer, checkpoints, events.

The loop dispatches step t and only then reads the metrics of step t-1 (one transfer), so the
host never stalls the device between steps (docs/design.md, "Data flow"). When a step turns out
non-finite it replays that step deterministically with ``replay.locate_step``, puts the culprit
site in SAFE, and carries on; every decision lands in ``events.jsonl``.
"""

from __future__ import annotations

import collections
import importlib
import json
import logging
import os
import pickle
import time
import warnings
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import jax
import numpy as np

from nan2safe_jax import gear as gear_lib
from nan2safe_jax import replay
from nan2safe_jax import sharding as sharding_lib
from nan2safe_jax.checkpoint import Checkpointer
from nan2safe_jax.config import Config
from nan2safe_jax.gear import Gear
from nan2safe_jax.numerics import first_nonfinite, tree_is_finite
from nan2safe_jax.runlog import EventLog
from nan2safe_jax.train import TrainState, make_train_step

log = logging.getLogger(__name__)

_LOGGED = ("loss", "risk", "loss_scale", "grad_norm", "nonfinite")


class NanIncidentError(RuntimeError):
    """Raised after ``cfg.max_incidents`` non-finite incidents; ``.report`` is the last one,
    ``.history`` the per-step metrics of the interrupted ``fit`` call."""

    def __init__(self, message: str, report=None):
        super().__init__(message)
        self.report = report
        self.history: list[dict] = []  # the metrics of the interrupted fit call


def _check_workdir(workdir) -> Path:
    if workdir is None:
        raise ValueError("workdir is required: checkpoints, events and incidents are kept there")
    path = Path(workdir)
    if path.exists() and not path.is_dir():
        raise ValueError(f"workdir {str(path)!r} exists and is not a directory")
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / ".nan2safe_write_test"
        probe.write_text("ok")
        probe.unlink()
    except OSError as err:
        raise ValueError(f"workdir {str(path)!r} is not writable: {err}") from None
    return path


def _batch_is_finite(batch) -> tuple[bool, str | None]:
    """Host-side scan of a batch: (finite, key path of the first non-finite leaf)."""
    bad = first_nonfinite(batch)
    return bad is None, (None if bad is None else "batch" + bad)


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
        state_finite=bool(m["state_finite"]),
        site_gears={k: np.asarray(v).tolist() for k, v in m["site_gears"].items()},
        probe_risk={k: float(v) for k, v in m["probe_risk"].items()},
    )
    return out


def load_factory(spec: str):
    """Imports ``"package.module:function"`` and returns the function."""
    if ":" not in spec:
        raise ValueError(f"factory must look like 'package.module:function', got {spec!r}")
    mod, fn = spec.split(":", 1)
    return getattr(importlib.import_module(mod), fn)


class Trainer:
    """The host loop with both tiers, checkpoints and events.

    Args:
      model: an ``nnx.Module``; ``nan2safe.nn`` modules are sites with their own gear.
      tx: an optax transformation (wrapped in ``nan2safe.optax.guard`` when it is not one).
      loss_fn: ``loss_fn(model, batch) -> scalar``.
      cfg: thresholds (``Config()`` by default).
      workdir: run directory: ``checkpoints/``, ``events.jsonl``, ``metrics.jsonl``,
        ``incidents/``. Created when missing; resumed from when it holds checkpoints.
      lr_schedule: the optimizer's schedule, for the detector's cool-down (optional).
      factory: ``"module:function"`` returning ``(model, tx, loss_fn, cfg)``; recorded so that
        ``nan2safe locate WORKDIR --step N`` can rebuild the step offline.
      resume: resume from the newest good checkpoint in ``workdir`` (default True).
      progress: show a progress bar with loss, gear and loss scale.
      mesh: a ``jax.sharding.Mesh``; alone it means ``nan2safe.sharding.data_parallel(mesh)``.
      rules: ``nan2safe.sharding.data_parallel(...)`` / ``fsdp(...)``. The initial (or resumed)
        state is placed on the mesh, each batch is split over the data axis, checkpoints restore
        onto the current mesh (whatever mesh saved them), and tier 2 replays the failing step on
        one device from gathered arguments; its ``locate`` event gains ``"shards"`` (which data
        shard, devices and processes hold the bad batch rows). Under ``jax.distributed`` every
        process runs this loop and passes its own rows of each batch.

    Raises:
      ValueError: bad workdir or config.
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
    ):
        self.cfg = Config() if cfg is None else cfg
        if not isinstance(self.cfg, Config):
            raise ValueError(f"cfg must be a nan2safe.Config, got {type(self.cfg).__name__}")
        self.workdir = _check_workdir(workdir)
        self.loss_fn = loss_fn
        self.progress = progress
        self.rules = sharding_lib.resolve(mesh, rules)
        self.state = TrainState.create(model, tx, self.cfg)
        if self.rules is not None:
            self.state = sharding_lib.shard_state(self.state, self.rules)
        self.step_fn = make_train_step(loss_fn, lr_schedule=lr_schedule, rules=self.rules)
        self.checkpoints = Checkpointer(self.workdir / "checkpoints")
        self.log = EventLog(self.workdir)
        self.ring: collections.deque = collections.deque(maxlen=self.cfg.ring_buffer)
        self.incidents = 0
        self.last_report = None
        self.step = 0
        self._last_sites: dict[str, Any] = {}
        self._redo = None  # state to re-run the in-flight step from, after tier 2
        (self.workdir / "run.json").write_text(
            json.dumps({"factory": factory, "config": _config_dict(self.cfg)}, indent=1)
        )
        if resume:
            self._resume()

    # ------------------------------------------------------------------ setup

    def _resume(self) -> None:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            found = self.checkpoints.restore_latest(self.state)
        for w in caught:
            self.log.append("error", self.step, detail=str(w.message))
            warnings.warn(str(w.message), stacklevel=3)
        if found is None:
            return
        self.state, step = found
        self.step = int(step)
        self.log.append(
            "resume",
            self.step,
            from_step=self.step,
            path=str(self.checkpoints.path(step)),
            gear=int(self.state.gear.level),
        )

    @property
    def events(self) -> list[dict]:
        """Every event so far, as dicts with a ``"type"`` key."""
        return self.log.events

    # ------------------------------------------------------------------ loop

    def fit(self, batches: Iterable, steps: int) -> list[dict]:
        """Trains for ``steps`` steps (or until ``batches`` runs out).

        Returns:
          Per-step metric dicts (host values), in step order.

        Raises:
          NanIncidentError: more than ``cfg.max_incidents`` non-finite incidents.
        """
        if not isinstance(steps, int) or steps < 0:
            raise ValueError(f"steps must be an int >= 0, got {steps!r}")
        history: list[dict] = []
        pending = None
        bar = _Progress(steps) if self.progress else None
        it = iter(batches)
        try:
            for _ in range(steps):
                try:
                    batch = next(it)
                except StopIteration:
                    break
                step_no = self.step
                self.ring.append((step_no, batch))
                before = self.state
                self.state, metrics = self.step_fn(before, batch)
                self.step += 1
                if pending is not None:
                    history.append(self._after(*pending))
                    if bar:
                        bar.update(history[-1])
                    if self._redo is not None:
                        # Tier 2 changed the gears after the bad step: the step in flight ran
                        # with the old ones, so run it again with the new ones.
                        before, self._redo = self._redo, None
                        self.state, metrics = self.step_fn(before, batch)
                pending = (step_no, metrics, batch, before, self.state)
            if pending is not None:
                history.append(self._after(*pending))
                if bar:
                    bar.update(history[-1])
                if self._redo is not None:
                    self.state, self._redo = self._redo, None
        except NanIncidentError as err:
            err.history = history
            raise
        finally:
            if bar:
                bar.close()
            self.checkpoints.wait()
        return history

    def _after(self, step_no, metrics, batch, before, after) -> dict:
        """Everything the host does once step ``step_no``'s metrics are readable."""
        m = _host(metrics)
        m["time"] = time.time()
        safe_sites = [k for k, v in m["site_gears"].items() if np.max(v) >= Gear.SAFE]
        m["safe_sites"] = safe_sites
        self._gear_events(step_no, m)
        if m["skipped"]:
            reason = "overflow" if m["overflow"] else ("incident" if m["incident"] else "update")
            self.log.append("skip", step_no, reason=reason, loss=m["loss"])
        if m["incident"]:
            self._incident(step_no, batch, before, after, m)
        if (step_no + 1) % self.cfg.log_every == 0 or m["incident"]:
            self.log.log_metrics(
                {k: m[k] for k in m if k not in ("probe_risk",)} | {"step": step_no}
            )
        if (step_no + 1) % self.cfg.checkpoint_every == 0:
            if self.checkpoints.save(step_no + 1, after, finite=m["state_finite"]):
                self.log.append(
                    "checkpoint", step_no + 1, path=str(self.checkpoints.path(step_no + 1))
                )
            else:
                self.log.append("error", step_no + 1, detail="state not finite: no checkpoint")
        return m

    def _gear_events(self, step_no: int, m: dict) -> None:
        if m["next_gear"] > m["gear"] and m["next_gear"] == Gear.STABLE:
            fired = [k for k, v in m["probe_risk"].items() if v > 0]
            self.log.append(
                "downshift",
                step_no,
                **{"from": m["gear"], "to": m["next_gear"]},
                risk=m["risk"],
                probes=fired,
                cause="nonfinite" if m["incident"] else "risk",
            )
        elif m["next_gear"] < m["gear"] and m["next_gear"] == Gear.FAST:
            self.log.append("recover", step_no, to=m["next_gear"])
        for name, g in m["site_gears"].items():
            was = self._last_sites.get(name)
            if was is not None and np.max(was) >= Gear.SAFE and np.max(g) < Gear.SAFE:
                self.log.append("safe_exit", step_no, site=name)
        self._last_sites = m["site_gears"]

    # ------------------------------------------------------------------ tier 2

    def _incident(self, step_no: int, batch, before, after, m: dict) -> None:
        self.incidents += 1
        finite, where = _batch_is_finite(batch)
        if not finite:
            report = {"diagnosis": "polluted input", "argument": where, "primitive": None}
            self.last_report = report
            self.log.append("polluted_input", step_no, report=report)
        else:
            report = self._locate(step_no, batch, before, after, m)
            self.last_report = report
        if self.incidents > self.cfg.max_incidents:
            self.log.append("error", step_no, detail=f"{self.incidents} incidents: stopping")
            raise NanIncidentError(
                f"{self.incidents} non-finite incidents (max_incidents="
                f"{self.cfg.max_incidents}); last report:\n{report}",
                report,
            )

    def _locate(self, step_no: int, batch, before, after, m: dict):
        if not m["skipped"] or not tree_is_finite(before.params):
            found = self._replay_ring(step_no)
            if found is None:
                return None
            step_no, before, batch = found
        t0 = time.perf_counter()
        if self.rules is not None:
            # Replay on one device: the bisection evaluates single equations, which need whole
            # arrays; every process gathers and replays alike, so all reach the same report.
            before, batch = sharding_lib.to_local((before, batch))
        report = replay.locate_step(self.step_fn.jitted, before, batch)
        self._save_incident(step_no, before, batch)
        if report is None or not getattr(report, "reproducible", True):
            self.log.append(
                "transient",
                step_no,
                detail=getattr(report, "reason", None)
                or "replay produced no non-finite value: suspect hardware or non-determinism",
            )
            return report
        rd = report.to_dict()
        rd.setdefault("seconds", time.perf_counter() - t0)
        if report.primitive is None:
            self.log.append("polluted_input", step_no, report=rd)
            return report
        action, enter = self._downshift_site(report, after)
        extra = {} if self.rules is None else {"shards": self._shards(report, batch)}
        self.log.append("locate", step_no, report=rd, action=action, **extra)
        self.log.append("safe_enter", step_no, **enter)
        log.info("step %d: %s\n%s", step_no, action, report)
        return report

    def _shards(self, report, batch) -> dict:
        """Which data shard / devices held the culprit's bad rows (its axis 0 = the batch)."""
        sizes = {np.shape(x)[0] for x in jax.tree_util.tree_leaves(batch) if np.ndim(x) > 0}
        rows = report.channels.get(0)
        shape = report.output_shape
        if len(sizes) != 1 or not rows or not shape or shape[0] != next(iter(sizes)):
            return {
                "shards": None,
                "note": "the culprit's output has no batch axis 0: rows cannot be attributed",
            }
        return sharding_lib.shards_of(rows, shape[0], self.rules.mesh, self.rules.data_axis)

    def _replay_ring(self, step_no: int):
        """The state was damaged: restore the last finite checkpoint, replay the ring buffer.

        Returns ``(first bad step, state before it, its batch)``, or None (logged) when no
        checkpoint is usable or the replay stays finite.
        """
        self.checkpoints.wait()
        found = self.checkpoints.restore_latest(self.state, before=step_no)
        if found is None:
            self.log.append("error", step_no, detail="no finite checkpoint to replay from")
            return None
        state, ckpt_step = found
        entries = [(s, b) for s, b in self.ring if ckpt_step <= s <= step_no]
        if not entries or entries[0][0] != ckpt_step:
            self.log.append(
                "error",
                step_no,
                detail=f"ring buffer does not reach back to checkpoint {ckpt_step}: "
                "replaying the failing batch from the checkpoint state",
            )
            return step_no, state, dict(self.ring)[step_no]
        for s, b in entries:
            new, metrics = self.step_fn(state, b)
            if bool(metrics["incident"]):
                return s, state, b
            state = new
        self.log.append("transient", step_no, detail="ring-buffer replay stayed finite")
        return None

    def _downshift_site(self, report, after) -> tuple[str, dict]:
        """Puts the culprit's site in SAFE in the state after the bad step (then re-run).

        Returns:
          The action in words and the fields of the ``safe_enter`` event.
        """
        gs = after.gear
        site = report.site
        if site is None or site not in gs.sites:
            new = gear_lib.set_level(gs, Gear.SAFE, self.cfg)
            self._redo = after.replace(gear=new)
            enter = dict(site=None, steps=self.cfg.safe_max_steps, scope="global")
            return "culprit is in no site: whole model -> SAFE", enter
        index = None
        shape = gs.sites[site].shape
        iters = [p[1] for p in report.eqn_path if isinstance(p, tuple) and p[0] == "iter"]
        if len(shape) == 1 and len(iters) == 1 and 0 <= iters[0] < shape[0]:
            index = int(iters[0])
        new = gear_lib.set_site(gs, site, Gear.SAFE, index=index, cfg=self.cfg)
        self._redo = after.replace(gear=new)
        left = int(np.max(np.asarray(new.safe_left[site])))
        where = site if index is None else f"{site}[{index}]"
        return f"site {where} -> SAFE for {left} steps", dict(site=site, steps=left, layer=index)

    def _save_incident(self, step_no: int, state, batch) -> None:
        """Keeps the state before the bad step and its batch for ``nan2safe locate``."""
        d = self.workdir / "incidents" / f"step_{step_no}"
        d.mkdir(parents=True, exist_ok=True)
        host_batch = jax.tree_util.tree_map(np.asarray, batch)
        with open(d / "batch.pkl", "wb") as f:
            pickle.dump(host_batch, f)
        leaves = jax.tree_util.tree_leaves(host_batch)
        np.savez(d / "batch.npz", **{f"{i:05d}": x for i, x in enumerate(leaves)})
        Checkpointer(d / "state", async_save=False).save(step_no, state, finite=True)


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
        batch = pickle.load(f)
    found = Checkpointer(d / "state", async_save=False).restore_latest(template)
    if found is None:
        raise FileNotFoundError(f"the state saved with incident {step} could not be restored")
    return found[0], batch


class _Progress:
    def __init__(self, total: int):
        from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

        self._p = Progress(
            TextColumn("step {task.completed}/{task.total}"),
            BarColumn(),
            TextColumn("{task.fields[info]}"),
            TimeRemainingColumn(),
        )
        self._task = self._p.add_task("train", total=total, info="")
        self._p.start()

    def update(self, m: dict) -> None:
        info = (
            f"loss {m['loss']:.4g}  gear {('FAST', 'STABLE', 'SAFE')[m['gear']]}  "
            f"scale {m['loss_scale']:.3g}"
        )
        self._p.update(self._task, advance=1, info=info)

    def close(self) -> None:
        self._p.stop()


def _config_dict(cfg: Config) -> dict:
    import dataclasses

    return dataclasses.asdict(cfg)
