"""Trainer: both tiers end to end, checkpoints, events, bad input, resume after SIGKILL."""

import dataclasses
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from tiny_models import (
    LLVM_O0,
    D,
    MonitoredNet,
    Net,
    data,
    loss_fn,
    make_fragile,
    make_fragile_aux,
)

from nan2safe_jax import Config, Gear, Trainer, cli
from nan2safe_jax import gear as gear_lib
from nan2safe_jax import nn as nan2safe_nn
from nan2safe_jax import train as nan2safe_train
from nan2safe_jax.report import read_events, read_metrics, summary
from nan2safe_jax.site import SiteGear, site_scope
from nan2safe_jax.supervisor import NanIncidentError

CFG = Config(checkpoint_every=5, safe_max_steps=3, recovery_window=8, min_history=8)


def _batches(n, bad=None, seed=0):
    x, y = data(n, seed=seed)
    out = [(x[i], y[i]) for i in range(n)]
    for k, kind in (bad or {}).items():
        xk = np.array(out[k][0])
        if kind == "constant_row":
            xk[3, :] = 1.5  # one row of identical features: zero variance
        elif kind == "nan":
            xk[0, 2] = np.nan
        elif kind == "huge":
            xk[1, 5] = 1e30  # finite, but its square passes f32 in the first LayerNorm
        out[k] = (jnp.asarray(xk), out[k][1])
    return out


def _types(events):
    return [e["type"] for e in events]


def test_one_trainer_per_workdir_and_a_changed_model_never_overwrites_the_run(tmp_path):
    """A second trainer of this process takes the workdir over (the first is closed) and keeps
    the factory the run recorded; one of a changed model is refused before it writes anything;
    a changed config is said on resume; ``resume=False`` over the run's checkpoints is refused
    (the new run's saves replaced and pruned the old run's, and a restart resumed the old)."""
    run = tmp_path / "run"
    first = Trainer(Net(rngs=nnx.Rngs(0)), optax.adam(1e-3), loss_fn, CFG, run, factory="m:f")
    first.fit(_batches(5), steps=5)
    with pytest.warns(UserWarning, match="takes workdir .* over"):
        second = Trainer(Net(rngs=nnx.Rngs(0)), optax.adam(1e-3), loss_fn, CFG, run)
    assert first.closed and second.step == 5
    assert json.loads((run / "run.json").read_text())["factory"] == "m:f"
    with pytest.raises(ValueError, match="is closed"):
        first.fit(_batches(1), steps=1)
    record = (run / "run.json").read_text()

    # A trainer that is refused (a changed model) leaves the one holding the workdir running.
    wider = Net(rngs=nnx.Rngs(0))
    wider.head = nnx.Linear(D, 2, rngs=nnx.Rngs(1))
    with pytest.raises(ValueError, match="written for a different model: .*head"):
        Trainer(wider, optax.adam(1e-3), loss_fn, CFG, run)
    assert not second.closed
    assert (run / "run.json").read_text() == record
    assert sorted(int(p.name) for p in (run / "checkpoints").iterdir()) == [0, 5]
    second.fit(_batches(1), steps=1)
    second.close()

    # A save that a killed run left half-written (orbax's tmp folder) is said, not passed over.
    (run / "checkpoints" / "10.orbax-checkpoint-tmp-1234").mkdir()
    looser = Config(checkpoint_every=5, safe_max_steps=3, recovery_window=9, min_history=8)
    with pytest.warns(UserWarning) as said:
        with Trainer(Net(rngs=nnx.Rngs(0)), optax.adam(1e-3), loss_fn, looser, run) as third:
            assert third.step == 5  # the workdir was let go when the refused trainer closed
    # both said at the user's Trainer(...) line, not the library's (newuser52)
    assert all(w.filename == __file__ for w in said), [(w.filename, w.lineno) for w in said]
    said = [str(w.message) for w in said]
    assert any("changed config: recovery_window 8 -> 9" in w for w in said), said
    assert any("never finished (steps [10]" in w and "from checkpoint 5" in w for w in said)
    (lost,) = [e for e in read_events(run) if "never finished" in e.get("detail", "")]
    assert lost["type"] == "error" and lost["step"] == 5
    (resume,) = [e for e in read_events(run) if e["type"] == "resume"][-1:]
    assert resume["config_changed"] == {"recovery_window": [8, 9]}
    assert json.loads((run / "run.json").read_text())["config"]["recovery_window"] == 9

    with pytest.raises(ValueError, match=r"resume=False: .* checkpoints \(steps \[0, 5, 10\]\)"):
        Trainer(Net(rngs=nnx.Rngs(0)), optax.adam(1e-3), loss_fn, looser, run, resume=False)
    held = {p.name for p in (run / "checkpoints").iterdir()}
    assert held == {"0", "5", "10.orbax-checkpoint-tmp-1234"}, held
    assert json.loads((run / "run.json").read_text())["config"]["recovery_window"] == 9


def test_save_keeps_a_runs_last_steps_and_a_resume_goes_past_a_damaged_record(tmp_path):
    """``fit`` checkpoints every ``checkpoint_every`` steps and ``close`` saves nothing, so a
    run that ends at 12 resumed at 10 unless ``save`` is called. A run record cut short (a kill
    while it was written) and a corrupt newest checkpoint each cost no more than themselves:
    the run resumes from the checkpoint before, and the skipped one is logged at its own step
    (it was logged at step 0, the step before the resume)."""
    run = tmp_path / "run"

    def trainer():
        return Trainer(Net(rngs=nnx.Rngs(0)), optax.adam(1e-3), loss_fn, CFG, run, factory="m:f")

    with trainer() as tr:
        tr.fit(_batches(12), steps=12)
        assert tr.checkpoints.steps() == [0, 5, 10]
        assert tr.save() and tr.save()  # the second finds checkpoint 12 there
        assert tr.checkpoints.steps() == [5, 10, 12]
        trained = tr.state
    with trainer() as tr:
        assert tr.step == 12
        np.testing.assert_array_equal(
            tr.state.params["head"]["kernel"], trained.params["head"]["kernel"]
        )
    record = run / "run.json"
    record.write_text(record.read_text()[:40])
    for root, _, files in os.walk(run / "checkpoints" / "12"):
        for f in files:
            open(os.path.join(root, f), "w").close()
    with pytest.warns(Warning) as said:
        tr = trainer()
    said = [str(w.message) for w in said]
    assert any("run.json' is damaged" in w for w in said), said
    assert any("checkpoints/12 is incomplete or corrupt" in w for w in said), said
    assert tr.step == 10
    tr.close()
    ev = read_events(run)
    last = max(i for i, e in enumerate(ev) if e["type"] == "resume")
    assert (ev[last]["step"], ev[last + 1]["type"], ev[last + 1]["step"]) == (10, "error", 12)
    assert json.loads(record.read_text())["config"]["checkpoint_every"] == 5  # written whole
    assert [p.name for p in run.iterdir() if p.name.startswith(".run.json")] == []

    # A state replaced since its checkpoint (gears set by hand) is saved over it.
    with trainer() as tr:
        tr.state = tr.state.replace(gear=gear_lib.set_level(tr.state.gear, Gear.SAFE))
        assert tr.save() and tr.checkpoints.steps() == [5, 10, 12]  # 12: the corrupt one
    with trainer() as tr:
        assert tr.step == 10 and int(tr.state.gear.level) == Gear.SAFE
    # A run record that cannot be written (a folder of that name): said, and training goes on.
    record.unlink()
    record.mkdir()
    with pytest.warns(RuntimeWarning, match="cannot write the run record"):
        tr = trainer()
    tr.fit(_batches(2), steps=2)
    tr.close()


def test_a_checkpoint_that_cannot_be_written_is_an_oserror_that_hides_no_other(
    tmp_path, monkeypatch
):
    """A full disk failed orbax's background save with ``ValueError: RESOURCE_EXHAUSTED``
    raised from ``fit``'s last wait, over the error that was leaving ``fit`` (the loader's),
    and the log said checkpoint 5 was saved. Now it is a ``CheckpointSaveError`` (an
    ``OSError``) naming the step, logged, and raised only when nothing else is."""
    tr = Trainer(Net(rngs=nnx.Rngs(0)), optax.adam(1e-3), loss_fn, CFG, tmp_path / "run")
    tr.fit(_batches(3), steps=3)
    manager = tr.checkpoints._manager
    real = manager.wait_until_finished
    disk = {"full": True}

    def full_disk():
        real()
        if disk["full"] and tr.checkpoints._writing is not None:
            raise ValueError("RESOURCE_EXHAUSTED: Failed writing: No space left on device")

    monkeypatch.setattr(manager, "wait_until_finished", full_disk)
    with pytest.raises(OSError, match=r"checkpoint 5 .* could not be written .*No space") as err:
        tr.fit(_batches(5, seed=1), steps=5)
    assert err.value.step == 5
    disk["full"] = False

    def loader():
        yield from _batches(11 - tr.step, seed=2)  # to step 10: checkpoint 10 is being written
        disk["full"] = True
        raise RuntimeError("the loader died")

    with pytest.raises(RuntimeError, match="the loader died"):
        tr.fit(loader(), steps=10)
    disk["full"] = False
    tr.close()
    failed = [
        e["step"]
        for e in read_events(tmp_path / "run")
        if e.get("detail", "").startswith("checkpoint")
    ]
    assert failed == [5, 10]
    # The report counts the checkpoints written (0 only): checkpoint 10's save had started, and
    # logged a ``checkpoint`` event, before its write failed (newuser33: counted as saved).
    logged = [e["step"] for e in read_events(tmp_path / "run") if e["type"] == "checkpoint"]
    s = summary(tmp_path / "run")
    assert logged == [0, 10] and (s["checkpoints"], s["checkpoints_failed"]) == (1, 2)


def test_a_failed_save_raised_by_a_rollbacks_wait_is_logged_too(tmp_path, monkeypatch):
    """orbax raises a failed background save once, at whichever wait comes next. When that was
    a rollback's (the state at checkpoint 10 damaged), the error left ``fit`` unlogged, and the
    log kept checkpoint 5 as saved (review20)."""
    from nan2safe_jax.checkpoint import Checkpointer, CheckpointSaveError

    tr = Trainer(Net(rngs=nnx.Rngs(0)), optax.adam(1e-3), loss_fn, CFG, tmp_path / "run")
    tr.fit(_batches(3), steps=3)
    manager = tr.checkpoints._manager
    real_save, real_wait = manager.save, manager.wait_until_finished
    failing = {"now": False}

    def save(step, *a, **k):
        out = real_save(step, *a, **k)
        failing["now"] |= step == 5  # checkpoint 5's background write fails
        return out

    def wait():
        real_wait()
        if failing["now"]:
            failing["now"] = False  # raised once, as orbax does
            raise ValueError("RESOURCE_EXHAUSTED: No space left on device")

    monkeypatch.setattr(manager, "save", save)
    monkeypatch.setattr(manager, "wait_until_finished", wait)
    real_ck_save = Checkpointer.save

    def refuse_10(self, step, state, *, finite=None):  # damaged at 10: a rollback
        return real_ck_save(self, step, state, finite=False if step == 10 else finite)

    monkeypatch.setattr(Checkpointer, "save", refuse_10)
    with pytest.raises(CheckpointSaveError):
        tr.fit(_batches(9, seed=1), steps=9)
    tr.close()
    ev = read_events(tmp_path / "run")
    assert [e["step"] for e in ev if "could not be written" in e.get("detail", "")] == [5]


def test_clean_run_checkpoints_and_logs(tmp_path, capsys):
    """Also: the progress shown where stdout is no terminal (a batch job's log) is a line per
    tenth of the run (rich drew once, at the end) naming the trainer's step, and ``steps`` may
    be a NumPy integer."""
    run = tmp_path / "run"
    tr = Trainer(Net(rngs=nnx.Rngs(0)), optax.adam(1e-3), loss_fn, CFG, run, progress=True)
    hist = tr.fit(_batches(12), steps=12)
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("step ")]
    assert len(lines) == 12 and lines[-1].startswith("step 12/12  loss ")
    assert len(hist) == 12 and all(np.isfinite(h["loss"]) for h in hist)
    assert [e["step"] for e in tr.events if e["type"] == "checkpoint"] == [0, 5, 10]
    assert tr.checkpoints.steps() == [0, 5, 10]
    assert len(read_metrics(tmp_path / "run")) == 12
    assert int(tr.state.step) == 12
    # An iterator shorter than ``steps`` ends ``fit`` early, said once in the log.
    more = tr.fit(iter(_batches(3, seed=1)), steps=np.int64(5))
    assert len(more) == 3 and tr.step == 15
    # the progress counts the trainer's steps, not this call's records (newuser51)
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("step ")]
    assert [ln.split()[1] for ln in lines] == ["13/17", "14/17", "15/17"], lines
    (end,) = [e for e in tr.events if e["type"] == "data_end"]
    assert (end["step"], end["drawn"], end["steps"]) == (15, 3, 5)


@pytest.mark.two_programs
def test_fault_is_located_put_in_safe_and_recovers(tmp_path, capsys):
    # Step 12, the first after the SAFE stay (9-11), brings the constant row back. The loss
    # returns an aux output (has_aux), which the offline replay must rebuild from run.json.
    batches = _batches(30, bad={8: "constant_row", 9: "constant_row", 12: "constant_row"})
    model, tx, loss, cfg = make_fragile_aux()
    factory = "tiny_models:make_fragile_aux"
    tr = Trainer(model, tx, loss, cfg, tmp_path / "run", factory=factory, has_aux=True)
    hist = tr.fit(batches, steps=30)
    ev = tr.events
    for e in (e for e in ev if e["type"] == "downshift"):  # the top-risk probes, among those
        assert set(e["trigger"]) <= set(e["probes"]) and bool(e["trigger"]) == bool(e["probes"])
    locate = [e for e in ev if e["type"] == "locate"]
    assert locate, _types(ev)
    rep = locate[0]["report"]
    assert locate[0]["step"] == 8
    assert rep["site"] == "blocks.0"
    assert rep["primitive"] in ("div", "sqrt", "rsqrt")
    assert rep["kind"] == "nan" and rep["direction"] == "forward"
    assert 3 in rep["channels"]["0"]  # the constant row
    enter = [e for e in ev if e["type"] == "safe_enter"]
    assert enter and enter[0]["site"] == "blocks.0"
    # Step 9 repeats the fault, but the site is in SAFE now: finite, not skipped.
    assert hist[9]["finite"] and not hist[9]["skipped"]
    assert any(e["type"] == "safe_exit" and e["site"] == "blocks.0" for e in ev)
    order = _types(ev)
    assert order.index("skip") < order.index("locate") < order.index("safe_enter")
    assert order.index("safe_enter") < order.index("safe_exit")
    # The stay's exit is logged before the new incident's locate and enter, all at step 12, so
    # a reader of the events (the dashboard's fallback) sees SAFE from 13 on, not a 1-step stay.
    at12 = [e["type"] for e in ev if e["step"] == 12 and e["type"] != "checkpoint"]
    assert at12[at12.index("safe_exit") :][:3] == ["safe_exit", "locate", "safe_enter"], at12
    assert np.isfinite(hist[-1]["loss"]) and hist[-1]["loss"] < hist[0]["loss"]
    assert (tmp_path / "run" / "incidents" / "step_8" / "batch.npz").exists()

    # Offline: `nan2safe locate WORKDIR --step 8` rebuilds the step from the recorded factory.
    out = tmp_path / "offline.json"
    assert cli.main(["locate", str(tmp_path / "run"), "--step", "8", "--json", str(out)]) == 0
    offline = json.loads(out.read_text())
    assert (offline["primitive"], offline["site"]) == (rep["primitive"], rep["site"])
    assert offline["source"] == rep["source"]
    assert json.loads((tmp_path / "run" / "run.json").read_text())["has_aux"] is True
    # has_aux: the loss function's own values land in the history and in metrics.jsonl.
    assert all(isinstance(h["aux"]["mean_out"], float) for h in hist)
    assert all(h["aux"]["rows"] is None for h in hist)  # an array: not logged every step
    logged = read_metrics(tmp_path / "run")
    assert logged and all(r["aux"]["rows"] is None and "mean_out" in r["aux"] for r in logged)
    # No incident at that step, or a factory that does not import: a message, not a traceback.
    capsys.readouterr()
    assert cli.main(["locate", str(tmp_path / "run"), "--step", "3"]) == 2
    assert "no incident saved for step 3" in capsys.readouterr().err
    bad = ["locate", str(tmp_path / "run"), "--step", "8", "--factory", "no_such_mod:f"]
    assert cli.main(bad) == 2
    assert "cannot load the factory 'no_such_mod:f'" in capsys.readouterr().err

    # A factory whose loss_fn does not match the recorded has_aux: said, not a traceback.
    mismatch = ["locate", str(tmp_path / "run"), "--step", "8", "--factory"]
    assert cli.main([*mismatch, "tiny_models:make_fragile"]) == 2
    assert "recorded has_aux=True" in capsys.readouterr().err
    # A run record cut short (a writer killed): said; a --factory still locates, has_aux then
    # read from what the loss returns.
    record = tmp_path / "run" / "run.json"
    record.write_text(record.read_text()[:40])
    with pytest.warns(RuntimeWarning, match=r"run record .*run\.json.* is damaged"):
        assert cli.main([*mismatch, factory, "--json", str(out)]) == 0
    assert json.loads(out.read_text())["primitive"] == rep["primitive"]

    # `nan2safe report WORKDIR`: the dashboard of this run.
    assert cli.main(["report", str(tmp_path / "run")]) == 0
    png = tmp_path / "run" / "dashboard.png"
    assert png.exists() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


class _Fp16Mlp(nnx.Module):
    """flax layers computing in fp16 over f32 parameters (the usual mixed precision)."""

    def __init__(self, rngs):
        self.l1 = nnx.Linear(D, 16, dtype=jnp.float16, rngs=rngs)
        self.l2 = nnx.Linear(16, 1, dtype=jnp.float16, rngs=rngs)

    def __call__(self, x):
        return self.l2(nnx.relu(self.l1(x)))


def test_an_fp16_layer_whose_f32_weight_overflows_the_cast_is_located_and_run_in_safe(tmp_path):
    """One f32 weight past 65504 is inf once the layer casts it to fp16. Tier 2 names that
    layer (not "outside every site"), and SAFE there computes it from the f32 weight."""
    net = _Fp16Mlp(nnx.Rngs(0))
    net.l1.kernel[...] = net.l1.kernel[...].at[0, 0].set(7e4)
    x, y = data(4, scale=[1e-4] * 4)  # inputs ~1e-4: the true activations stay small
    tr = Trainer(nan2safe_nn.convert(net), optax.adam(1e-3), loss_fn, CFG, tmp_path / "run")
    hist = tr.fit([(x[i], y[i]) for i in range(4)], steps=4)
    locate = [e for e in tr.events if e["type"] == "locate"]
    assert [e["step"] for e in locate] == [0], _types(tr.events)
    rep = locate[0]["report"]
    assert (rep["site"], rep["primitive"], rep["direction"]) == (
        "l1",
        "convert_element_type",
        "forward",
    )
    assert [e["site"] for e in tr.events if e["type"] == "safe_enter"] == ["l1"]
    assert hist[0]["skipped"] and all(h["finite"] and not h["skipped"] for h in hist[1:])
    assert all(h["safe_sites"] == ["l1"] for h in hist[1:])
    tr.close()


class _Bf16Norm(nnx.Module):
    """A bf16 LayerNorm of ``x * g * g`` (``x, g``: the batch): a gain of 5.5e9 (an ordinary
    batch value; a batch value past 2**64 would be the data's fault) makes inputs of 3e19."""

    def __init__(self, rngs):
        self.ln = nan2safe_nn.LayerNorm(D, dtype=jnp.bfloat16, rngs=rngs)
        self.head = nnx.Linear(D, 1, dtype=jnp.bfloat16, rngs=rngs)

    def __call__(self, xg):
        x, g = xg
        return self.head(self.ln((x * g * g).astype(jnp.bfloat16)))


def test_a_norm_whose_statistics_overflow_at_a_finite_loss_is_located_and_run_in_safe(tmp_path):
    """Inputs past ~1e19 overflow a bf16 LayerNorm's f32 variance to a finite, wrong output
    (zeros) at a finite loss: only the norm's probe reads the inf. The Trainer skips the step,
    tier 2 names the norm, and the same inputs train in SAFE from the next step on."""
    x, y = data(4)
    centred = x - x.mean(-1, keepdims=True)  # E[x²] overflows f32; mean² stays far below
    g = [1.0, 1.0, 5.5e9, 5.5e9]  # squared: 3e19
    batches = [((centred[i] if g[i] > 1 else x[i], jnp.float32(g[i])), y[i]) for i in range(4)]
    tr = Trainer(_Bf16Norm(nnx.Rngs(0)), optax.adam(1e-3), loss_fn, CFG, tmp_path / "run")
    hist = tr.fit(batches, steps=4)
    locate = [e for e in tr.events if e["type"] == "locate"]
    assert [e["step"] for e in locate] == [2], _types(tr.events)
    rep = locate[0]["report"]
    assert rep["site"] == "ln" and rep["primitive"] in ("square", "reduce_sum"), rep
    assert rep["diagnosis"] == "overflow"
    assert [e["site"] for e in tr.events if e["type"] == "safe_enter"] == ["ln"]
    assert np.isfinite(hist[2]["loss"]) and hist[2]["skipped"] and hist[2]["incident"]
    assert hist[3]["finite"] and not hist[3]["skipped"] and hist[3]["safe_sites"] == ["ln"]
    leaves = jax.tree_util.tree_leaves(tr.state.params)
    assert all(bool(jnp.all(jnp.isfinite(v))) for v in leaves)
    tr.close()


def test_nan_in_the_data_is_reported_as_data(tmp_path, capsys):
    """A NaN batch and one holding 1e30 (finite, but it squares past f32: newuser52's was
    blamed on the first LayerNorm, sent to SAFE) with ``max_incidents=1``: a batch reported as
    polluted input is skipped and not counted (a soak run's data NaN every 100 steps ended it at
    the 9th); two in a row stop the run."""
    cfg = dataclasses.replace(CFG, max_incidents=1)
    tr = Trainer(Net(rngs=nnx.Rngs(0)), optax.adam(1e-3), loss_fn, cfg, tmp_path / "run")
    hist = tr.fit(_batches(6, bad={2: "nan", 4: "huge"}), steps=6)
    ev = tr.events
    polluted = [e for e in ev if e["type"] == "polluted_input"]
    assert [e["step"] for e in polluted] == [2, 4] and tr.incidents == 0
    assert polluted[0]["leaf"] == "[0]" and polluted[0]["rows"] == [0]
    assert polluted[1]["leaf"] == "[0]" and polluted[1]["rows"] == [1]
    assert polluted[1]["report"]["kind"] == "huge", polluted[1]
    # no equation blamed: neither pass (newuser51 read "forward" as an op located)
    assert polluted[0]["report"]["diagnosis"] == "polluted input"
    assert polluted[0]["report"]["direction"] is None
    assert not any(e["type"] in ("locate", "downshift", "rollback") for e in ev)
    assert hist[2]["skipped"] and hist[2]["polluted"] and not hist[2]["incident"]
    # No downshift, no loss-scale cut, and the next step does not count as non-finite.
    assert all(h["gear"] == Gear.FAST for h in hist)
    assert hist[3]["loss_scale"] == hist[2]["loss_scale"] == hist[0]["loss_scale"]
    assert hist[3]["nonfinite"] == 0
    # ... but more than max_incidents of them in a row stop the run: the pipeline is broken.
    with pytest.raises(NanIncidentError, match="2 batches in a row were polluted input"):
        tr.fit(_batches(3, bad={0: "nan", 1: "nan", 2: "nan"}, seed=1), steps=3)
    assert tr.incidents == 0
    tr.close()
    # Nothing was saved to replay at that step; ``nan2safe locate`` says why.
    capsys.readouterr()
    located = ["locate", str(tmp_path / "run"), "--step", "2"]
    assert cli.main([*located, "--factory", "tiny_models:make_fragile"]) == 2
    err = capsys.readouterr().err
    assert "no incident saved for step 2" in err and "logged as polluted_input" in err


def test_damaged_state_is_rolled_back_and_never_trained_on(tmp_path):
    with Trainer(Net(rngs=nnx.Rngs(0)), optax.adam(1e-3), loss_fn, CFG, tmp_path / "run") as tr:
        batches = _batches(16)
        tr.fit(batches[:7], steps=7)
        assert tr.checkpoints.steps() == [0, 5]
        # A bit flip in the live state: every weight NaN.
        tr.state = tr.state.replace(params=jax_tree_nan(tr.state.params))
        hist = tr.fit(batches[7:], steps=9)
        ev = tr.events
        rb = [e for e in ev if e["type"] == "rollback"]
        assert len(rb) == 1 and rb[0]["to_step"] == 5 and rb[0]["cause"] == "damaged"
        assert rb[0]["step"] == 7 and rb[0]["missing"] == []
        (damaged,) = [e for e in ev if e["type"] == "damaged"]
        assert damaged["report"]["diagnosis"] == "damaged state"  # not the data's "polluted input"
        assert damaged["report"]["direction"] is None
        # Steps 5 and 6 ran again from the ring buffer, then 7 (the failing batch) onwards.
        replayed = [h["step"] for h in hist if h.get("replay")]
        assert replayed == [5, 6, 7]
        after = hist[hist.index(next(h for h in hist if h.get("replay"))) :]
        assert all(np.isfinite(h["loss"]) and not h["skipped"] for h in after)
        assert int(tr.state.step) == tr.step == 16
        assert tr.checkpoints.steps() == [5, 10, 15]
        assert not any(e["type"] == "locate" for e in ev)
        # the rollback restored checkpoint 5's gears: no downshift took effect, none is logged
        # (newuser48: a "downshift" 0 -> 1 at the failing step, every step after at gear 0)
        assert not any(e["type"] == "downshift" for e in ev), _types(ev)
        failed = next(h for h in hist if h["step"] == 7 and not h.get("replay"))
        assert failed["next_gear"] == Gear.FAST
        # ... and metrics.jsonl reads as the history does (it was written before the rollback)
        logged = next(r for r in read_metrics(tmp_path / "run") if r["step"] == 7)
        assert logged["next_gear"] == Gear.FAST and logged["incident"]


def test_a_state_damaged_before_the_first_checkpoint_is_rolled_back_to_step_0(tmp_path):
    """``fit`` saves the state training starts from as checkpoint 0, so damage before
    checkpoint ``checkpoint_every`` is rolled back too (it was "no finite checkpoint to roll
    back to", and the run went on from the damaged state)."""
    with Trainer(Net(rngs=nnx.Rngs(0)), optax.adam(1e-3), loss_fn, CFG, tmp_path / "run") as tr:
        batches = _batches(8)
        tr.fit(batches[:2], steps=2)
        assert tr.checkpoints.steps() == [0]
        tr.state = tr.state.replace(params=jax_tree_nan(tr.state.params))
        hist = tr.fit(batches[2:], steps=6)
        ev = tr.events
        (rb,) = [e for e in ev if e["type"] == "rollback"]
        assert (rb["step"], rb["to_step"], rb["cause"], rb["missing"]) == (2, 0, "damaged", [])
        assert [h["step"] for h in hist if h.get("replay")] == [0, 1, 2]
        assert not any("no finite checkpoint" in e.get("detail", "") for e in ev)
        assert int(tr.state.step) == tr.step == 8 and tr.checkpoints.steps() == [0, 5]
        assert all(np.isfinite(h["loss"]) for h in hist if h.get("replay") or h["step"] > 2)


@jax.custom_vjp
def _gate(x):
    return jnp.tanh(x)


def _gate_fwd(x):
    return jnp.tanh(x), x


def _gate_bwd(x, g):
    zero = (x - x).astype(g.dtype)
    return (g * zero / zero,)  # FAULT:gate_bwd — 0/0 in the backward rule alone


_gate.defvjp(_gate_fwd, _gate_bwd)


class _GatedNet(nnx.Module):
    def __init__(self, dtype, *, rngs):
        self.lin = nnx.Linear(D, 1, dtype=dtype, param_dtype=jnp.float32, rngs=rngs)

    def __call__(self, x):
        return _gate(self.lin(x))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16])  # bf16: tests/test_incidents.py
def test_non_finite_gradients_at_a_finite_loss_are_an_overflow_only_where_a_scale_can_help(
    tmp_path, dtype
):
    """A backward rule's 0/0 at a finite loss: in an fp16 model it reads as the loss scale's
    overflow (skip, halve; tier 2 from the 17th in a row), which a scale may cure. In an f32 or
    bf16 model no scale can, so it is an incident at once: tier 2 names the rule's division,
    where it read "overflow" 17 times (an f32 scale halved 32768 -> 1) before anyone looked."""
    trainer = Trainer(_GatedNet(dtype, rngs=nnx.Rngs(0)), optax.adam(1e-3), loss_fn, CFG, tmp_path)
    history = trainer.fit(_batches(1), steps=1)
    trainer.close()
    skips = [e for e in trainer.events if e["type"] == "skip"]
    assert [e["step"] for e in skips] == [0]
    locates = [e for e in trainer.events if e["type"] == "locate"]
    if dtype == jnp.float16:
        assert skips[0]["reason"] == "overflow" and not locates
        assert history[0]["overflow"] and not history[0]["incident"]
        return
    assert skips[0]["reason"] == "incident" and history[0]["incident"]
    assert not history[0]["overflow"] and history[0]["next_gear"] >= Gear.STABLE
    (rep,) = [e["report"] for e in locates]
    assert rep["primitive"] == "div" and rep["direction"] == "backward", rep
    assert rep["diagnosis"] == "0/0" and rep["source"].startswith(__file__), rep


def test_an_f32_overflow_that_a_scale_cures_or_a_replay_cannot_repeat_stays_the_scales(tmp_path):
    """Two "overflows" of an f32 model that are not incidents (review24): a one-off NaN the
    replay does not repeat (transient, step 0), and finite gradients whose scaled squares pass
    f32's range (the step's own sum names them; halving cures it, step 2). Each stays a skip
    with a halved scale: no locate, no downshift, and the live state's gears are the record's."""
    flaky = {"calls": 0}

    def host(g):
        flaky["calls"] += 1
        return np.full_like(g, np.nan) if flaky["calls"] == 1 else g  # step 0's, never again

    @jax.custom_vjp
    def gate(x):
        return jnp.tanh(x)

    def bwd(x, g):
        g = jax.pure_callback(host, jax.ShapeDtypeStruct(g.shape, g.dtype), g)
        return (g * (1 - jnp.tanh(x) ** 2),)

    gate.defvjp(lambda x: (jnp.tanh(x), x), bwd)

    class Gated(nnx.Module):
        def __init__(self, *, rngs):
            self.lin = nnx.Linear(D, 1, rngs=rngs)

        def __call__(self, x):
            return gate(self.lin(x))

    batches = _batches(4)
    x2, y2 = batches[2]
    batches[2] = (x2, y2 * 1e16)  # gradient norm ~1e16: x 2**14, its square passes 3.4e38
    with Trainer(Gated(rngs=nnx.Rngs(0)), optax.adam(1e-3), loss_fn, CFG, tmp_path) as tr:
        hist = tr.fit(batches, steps=4)
        ev = tr.events
        level = int(tr.state.gear.level)
    assert [h["overflow"] for h in hist] == [True, False, True, False], hist
    assert not any(h["incident"] for h in hist) and level == Gear.FAST
    assert not any(e["type"] in ("locate", "downshift", "safe_enter") for e in ev), _types(ev)
    assert [e["reason"] for e in ev if e["type"] == "skip"] == ["overflow", "overflow"]
    assert hist[-1]["loss_scale"] == hist[0]["loss_scale"] / 4


def test_a_model_variable_that_overflows_is_located_and_the_model_safe_stay_logged_once(
    tmp_path,
):
    """A running statistic that overflows while the loss stays finite: the step is skipped
    (the state is never trained on), tier 2 names the line that made it, and the whole-model
    SAFE stay (the line is in no site) is one ``safe_enter`` and one ``safe_exit``."""
    x, y = data(14)
    batches = [(x[i] * 1e6 if i == 3 else x[i], y[i]) for i in range(14)]
    with Trainer(MonitoredNet(rngs=nnx.Rngs(0)), optax.adam(1e-3), loss_fn, CFG, tmp_path) as tr:
        hist = tr.fit(batches, steps=14)
        ev = tr.events
    assert hist[3]["skipped"] and hist[3]["bad_rest"] and hist[3]["finite"]
    skip = next(e for e in ev if e["type"] == "skip")
    assert skip["step"] == 3 and skip["reason"] == "variable"
    (loc,) = [e for e in ev if e["type"] == "locate"]
    rep = loc["report"]
    assert (rep["primitive"], rep["kind"], rep["direction"]) == ("integer_pow", "inf", "forward")
    line = MonitoredNet.__call__.__code__.co_firstlineno + 1
    assert rep["source"].endswith(f"tiny_models.py:{line}") and rep["site"] is None
    enters = [e for e in ev if e["type"] == "safe_enter"]
    exits = [e for e in ev if e["type"] == "safe_exit"]
    assert [(e["step"], e["scope"]) for e in enters] == [(3, "global")]
    assert [(e["step"], e["site"], e["scope"]) for e in exits] == [(3 + 1 + 3, None, "global")]
    assert not any(e["type"] in ("error", "rollback", "damaged") for e in ev)
    assert tr.checkpoints.steps() == [0, 5, 10] and np.isfinite(float(tr.state.rest["peak"][...]))


def _poisoned_by_a_dead_feature():
    """An optimizer whose own state turns NaN when feature 0 of the batch is all zero (the
    gradient of block 0's ``up`` kernel row 0 is exactly 0); its update stays the gradient.
    Damage that no check of the step reads: only the checkpoint's finiteness check sees it."""

    def update(updates, s, params=None):
        del params
        (row,) = [
            u[0]
            for path, u in jax.tree_util.tree_leaves_with_path(updates)
            if all(k in jax.tree_util.keystr(path) for k in ("blocks", "[0]", "up", "kernel"))
        ]
        return updates, jnp.where(jnp.all(row == 0), jnp.nan, s + 1.0)

    return optax.GradientTransformation(lambda params: jnp.zeros([], jnp.float32), update)


def test_damage_no_step_check_sees_is_rolled_back_at_the_checkpoint_and_never_loops(tmp_path):
    x, y = data(16)
    batches = [(x[i].at[:, 0].set(0.0) if i == 6 else x[i], y[i]) for i in range(16)]
    tx = optax.chain(optax.sgd(1e-2), _poisoned_by_a_dead_feature())
    cfg = CFG.replace(clip_norm=None)
    with Trainer(Net(rngs=nnx.Rngs(0)), tx, loss_fn, cfg, tmp_path / "run") as tr:
        hist = tr.fit(batches, steps=16)
        ev = tr.events
        # Step 6's update is applied; the save at step 10 refuses the damaged state, which
        # is rolled back to step 5 and replayed. Batch 6 damages it again: the second
        # rollback drops the replayed batches instead of looping.
        refused = [e for e in ev if e["type"] == "error" and "not finite" in e["detail"]]
        assert [e["step"] for e in refused] == [10, 10]
        damaged = [e for e in ev if e["type"] == "damaged"]
        assert len(damaged) == 2 and "opt_state" in damaged[0]["report"]["input_path"]
        rb = [e for e in ev if e["type"] == "rollback"]
        assert [(e["to_step"], e["cause"], e["replayed"]) for e in rb] == [
            (5, "damaged", 5),
            (5, "damaged", 0),
        ]
        assert rb[1]["dropped"] == [5, 6, 7, 8, 9]
        assert [h["step"] for h in hist if h.get("replay")] == [5, 6, 7, 8, 9]
        # Every checkpoint holds a finite state, and the run ends on one: batches 10-15
        # trained as steps 5-10 from the restored step-5 state.
        assert tr.checkpoints.steps() == [0, 5, 10] and int(tr.state.step) == tr.step == 11
        assert bool(nan2safe_train.state_is_finite(tr.state))
        assert not any(e["type"] == "locate" for e in ev)


def jax_tree_nan(tree):
    return jax.tree_util.tree_map(lambda p: jnp.full_like(p, jnp.nan), tree)


@pytest.mark.slow  # its incident-at-once and hint are asserted by the fast test below too
def test_a_state_no_loss_scale_cures_is_an_incident_and_the_rollback_finds_the_checkpoint_before(
    tmp_path,
):
    """A finite state every step refuses (a weight ×1e15: loss ~1e30, gradients whose squares
    pass f32's range at every loss scale) just before a checkpoint is due. Its first step is an
    incident at once (it was one of 16 loss-scale overflow skips, each halving the scale), the
    due checkpoint waits for an applied step, and the rollback restores the good checkpoint
    before the damage: the run recovers. Before, the due step saved the damaged state and the
    rollbacks restored it until ``max_incidents`` (newuser46)."""
    batches = _batches(20)
    tr = Trainer(Net(rngs=nnx.Rngs(0)), optax.adam(1e-3), loss_fn, CFG, tmp_path / "run")
    tr.fit(batches[:4], steps=4)
    tr.state = tr.state.replace(
        params=jax.tree_util.tree_map_with_path(
            lambda p, a: a * 1e15 if "head" in str(p) and "kernel" in str(p) else a,
            tr.state.params,
        )
    )
    hist = tr.fit(batches[4:], steps=6)
    ev = tr.events
    assert hist[0]["skipped"] and hist[0]["incident"] and not hist[0]["overflow"]
    hint = [e for e in ev if e["type"] == "locate"][0]["hint"]
    assert "(the largest: head.kernel (" in hint, hint  # the sum of squares names no leaf
    rb = [i for i, e in enumerate(ev) if e["type"] == "rollback"]
    assert [ev[i]["to_step"] for i in rb] == [0] and ev[rb[0]]["missing"] == [], _types(ev)
    saved = [e["step"] for e in ev[: rb[0]] if e["type"] == "checkpoint"]
    assert saved == [0], saved  # none at the due step 5
    assert tr.incidents == 2
    assert not hist[-1]["skipped"] and float(jnp.abs(tr.state.params["head"]["kernel"]).max()) < 10
    tr.close()


def test_a_checkpoint_every_step_refuses_is_passed_over_for_the_one_before(tmp_path):
    """A finite state that every step refuses (a weight ×1e15) saved as checkpoint 4 (here by
    ``save()``; in a run, by a bad update applied at the due step itself). The first rollback
    restores it; once two steps since that restore have failed with none applied, the rollback
    restores checkpoint 0 instead, deletes checkpoint 4 and the run recovers. Before, every
    rollback restored checkpoint 4 until ``max_incidents``. ``NanIncidentError`` leaves the
    trainer on the newest finite checkpoint, never on the state that failed."""
    batches = _batches(20)
    tr = Trainer(Net(rngs=nnx.Rngs(0)), optax.adam(1e-3), loss_fn, CFG, tmp_path / "run")
    tr.fit(batches[:4], steps=4)
    good = jax.tree_util.tree_map(np.asarray, tr.checkpoints.restore(0, tr.state).params)
    tr.state = tr.state.replace(
        params=jax.tree_util.tree_map_with_path(
            lambda p, a: a * 1e15 if "head" in str(p) and "kernel" in str(p) else a,
            tr.state.params,
        )
    )
    assert tr.save()
    hist = tr.fit(batches[4:], steps=6)
    ev = tr.events
    # an incident at once (no scale cures it), not one of 16 loss-scale overflow skips, and its
    # hint names the leaf the sum of squares cannot
    assert hist[0]["skipped"] and hist[0]["incident"] and not hist[0]["overflow"]
    hint = [e for e in ev if e["type"] == "locate"][0]["hint"]
    assert "(the largest: head.kernel (" in hint, hint
    rb = [e for e in ev if e["type"] == "rollback"]
    # 3 incidents: steps 4 and 5 failing again on the replay from checkpoint 4 are the same two
    assert [e["to_step"] for e in rb] == [4, 0] and tr.incidents == 3, _types(ev)
    assert "passed_over" not in rb[0] and rb[1]["passed_over"] == [4], rb
    assert tr.checkpoints.steps()[:2] == [0, 5] and rb[-1]["missing"] == []
    assert not hist[-1]["skipped"] and float(jnp.abs(tr.state.params["head"]["kernel"]).max()) < 10
    tr.close()

    # The same with max_incidents=2: the third incident stops the run, before the rollback
    # that would pass checkpoint 4 over; the trainer is left on checkpoint 0 all the same.
    cfg = CFG.replace(max_incidents=2)
    tr = Trainer(Net(rngs=nnx.Rngs(0)), optax.adam(1e-3), loss_fn, cfg, tmp_path / "stop")
    tr.fit(batches[:4], steps=4)
    tr.state = tr.state.replace(params=jax.tree_util.tree_map(lambda a: a * 1e15, tr.state.params))
    assert tr.save()
    with pytest.raises(NanIncidentError, match="checkpoint 0"):
        tr.fit(batches[4:], steps=6)
    assert tr.step == 0 and tr.events[-1]["type"] == "stop_restore", tr.events[-1]
    assert tr.events[-1]["passed_over"] == [4]
    # the failed step's metrics line: the gear the trainer was left at, not the one it chose
    last = read_metrics(tmp_path / "stop")[-1]
    assert last["incident"], last
    assert last["next_gear"] == int(tr.state.gear.level) == Gear.FAST, last
    jax.tree_util.tree_map(
        np.testing.assert_array_equal, jax.tree_util.tree_map(np.asarray, tr.state.params), good
    )
    tr.close()


def _loud(model, batch):
    """``loss_fn`` times the batch's third leaf: 1e15 makes the scaled gradients square past
    f32, which a smaller loss scale cures (an overflow skip in an f32 model)."""
    return loss_fn(model, batch[:2]) * batch[2]


def test_a_checkpoint_due_at_a_refused_step_waits_and_keeps_the_batches_since_the_last(tmp_path):
    """Overflow skips at steps 4-6 across the due step 5: the checkpoint is written after step
    7, the first applied one, and the ring buffer meanwhile holds every batch since checkpoint 0
    (7 > ``ring_size`` 5: a rollback to 0 replays them all). A polluted batch says nothing of
    the state: the checkpoint due at its step 10 is written on time."""
    x, y = data(11)
    loud = {4, 5, 6}
    batches = [(x[i], y[i], np.float32(1e15 if i in loud else 1.0)) for i in range(11)]
    batches[9] = (x[9].at[0, 0].set(jnp.nan), y[9], np.float32(1.0))
    tr = Trainer(Net(rngs=nnx.Rngs(0)), optax.adam(1e-3), _loud, CFG, tmp_path / "run")
    hist = tr.fit(batches[:7], steps=7)
    assert [h["overflow"] for h in hist] == [False] * 4 + [True] * 3, _types(tr.events)
    assert [s for s, _ in tr.ring] == list(range(7))
    hist += tr.fit(batches[7:], steps=4)
    assert hist[9]["polluted"] and hist[9]["skipped"]
    assert [e["step"] for e in tr.events if e["type"] == "checkpoint"] == [0, 8, 10]
    assert tr.ring.maxlen == CFG.ring_size
    tr.close()


def test_max_incidents_stops_with_the_last_report(tmp_path):
    """The second incident passes ``max_incidents=1``: the error holds its report. (Each
    incident here runs at new gears, so replays programs compiled for it: one limit is as
    good as another, and each incident more cost ~5 s.)"""
    model, tx, loss, cfg = make_fragile()
    cfg = cfg.replace(max_incidents=1)
    bad = {k: "constant_row" for k in range(0, 12)}
    tr = Trainer(model, tx, loss, cfg, tmp_path / "r")
    with pytest.raises(NanIncidentError) as info:
        tr.fit(_batches(12, bad=bad), steps=12)
    assert info.value.report is not None and tr.incidents == 2
    assert len(info.value.history) >= cfg.max_incidents  # the steps before the last incident


def test_bad_workdir_and_bad_loss_are_clear_errors(tmp_path):
    (tmp_path / "file").write_text("x")
    for wd in (tmp_path / "file", tmp_path / "file" / "sub"):
        with pytest.raises(ValueError, match="workdir"):
            Trainer(Net(rngs=nnx.Rngs(0)), optax.sgd(0.1), loss_fn, CFG, wd)
    with pytest.raises(ValueError, match="workdir"):
        Trainer(Net(rngs=nnx.Rngs(0)), optax.sgd(0.1), loss_fn, CFG, None)
    tr = Trainer(
        Net(rngs=nnx.Rngs(0)),
        optax.sgd(0.1),
        lambda m, b: m(b[0]).astype(jnp.float32),
        CFG,
        tmp_path / "ok",
    )
    with pytest.raises(ValueError, match="scalar"):
        tr.fit(_batches(2), steps=2)
    with pytest.raises(ValueError, match="steps"):
        tr.fit(_batches(2), steps=-1)


_CHILD = textwrap.dedent(
    """
    import sys, time
    sys.path.insert(0, {tests!r})
    import optax
    from flax import nnx
    from nan2safe_jax import Config, Gear, Trainer, gear
    from tiny_models import Net, data, loss_fn

    cfg = Config(checkpoint_every=4, recovery_window=10_000)
    tr = Trainer(Net(rngs=nnx.Rngs(0)), optax.adam(1e-3), loss_fn, cfg, {workdir!r})
    if tr.step == 0:
        tr.state = tr.state.replace(gear=gear.set_level(tr.state.gear, Gear.STABLE))
    x, y = data(8)

    def forever():
        i = 0
        while True:
            yield (x[i % 8], y[i % 8])
            i += 1
            time.sleep(0.05)

    print("START", tr.step, flush=True)
    tr.fit(forever(), steps={steps})
    print("DONE", tr.step, int(tr.state.gear.level), flush=True)
    """
)


def test_sigkill_mid_run_resumes_from_the_last_complete_checkpoint(tmp_path):
    workdir = tmp_path / "run"
    tests = str(Path(__file__).parent)
    script = tmp_path / "child.py"
    script.write_text(_CHILD.format(tests=tests, workdir=str(workdir), steps=10_000))
    # LLVM at -O0 in the children: less compile time; nothing here compares numbers
    env = dict(os.environ, PYTHONUNBUFFERED="1", XLA_FLAGS=LLVM_O0)
    proc = subprocess.Popen([sys.executable, str(script)], env=env, stdout=subprocess.PIPE)
    deadline = time.time() + 120
    ckpts = workdir / "checkpoints"
    while time.time() < deadline:
        done = [
            p for p in ckpts.glob("*") if p.name.isdigit() and (p / "_CHECKPOINT_METADATA").exists()
        ]
        if len(done) >= 3:  # step 0's and two more
            break
        time.sleep(0.2)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert len(done) >= 3, "the child never wrote two checkpoints past step 0's"

    # Damage the newest checkpoint on purpose: resume must skip it with a warning.
    steps = sorted(int(p.name) for p in ckpts.glob("*") if p.name.isdigit())
    newest = ckpts / str(steps[-1])
    for root, _, files in os.walk(newest):
        for f in files:
            open(os.path.join(root, f), "w").close()

    script.write_text(_CHILD.format(tests=tests, workdir=str(workdir), steps=3))
    out = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    start = [line for line in out.stdout.splitlines() if line.startswith("START")][0]
    resumed_from = int(start.split()[1])
    assert resumed_from in steps[:-1] and resumed_from > 0
    assert "incomplete or corrupt" in out.stderr
    done_line = [line for line in out.stdout.splitlines() if line.startswith("DONE")][0]
    assert int(done_line.split()[2]) == Gear.STABLE  # the gear state came back with it
    resume = [e for e in read_events(workdir) if e["type"] == "resume"]
    assert resume and resume[-1]["from_step"] == resumed_from
    json.dumps(resume)


@pytest.mark.slow  # ~2 min on 2 cores; fast: test_fault_is_located_put_in_safe_and_recovers
def test_end_to_end_fp16_transformer_attention_overflow(tmp_path):
    """End to end on a nan2safe.nn model in fp16 whose attention has dropout configured, so FAST
    takes flax.nnx's explicit-weights path (logits kept in fp16), as a stock flax.nnx model
    would. At one step the q·k scale of the layer jumps and the fp16 logits overflow: tier 2
    names the attention site, SAFE (f32, range-compressed logits) carries on, staged recovery
    brings it back. (A fully masked row is no fault at FAST any more: FAST fills masked logits
    with the dtype's minimum, as flax does.)"""
    from examples.transformer import Transformer, TransformerConfig, lm_loss, set_knob

    mcfg = TransformerConfig(
        num_layers=1,
        d_model=32,
        num_heads=2,
        seq_len=16,
        vocab=32,
        dtype=jnp.float16,
        attn_dropout=0.1,
    )
    rng = np.random.default_rng(0)
    bad_step, steps = 6, 24
    batches = [
        {"tokens": jnp.asarray(rng.integers(1, 32, (4, 16)).astype(np.int32))} for _ in range(steps)
    ]
    cfg = Config(safe_max_steps=4, min_history=8, recovery_window=8, checkpoint_every=10)
    tr = Trainer(
        Transformer(mcfg, rngs=nnx.Rngs(0)), optax.adam(3e-3), lm_loss, cfg, tmp_path / "r"
    )

    def set_scale(value):
        m = tr.state.model
        set_knob(m, "qk_scale", value)
        _, _, rest = nnx.split(m, nnx.Param, ...)
        tr.state = tr.state.replace(rest=rest)

    def stream():
        for t, b in enumerate(batches):
            set_scale(3e4 if t == bad_step else 1.0)
            yield b

    hist = tr.fit(stream(), steps=steps)
    ev = tr.events
    loc = [e for e in ev if e["type"] == "locate"]
    assert len(loc) == 1 and loc[0]["step"] == bad_step, _types(ev)
    rep = loc[0]["report"]
    assert rep["site"] == "blocks.0.attn" and rep["diagnosis"] == "overflow", rep
    assert hist[bad_step]["skipped"] and not np.isfinite(hist[bad_step]["loss"])
    enter = [e for e in ev if e["type"] == "safe_enter"][0]
    assert enter["site"] == "blocks.0.attn"
    order = _types(ev)
    assert order.index("skip") < order.index("locate") < order.index("safe_enter")
    losses = [h["loss"] for h in hist]
    assert np.isfinite(losses[-1]) and losses[-1] < losses[0]
    assert all(np.isfinite(h["loss"]) for h in hist[bad_step + 1 :])


def _spiky(n: int, spiky) -> list:
    """``n`` batches of ``data(n)`` with the labels × 100 at the steps ``spiky(i)`` holds."""
    x, y = data(n)
    return [(x[i], y[i] * (100.0 if spiky(i) else 1.0)) for i in range(n)]


def test_loss_spike_rolls_back_before_the_spike_and_skips_its_data(tmp_path):
    cfg = Config(
        checkpoint_every=5,
        min_history=4,
        window=8,
        spike_factor=3.0,
        spike_steps=2,
        spike_skip_batches=4,
        spike_lr_factor=0.5,
        spike_lr_steps=3,
        trigger_risk=0.5,  # the spike's first step downshifts too
    )
    batches = _spiky(24, lambda i: 12 <= i < 16)
    with Trainer(Net(rngs=nnx.Rngs(0)), optax.sgd(1e-2), loss_fn, cfg, tmp_path / "r") as tr:
        hist = tr.fit(batches, steps=24)
        ev = tr.events
    spikes = [e for e in ev if e["type"] == "spike"]
    assert len(spikes) == 1 and spikes[0]["start"] == 12 and spikes[0]["step"] == 13
    rb = [e for e in ev if e["type"] == "rollback"]
    assert len(rb) == 1 and rb[0]["cause"] == "loss_spike" and rb[0]["to_step"] == 10
    assert rb[0]["skipped_batches"] == 4 and rb[0]["lr_factor"] == 0.5
    assert [h["step"] for h in hist if h.get("replay")] == [10, 11]
    assert any(e["type"] == "lr_restore" for e in ev)
    # Step 12 downshifted; the rollback at 13 restored checkpoint 10's gears (FAST): the record
    # of step 13 says so, and so does the log (it kept "STABLE" and no event, and the run went
    # on at FAST).
    spiked = next(h for h in hist if h["step"] == 13)
    assert spiked["gear"] == Gear.STABLE and spiked["next_gear"] == Gear.FAST
    gears = [(e["type"], e["step"]) for e in ev if e["type"] in ("downshift", "recover")]
    assert gears[:2] == [("downshift", 12), ("recover", 13)], _types(ev)
    # The spiky batches 12..15 never trained the model after the rollback: 24 batches, 4 gone.
    after = hist[[i for i, h in enumerate(hist) if h.get("replay")][0] :]
    assert max(h["loss"] for h in after) < 3.0 * spikes[0]["baseline"]
    assert tr.step == 20 and tr.spike_rollbacks == 1 and tr.log.closed


def test_a_spike_skip_left_when_fit_runs_out_of_steps_is_done_by_the_next_fit(tmp_path):
    """The spike is seen at step 13, the last of a ``fit(steps=14)``: the rollback replays 10
    and 11 and drops 12 and 13, and the two new batches it still owes (14, 15) are skipped by the
    next ``fit`` on the same iterator (they were forgotten, and the spiky data trained)."""
    cfg = Config(
        checkpoint_every=5, min_history=4, window=8, spike_factor=3.0, spike_steps=2,
        spike_skip_batches=4,
    )  # fmt: skip
    batches = iter(_spiky(24, lambda i: 12 <= i < 16))
    with Trainer(Net(rngs=nnx.Rngs(0)), optax.sgd(1e-2), loss_fn, cfg, tmp_path / "r") as tr:
        first = tr.fit(batches, steps=14)
        assert [h["step"] for h in first if h.get("replay")] == [10, 11] and tr.step == 12
        second = tr.fit(batches, steps=10)
        ev = tr.events
    (spike,) = [e for e in ev if e["type"] == "spike"]
    assert [h["step"] for h in second] == list(range(12, 20)) and tr.step == 20
    assert max(h["loss"] for h in second) < 3.0 * spike["baseline"]

    # The same spike, seen as ``fit`` is left by the data source raising: the rollback is done
    # on the way out, its replay is not run, and the next ``fit``, fed from ``trainer.step``
    # (10), trains 10 and 11 and skips the spike's 12..15 (they trained before, newuser30).
    data_ = _spiky(24, lambda i: 12 <= i < 16)

    def source():
        yield from data_[:14]
        raise OSError("a corrupt shard")

    with Trainer(Net(rngs=nnx.Rngs(0)), optax.sgd(1e-2), loss_fn, cfg, tmp_path / "e") as tr:
        with pytest.raises(OSError, match="corrupt shard"):
            tr.fit(source(), steps=20)
        assert tr.step == 10 and [e["type"] for e in tr.events].count("rollback") == 1
        again = tr.fit(iter(data_[tr.step :]), steps=10)
        ev = tr.events
    assert [h["step"] for h in again] == list(range(10, 16)) and tr.step == 16
    assert max(h["loss"] for h in again) < 3.0 * spike["baseline"]
    assert [e["type"] for e in ev].count("spike") == 1


def test_a_spike_rollback_on_a_checkpoint_step_saves_no_checkpoint_of_the_old_state(tmp_path):
    """Spike confirmed at step 14 (a checkpoint is due after it), rolled back to checkpoint 10
    with nothing to replay or skip: the restored state was saved as checkpoint 15 (a resume
    then started at "15" from step 10's weights) and the dropped batch went to the ring
    (newuser30)."""
    cfg = Config(
        checkpoint_every=5, min_history=8, recovery_window=8, spike_factor=3.0, spike_steps=5,
        spike_skip_batches=2,
    )  # fmt: skip
    batches = _spiky(16, lambda i: i >= 10)
    with Trainer(Net(rngs=nnx.Rngs(0)), optax.adam(1e-2), loss_fn, cfg, tmp_path / "r") as tr:
        tr.fit(batches, steps=16)
        ev = tr.events
        (rb,) = [e for e in ev if e["type"] == "rollback"]
        assert (rb["step"], rb["to_step"], rb["replayed"]) == (14, 10, 0)
        assert tr.checkpoints.steps() == [0, 5, 10] and tr.step == int(tr.state.step) == 11
        assert [s for s, _ in tr.ring] == [9, 10]


def test_a_spike_past_the_rollback_cap_is_logged_once_and_its_level_accepted(tmp_path):
    """No rollback left: the trainer carries on, and the plateau is the new baseline, not a
    spike event every ``spike_steps`` steps for the rest of the run."""
    cfg = Config(
        checkpoint_every=5, min_history=4, window=8, spike_factor=3.0, spike_steps=2,
        spike_max_rollbacks=0,
    )  # fmt: skip
    batches = _spiky(30, lambda i: i >= 12)
    with Trainer(Net(rngs=nnx.Rngs(0)), optax.sgd(1e-3), loss_fn, cfg, tmp_path / "r") as tr:
        tr.fit(batches, steps=30)
        ev = tr.events
    spikes = [e for e in ev if e["type"] == "spike"]
    assert [(e["start"], e["step"]) for e in spikes] == [(12, 13)], spikes
    assert "cap reached" in spikes[0]["action"] and "new baseline" in spikes[0]["action"]
    assert not any(e["type"] == "rollback" for e in ev) and tr.step == 30


def test_loss_spike_config_is_validated():
    assert Config().spike_factor is None  # off by default
    for field, bad in (
        ("spike_factor", 1.0),
        ("spike_steps", 0),
        ("spike_skip_batches", -1),
        ("spike_lr_factor", 0.0),
        ("spike_lr_steps", -1),
        ("spike_max_rollbacks", -1),
    ):
        with pytest.raises(ValueError, match=field):
            Config(**{field: bad})
    with pytest.raises(ValueError, match="ring_buffer"):
        Config(checkpoint_every=20, ring_buffer=10)


class _Classifier(nnx.Module):
    def __init__(self, *, rngs):
        self.lin = nnx.Linear(16, 8, rngs=rngs)
        self.ce = nan2safe_nn.CrossEntropy()

    def __call__(self, x, labels):
        return self.ce(self.lin(x), labels)


def test_out_of_range_labels_and_an_empty_batch_are_a_polluted_input_not_a_model_fault(tmp_path):
    """Labels past the classes (step 2) and a batch with no rows (step 4, a mean over nothing:
    0/0; it was an incident that put the loss's site in SAFE, newuser41) are the data's."""
    rng = np.random.default_rng(0)
    batches = []
    for i in range(6):
        n = 0 if i == 4 else 32
        labels = rng.integers(0, 8, n).astype(np.int32)
        if i == 2:
            labels[[3, 7]] = 9  # outside [0, 8): the cross-entropy's gather fills NaN
        batches.append((jnp.asarray(rng.normal(size=(n, 16)), jnp.float32), labels))
    ce_loss = lambda model, batch: model(*batch)
    with Trainer(_Classifier(rngs=nnx.Rngs(0)), optax.adam(1e-3), ce_loss, CFG, tmp_path) as tr:
        hist = tr.fit(batches, steps=6)
        ev = tr.events
    polluted = [e for e in ev if e["type"] == "polluted_input"]
    assert [e["step"] for e in polluted] == [2, 4]
    assert polluted[0]["leaf"] == "[1]" and polluted[0]["rows"] == [3, 7]
    assert "labels outside [0, 8)" in polluted[0]["report"]["explanation"]
    assert polluted[1]["leaf"] == "[0]" and "no rows" in polluted[1]["report"]["explanation"]
    assert not any(e["type"] in ("locate", "safe_enter", "downshift") for e in ev)
    assert [h["skipped"] for h in hist] == [False, False, True, False, True, False]
    assert all(h["gear"] == Gear.FAST for h in hist)
    assert hist[-1]["loss_scale"] == hist[0]["loss_scale"]


def test_the_leaf_holding_the_gathers_out_of_range_index_is_named():
    """``-100`` labels a mask leaves out (as ``ops.cross_entropy`` advises) sat beside the real
    fault, a token id past the vocabulary, and were named with every row; the leaf holding the
    failing gather's out-of-range extreme is named. A 10-class cross-entropy's unmasked
    ``-100`` names the labels, not a valid token leaf of a larger vocabulary."""
    from nan2safe_jax.incidents import out_of_range_labels

    labels = np.where(np.arange(24).reshape(6, 4) % 4 == 0, -100, 3).astype(np.int32)
    tokens = np.full((6, 4), 7, np.int32)
    tokens[5, 2] = 64
    batch = {"labels": labels, "tokens": tokens}
    assert out_of_range_labels(batch, 64, {"min": 0, "max": 64}) == ("['tokens']", [5])
    assert out_of_range_labels(batch, 64)[0] == "['labels']"  # no index statistics: the first
    tokens[5, 2] = 999  # a valid id of a 1000-word vocabulary; the 10-class gather fails
    assert out_of_range_labels(batch, 10, {"min": -100, "max": 3}) == (
        "['labels']",
        [0, 1, 2, 3, 4, 5],
    )


def test_a_loader_that_refills_one_buffer_is_replayed_with_the_batch_that_failed(tmp_path):
    """The trainer keeps each batch for tier 2 and the ring buffer: a loader writing every
    batch into the same numpy arrays must not change them under the replay."""
    model, tx, loss, cfg = make_fragile()
    batches = _batches(9, bad={6: "constant_row"})
    x_buf, y_buf = (
        np.zeros_like(np.asarray(batches[0][0])),
        np.zeros_like(np.asarray(batches[0][1])),
    )

    def loader():
        for x, y in batches:
            x_buf[...], y_buf[...] = x, y
            yield x_buf, y_buf

    with Trainer(model, tx, loss, cfg, tmp_path / "run") as tr:
        tr.fit(loader(), steps=9)
        ev, ring = tr.events, list(tr.ring)
    assert [e["step"] for e in ev if e["type"] == "locate"] == [6], _types(ev)
    assert not any(e["type"] == "transient" for e in ev)
    for s, (x, _) in ring:  # the ring holds each step's own batch
        np.testing.assert_array_equal(x, np.asarray(batches[s][0]))


class _TokenModel(nnx.Module):
    def __init__(self, *, rngs):
        self.embed = nnx.Embed(64, 32, rngs=rngs)  # vocabulary 64, features 32
        self.head = nnx.Linear(32, 1, rngs=rngs)

    def __call__(self, tokens):
        return self.head(jnp.mean(self.embed(tokens), axis=1))


def test_an_input_token_outside_the_vocabulary_is_named_with_the_vocabularys_bound(tmp_path):
    """The embedding's gather fills NaN for a token past its table: the bound is the table's
    rows (64), not its feature width (32), and only the row holding that token is named."""
    rng = np.random.default_rng(0)
    batches = []
    for i in range(4):
        tokens = rng.integers(32, 64, (8, 5)).astype(np.int32)  # all >= the width 32
        if i == 2:
            tokens[1, 0] = 9999
        batches.append((tokens, rng.normal(size=(8, 1)).astype(np.float32)))
    loss = lambda model, b: jnp.mean((model(b[0]) - b[1]) ** 2)  # noqa: E731
    with Trainer(_TokenModel(rngs=nnx.Rngs(0)), optax.adam(1e-3), loss, CFG, tmp_path) as tr:
        tr.fit(batches, steps=4)
        ev = tr.events
    (polluted,) = [e for e in ev if e["type"] == "polluted_input"]
    assert polluted["step"] == 2 and polluted["leaf"] == "[0]" and polluted["rows"] == [1]
    assert "outside [0, 64)" in polluted["report"]["explanation"]


class _AlwaysFragile(nnx.Module):
    """A site whose row normalisation is 0/0 on a zero row in every gear: SAFE cannot fix it."""

    def __init__(self, *, rngs):
        self.lin = nnx.Linear(16, 16, rngs=rngs)
        self.gear = SiteGear(jnp.zeros((), jnp.int32))
        self.head = nnx.Linear(16, 1, rngs=rngs)

    def __call__(self, x):
        with site_scope("norm"):
            h = x / jnp.sum(jnp.abs(x), axis=-1, keepdims=True)
        return self.head(self.lin(h))


def test_a_fault_that_repeats_in_safe_rolls_back_once_and_never_loops(tmp_path):
    x, y = data(12)
    batches = [(x[i].at[4].set(0.0) if i in (6, 7) else x[i], y[i]) for i in range(12)]
    with Trainer(_AlwaysFragile(rngs=nnx.Rngs(0)), optax.adam(1e-3), loss_fn, CFG, tmp_path) as tr:
        hist = tr.fit(batches, steps=12)
        ev = tr.events
    loc = [e for e in ev if e["type"] == "locate"]
    assert loc[0]["step"] == 6 and loc[0]["report"]["site"] is not None
    rb = [e for e in ev if e["type"] == "rollback"]
    assert len(rb) == 1 and rb[0]["cause"] == "repeat" and rb[0]["step"] == 7
    assert rb[0]["to_step"] == 5
    assert any("fails again after a rollback" in e.get("detail", "") for e in ev)
    assert tr.step == 12 and np.isfinite(hist[-1]["loss"]) and not hist[-1]["skipped"]


def test_an_incident_batch_holding_a_typed_prng_key_is_saved_and_loaded_back(tmp_path):
    """A dropout key carried in the batch as a typed key (``jax.random.key``): NumPy cannot
    hold it, and saving the incident crashed tier 2 at the first fault. It is saved as its raw
    data and comes back a key of the same implementation."""
    import types

    from nan2safe_jax import TrainState
    from nan2safe_jax.trainer import load_incident

    state = TrainState.create(Net(rngs=nnx.Rngs(0)), optax.sgd(0.1), CFG)
    x, y = data(1)
    batch = {"x": x[0], "y": y[0], "key": jax.random.key(7), "raw": jax.random.PRNGKey(7)}
    Trainer._save_incident(types.SimpleNamespace(workdir=tmp_path), 3, state, batch)
    _, back = load_incident(tmp_path, 3, state)
    assert jax.dtypes.issubdtype(back["key"].dtype, jax.dtypes.prng_key)
    assert jax.random.key_impl(back["key"]) == jax.random.key_impl(batch["key"])
    np.testing.assert_array_equal(
        jax.random.key_data(back["key"]), jax.random.key_data(batch["key"])
    )
    np.testing.assert_array_equal(back["raw"], batch["raw"])
    np.testing.assert_array_equal(back["x"], x[0])
    assert len(np.load(tmp_path / "incidents" / "step_3" / "batch.npz").files) == 4


def test_an_exception_out_of_fit_finishes_the_step_in_flight_first(tmp_path):
    """``fit`` runs step t before it records step t-1. A data source that raised at batch 5
    left step 4 trained but never recorded: no metrics line, no checkpoint 5, and a resume
    one checkpoint short (a fault in that step was never handled, its downshift kept)."""

    def source():
        yield from _batches(5)
        raise OSError("corrupt shard")

    with Trainer(Net(rngs=nnx.Rngs(0)), optax.adam(1e-3), loss_fn, CFG, tmp_path / "run") as tr:
        with pytest.raises(OSError, match="corrupt shard"):
            tr.fit(source(), steps=8)
        assert tr.step == 5 and int(tr.state.step) == 5
        assert [m["step"] for m in read_metrics(tmp_path / "run")][-1] == 4
        assert tr.checkpoints.steps() == [0, 5]
        assert len(tr.fit(_batches(2), steps=2)) == 2 and tr.step == 7


def test_a_burst_of_bad_batches_outside_every_site_costs_one_rollback_and_one_incident_each(
    tmp_path, caplog
):
    """newuser51: four bad batches in a row (a multiply in the loss, outside every site,
    overflows on each). The second fails in SAFE and rolls back once to rule out a damaged
    state; on the replay the first two fail again (the same incidents: not counted again) and
    the second is skipped, so the batches are at fault. The third and fourth then fail in
    SAFE too and are skipped without another rollback to the same checkpoint. Four incidents,
    one rollback, and the run goes on; before, each new bad batch rolled back again and
    replayed the known bad ones: 9 incidents and ``NanIncidentError`` at ``max_incidents`` 8.
    The rollback, the skips and the SAFE stay are said through ``logging`` too (they were
    only in ``events.jsonl``)."""
    x, y = data(16)
    # a factor of 1e15 twice: its square passes f32 (one of 3e38 would be the data's fault)
    batches = [(x[i], y[i], 1e15 if 9 <= i <= 12 else 1.0) for i in range(16)]

    def loss(m, b):
        return jnp.mean(jnp.square(m(b[0]).astype(jnp.float32) * b[2] * b[2] - b[1]))

    caplog.set_level("INFO", logger="nan2safe_jax.trainer")
    with Trainer(Net(rngs=nnx.Rngs(0)), optax.adam(1e-3), loss, CFG, tmp_path) as tr:
        hist = tr.fit(batches, steps=16)
        ev = tr.events
    assert tr.incidents == 4 and tr.rollbacks == 1, _types(ev)
    said = [(r.levelname, r.getMessage()) for r in caplog.records]
    rolled = [m for lv, m in said if lv == "WARNING" and "rollback" in m.split("  ")[0]]
    assert len(rolled) == 1 and rolled[0].startswith("step 10: rollback  to_step=5"), said
    assert sum("batch skipped" in m for lv, m in said if lv == "WARNING") == 3, said
    assert any(lv == "INFO" and ": safe_enter  site=None  scope=global" in m for lv, m in said)
    (rb,) = [e for e in ev if e["type"] == "rollback"]
    assert (rb["step"], rb["to_step"]) == (10, 5), rb
    skipped = [e["step"] for e in ev if e["type"] == "error" and "batch skipped" in e["detail"]]
    assert skipped == [10, 11, 12], [e for e in ev if e["type"] == "error"]
    assert tr.step == 16 and np.isfinite(hist[-1]["loss"])


def test_a_clip_that_clips_almost_every_step_is_said_once(tmp_path, caplog):
    """newuser51: the default ``clip_norm`` 1.0 clipped all 150 steps of a healthy CNN, and
    nothing said so. After 50 FAST steps of which 90% or more were clipped, one ``clipping``
    event (and a warning) names the threshold and the share; nothing more after it."""
    caplog.set_level("WARNING", logger="nan2safe_jax.trainer")
    cfg = CFG.replace(clip_norm=1e-4, checkpoint_every=100)
    with Trainer(Net(rngs=nnx.Rngs(0)), optax.adam(1e-3), loss_fn, cfg, tmp_path / "a") as tr:
        tr.fit(_batches(60), steps=60)
        (said,) = [e for e in tr.events if e["type"] == "clipping"]
    assert said["step"] == 49 and said["share"] == 1.0, said
    assert "clip_norm=0.0001 clipped 100% of the first 50" in said["detail"], said
    assert "Config(clip_norm=None)" in said["detail"]
    assert sum("clipping" in r.getMessage() for r in caplog.records) == 1
    # a threshold the gradients stay under says nothing
    loose = cfg.replace(clip_norm=1e3)
    with Trainer(Net(rngs=nnx.Rngs(0)), optax.adam(1e-3), loss_fn, loose, tmp_path / "b") as tr:
        tr.fit(_batches(60), steps=60)
        assert not [e for e in tr.events if e["type"] == "clipping"]


def test_a_stacked_site_with_one_layer_in_safe_is_named_with_its_layer(caplog):
    """newuser52: a scanned stack with one layer in SAFE read ``safe_sites == ['blocks.attn']``
    in the history and ``safe_enter  site=blocks.attn`` in the log, as if the whole stack
    were; the layer is named as the action line names it (``blocks.attn[2]``)."""
    from nan2safe_jax.trainer import _echo_event, _safe_sites

    gears = {
        "blocks.attn": np.asarray([1, 1, 2, 1]),  # one layer of a scanned stack
        "blocks.mlp": np.asarray([2, 2, 2, 2]),  # the whole stack
        "nested": np.asarray([[0, 2], [0, 0]]),  # a stack of stacks
        "head": np.int32(2),
        "embed": np.int32(1),
    }
    assert _safe_sites(gears) == ["blocks.attn[2]", "blocks.mlp", "nested[0][1]", "head"]
    caplog.set_level("INFO", logger="nan2safe_jax.trainer")
    _echo_event({"type": "safe_enter", "step": 60, "site": "blocks.attn", "layer": 2, "steps": 8})
    _echo_event({"type": "safe_enter", "step": 61, "site": "head", "layer": None, "steps": 8})
    said = [r.getMessage() for r in caplog.records]
    assert said == [
        "step 60: safe_enter  site=blocks.attn  layer=2  steps=8",
        "step 61: safe_enter  site=head  steps=8",
    ], said
