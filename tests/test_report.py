"""Event log round-trips, readers that survive a killed writer, summary counts, the dashboard."""

from __future__ import annotations

import json
import math
import shutil
import sys
import time
import types
import warnings
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from nan2safe_jax import report as R

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
LOCATE_REPORT = {
    "primitive": "div",
    "source": "model.py:42",
    "name_stack": "jvp(nan2safe[blocks.1.attn])",
    "site": "blocks.1.attn",
    "direction": "forward",
    "kind": "nan",
    "diagnosis": "0/0",
    "eqn_path": [3, ["iter", 1], 17],
    "channels": {"0": [1], "2": [0, 5]},
    "replays": 7,
    "seconds": 2.5,
    "reproducible": True,
}


def _synthetic(workdir: Path, steps: int = 120) -> dict:
    """A run: downshift at 30, NaN loss at 40-41 located in blocks.1.attn, SAFE 42-49, resume."""
    t0 = 1_700_000_000.0
    with R.EventLog(workdir) as log:
        for s in range(steps):
            gear = 0 if s < 30 else (1 if s < 100 else 0)
            safe = ["blocks.1.attn"] if 42 <= s < 50 else []
            loss = math.nan if s in (40, 41) else 3.0 * math.exp(-s / 50) + 0.1
            log.log_metrics(
                {
                    "step": s,
                    "time": t0 + 0.1 * s,
                    "loss": np.float32(loss),
                    "risk": 1.0 if s == 30 else (0.5 if s in (29, 40) else 0.0),
                    "gear": gear,
                    "next_gear": gear,
                    "loss_scale": 2.0**16 if gear == 0 else 2.0**8,
                    "grad_norm": jnp.float32(1.0),
                    "nonfinite": 1.0 if s in (40, 41) else 0.0,
                    "skipped": s in (40, 41, 70),
                    "finite": s not in (40, 41),
                    "safe_sites": safe,
                    "site_gears": {"blocks.1.attn": [1, 2 if safe else 1], "mlp": gear},
                }
            )
        # a run resumed (as each is, before what it logs) from the checkpoint of an earlier one
        log.append("resume", 0, from_step=0, path="ckpt/0")
        log.append("downshift", 30, **{"from": 0, "to": 1, "risk": 1.0, "probes": ["attn_logits"]})
        log.append("skip", 40, reason="incident")
        log.append("skip", 41, reason="incident")
        log.append("skip", 70, reason="overflow")
        log.append("locate", 41, report=LOCATE_REPORT, action="site blocks.1.attn -> SAFE")
        log.append("safe_enter", 42, site="blocks.1.attn", steps=8)
        log.append("safe_exit", 50, site="blocks.1.attn")
        log.append("recover", 100, to=0)
        for c in range(0, steps, 25):
            log.append("checkpoint", c, path=f"ckpt/{c}")
        log.append("transient", 80, detail="replay finite")
        log.append("polluted_input", 90, report={"diagnosis": "polluted input", "kind": "nan"})
        log.append("error", 95, detail="orbax timeout")
    # the NaN-as-string form, then a record cut off by a kill
    with open(workdir / R.METRICS_FILE, "a") as f:
        rec = {"step": steps, "time": t0 + 0.1 * steps, "loss": "Infinity", "risk": 0.0}
        f.write(json.dumps(rec) + "\n")
        f.write('{"step": 999, "time": 1.0, "lo')
    with open(workdir / R.EVENTS_FILE, "a") as f:
        f.write('{"type": "checkpoint", "st')
    return {"steps": steps + 1, "checkpoints": len(range(0, steps, 25))}


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    wd = tmp_path_factory.mktemp("run")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expect = _synthetic(wd)
    return wd, expect


def test_eventlog_round_trips_values(tmp_path):
    with R.EventLog(tmp_path) as log:
        written = log.append(
            "locate",
            np.int64(5),
            a=np.float32(1.5),
            b=jnp.float32(2.0),
            c=math.nan,
            d=float("inf"),
            e={"x": (1, 2), "y": {"z": np.arange(3)}, 3: jnp.ones((2,), jnp.int32)},
            f=np.bool_(True),
            g=Path("a/b"),
            **{"from": 0},
        )
        log.log_metrics({"step": 5, "loss": -math.inf, "arr": jnp.zeros((2, 2))})
        assert not log.closed
    assert log.closed
    with pytest.raises(ValueError, match="closed"):
        log.append("error", 0)
    (ev,) = R.read_events(tmp_path)
    assert ev == {**written, "c": ev["c"]}
    assert ev["type"] == "locate" and ev["step"] == 5 and ev["from"] == 0
    assert ev["a"] == 1.5 and ev["b"] == 2.0 and math.isnan(ev["c"]) and ev["d"] == math.inf
    assert ev["e"] == {"x": [1, 2], "y": {"z": [0, 1, 2]}, "3": [1, 1]}
    assert ev["f"] is True and ev["g"] == "a/b" and isinstance(ev["time"], float)
    (m,) = R.read_metrics(tmp_path)
    assert m["loss"] == -math.inf and m["arr"] == [[0.0, 0.0], [0.0, 0.0]] and "time" in m
    # bare NaN tokens on disk (Python's json default), one line per record
    text = (tmp_path / R.EVENTS_FILE).read_text()
    assert "NaN" in text and text.count("\n") == 1


def test_reader_accepts_string_nonfinite_and_skips_truncated_line(tmp_path):
    p = tmp_path / R.METRICS_FILE
    p.write_text(
        '{"step": 0, "loss": NaN, "risk": 0}\n'
        '{"step": 1, "loss": "NaN", "risk": "Infinity"}\n'
        '{"step": 2, "loss": "-Infinity"}\n'
        '{"step": 3, "lo'
    )
    with pytest.warns(RuntimeWarning, match="truncated last line"):
        recs = R.read_metrics(tmp_path)
    assert [r["step"] for r in recs] == [0, 1, 2]
    assert math.isnan(recs[0]["loss"]) and math.isnan(recs[1]["loss"])
    assert recs[1]["risk"] == math.inf and recs[2]["loss"] == -math.inf
    assert R.read_events(tmp_path) == []  # missing file


def test_reopen_after_kill_starts_a_fresh_line(tmp_path):
    (tmp_path / R.EVENTS_FILE).write_text('{"type": "skip", "step": 1, "time": 0}\n{"type": "ch')
    # the log reads the earlier events once, when it opens, and warns about the fragment then
    with pytest.warns(RuntimeWarning, match="truncated last line"):
        log = R.EventLog(tmp_path)
    with log:
        log.append("resume", 2, from_step=0, path="ckpt/0")
    with pytest.warns(RuntimeWarning, match="unreadable line 2"):
        events = R.read_events(tmp_path)
    assert [e["type"] for e in events] == ["skip", "resume"]
    assert log.events == events  # served from memory, equal to what the file holds


def test_event_log_keeps_events_in_memory(tmp_path):
    with R.EventLog(tmp_path) as log:
        log.append("skip", 1, reason="overflow", risk=float("inf"))
        (tmp_path / R.EVENTS_FILE).unlink()  # the file is not re-read
        assert [e["type"] for e in log.events] == ["skip"]
        log.events[0]["type"] = "edited"  # a copy: the log's record is unchanged
        assert log.events[0]["type"] == "skip" and log.events[0]["risk"] == float("inf")


def test_summary_counts(run_dir):
    wd, expect = run_dir
    with pytest.warns(RuntimeWarning):
        s = R.summary(wd)
    assert s["steps"] == s["records"] == expect["steps"]
    assert (s["first_step"], s["last_step"]) == (0, expect["steps"] - 1)
    assert s["final_loss"] == math.inf and s["nonfinite_losses"] == 3
    assert s["min_loss"] == pytest.approx(3.0 * math.exp(-119 / 50) + 0.1, rel=1e-6)
    assert s["skipped"] == 3 and s["skip_reasons"] == {"incident": 2, "overflow": 1}
    assert s["downshifts"] == 1 and s["incidents_located"] == 1
    (inc,) = s["incidents"]
    assert inc["site"] == "blocks.1.attn" and inc["primitive"] == "div"
    assert inc["diagnosis"] == "0/0" and inc["step"] == 41 and inc["replays"] == 7
    assert inc["label"] == "blocks.1.attn: div (0/0)"
    assert s["safe_entries"] == 1 and s["safe_sites"] == ["blocks.1.attn"] and s["safe_exits"] == 1
    assert s["recoveries"] == 1 and s["checkpoints"] == expect["checkpoints"]
    assert s["resumes"] == s["transients"] == s["polluted_inputs"] == s["errors"] == 1
    assert s["seconds_per_step"] == pytest.approx(0.1, rel=1e-3)
    assert s["final_gear"] == 0


def test_summary_dedupes_rerun_steps_and_counts_what_the_first_run_skipped(tmp_path):
    """Steps 1-2 re-run after a rollback: the curve keeps the last record of each step, and
    the counts keep step 2's first run, which was skipped with a NaN loss."""
    runs = [(0, 3.0), (1, 2.0), (2, math.nan), (1, 2.5), (2, 1.5), (3, 1.0)]
    with R.EventLog(tmp_path) as log:
        for s, loss in runs:
            log.log_metrics({"step": s, "loss": loss, "time": 10.0 + s, "skipped": loss != loss})
        log.append("safe_enter", 2, site=None, steps=8, scope="global")
        log.append("rollback", 2, to_step=1, cause="repeat")
        log.append("spike", 3, action="roll back to step 1")
        log.append("rollback", 3, to_step=1, cause="loss_spike", skipped_batches=8)
    s = R.summary(tmp_path)
    assert (s["steps"], s["records"], s["nonfinite_losses"], s["skipped"]) == (4, 6, 1, 1)
    assert s["final_loss"] == 1.0 and s["safe_sites"] == ["global"]
    assert (s["rollbacks"], s["resumes"], s["spikes"]) == (2, 0, 1)
    assert s["rollback_causes"] == {"repeat": 1, "loss_spike": 1}
    from rich.console import Console

    console = Console(record=True, width=140)
    R.print_summary(tmp_path, console=console)
    text = console.export_text()
    assert "2 re-run after a rollback)" in text
    # the rollbacks, their causes and the batches a spike's rollback dropped (a soak run's
    # report showed none of them)
    assert "loss spikes" in text
    assert "2 (loss_spike 1, repeat 1); loss-spike rollbacks skipped 8 batches" in text
    # A run killed and resumed re-runs the steps after its last checkpoint: not a rollback.
    with R.EventLog(tmp_path / "resumed") as log:
        for s_, loss in [(0, 3.0), (1, 2.0), (1, 2.0), (2, 1.0)]:
            log.log_metrics({"step": s_, "loss": loss, "time": 10.0 + s_})
        log.append("resume", 1, from_step=1)
    console = Console(record=True, width=140)
    R.print_summary(tmp_path / "resumed", console=console)
    assert "1 re-run after a resume)" in console.export_text()


def _span(workdir) -> float:
    times = [r["time"] for r in R.read_metrics(workdir)]
    return max(times) - min(times)


def test_the_work_a_resume_ran_again_is_counted_once(tmp_path):
    """A run killed while checkpoint 9 was written resumes from checkpoint 6 and meets step 7's
    fault again: the report said 2 incidents, 2 downshifts, 2 SAFE entries (one fault), and
    counted the save that never finished."""
    with R.EventLog(tmp_path) as log:
        for s_ in range(9):
            bad = s_ == 7
            log.log_metrics({"step": s_, "loss": math.nan if bad else 1.0, "skipped": bad})
        time.sleep(0.01)  # the records and events are told apart by their times
        log.append("checkpoint", 6)

        def fault():
            log.append("downshift", 7, cause="nonfinite")
            log.append("locate", 7, report={"site": "act", "primitive": "log"}, action="SAFE")
            log.append("safe_enter", 7, site="act", steps=8)
            log.append("checkpoint", 9)

        fault()  # the killed process: its checkpoint 9 never finished
        log.append("resume", 6, from_step=6)
        log.append("error", 9, detail="1 checkpoint save(s) never finished (steps [9])")
        time.sleep(0.01)
        for s_ in range(6, 10):
            bad = s_ == 7
            log.log_metrics({"step": s_, "loss": math.nan if bad else 1.0, "skipped": bad})
        log.log_metrics({"step": 7, "loss": 1.0, "skipped": False})  # a rollback's re-run
        fault()
    s = R.summary(tmp_path)
    assert (s["incidents_located"], s["downshifts"], s["safe_entries"]) == (1, 1, 1)
    assert [i["step"] for i in s["incidents"]] == [7]
    assert (s["checkpoints"], s["resumes"], s["errors"]) == (2, 1, 1)
    # step 7 ran twice, not three times: the killed run's record is re-run work (newuser37);
    # the rollback's replay of it is a run of its own, and finite
    assert (s["skipped"], s["nonfinite_losses"]) == (1, 1)
    assert s["lost_to_resume"] == {"checkpoint": 1, "downshift": 1, "locate": 1, "safe_enter": 1}
    # the time between the kill and the resume is no run's
    assert s["wall_seconds"] < _span(tmp_path) - 0.009
    from rich.console import Console

    console = Console(record=True, width=140)
    R.print_summary(tmp_path, console=console)
    text = console.export_text()
    assert "events of work a resume re-ran" in text
    assert "checkpoint 1, downshift 1, locate 1, safe_enter 1" in text
    assert text.count("act") == 2  # the SAFE entries' site, and one incident row

    # A finished run reopened to be read (a resume at its newest checkpoint, nothing trained
    # after it) re-ran nothing: its incident after that checkpoint stands (review20).
    with R.EventLog(tmp_path / "reopened") as log:
        log.append("checkpoint", 10)
        log.append("locate", 11, report={"site": "act", "primitive": "log"}, action="SAFE")
        log.append("resume", 10, from_step=10)
    s = R.summary(tmp_path / "reopened")
    assert s["incidents_located"] == 1 and s["lost_to_resume"] == {}


def test_print_summary_renders_table(run_dir):
    from rich.console import Console

    wd, _ = run_dir
    console = Console(record=True, width=140)
    with pytest.warns(RuntimeWarning):
        s = R.print_summary(wd, console=console)
    out = console.export_text()
    for text in ("steps run", "downshifts", "incidents located", "blocks.1.attn", "div", "0/0"):
        assert text in out
    assert "100.0 ms" in out and s["steps"] == 121
    assert "model.py:42" in out  # no user_source in this report: its own source


def test_incident_table_shows_the_model_line_of_a_built_in_site(tmp_path):
    """A built-in site's culprit is a library line (``source``); the table shows the model
    line that called the site (``user_source``), and the summary keeps both."""
    from rich.console import Console

    rep = dict(LOCATE_REPORT, source="/x/nan2safe_jax/ops/linear.py:49", user_source="/m/net.py:7")
    with R.EventLog(tmp_path) as log:
        log.log_metrics({"step": 0, "loss": 1.0, "time": 1.0})
        log.append("locate", 0, report=rep, action="site blocks.1.attn -> SAFE for 8 steps")
    console = Console(record=True, width=140)
    s = R.print_summary(tmp_path, console=console)
    (inc,) = s["incidents"]
    assert (inc["source"], inc["user_source"]) == (rep["source"], rep["user_source"])
    out = console.export_text()
    assert "net.py:7" in out and "linear.py:49" not in out


def test_figure_panels(run_dir):
    wd, _ = run_dir
    with pytest.warns(RuntimeWarning):
        fig = R._figure(wd)
    axes = fig.axes
    assert len(axes) == 3
    shared = axes[0].get_shared_x_axes()
    assert shared.joined(axes[0], axes[1]) and shared.joined(axes[0], axes[2])
    assert axes[0].get_yscale() == "log"
    labels = [t.get_text() for t in axes[2].get_yticklabels()]
    assert labels[:3] == ["FAST", "STABLE", "SAFE"] and "blocks.1.attn" in labels
    texts = [t.get_text() for t in axes[0].texts]
    assert "blocks.1.attn: div (0/0)" in texts
    title = fig._suptitle.get_text()
    assert "nan2safe" in title and "1 incident located" in title and "1 downshift" in title
    # the non-finite losses sit at the top of the loss panel
    nonfinite = [ln for ln in axes[0].lines if ln.get_label() == "non-finite loss"]
    assert len(nonfinite) == 1 and sorted(nonfinite[0].get_xdata()) == [40, 41, 120]


def test_dashboard_writes_png(run_dir, tmp_path):
    wd, _ = run_dir
    with pytest.warns(RuntimeWarning):
        out = R.dashboard(wd)
    assert out == wd / R.DASHBOARD_FILE
    data = out.read_bytes()
    assert data[:8] == PNG_MAGIC and 20_000 < len(data) < 2_000_000
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    assert width >= 1000 and height >= 700
    with pytest.warns(RuntimeWarning):
        other = R.dashboard(wd, tmp_path / "sub" / "d.png")
    assert other.read_bytes()[:8] == PNG_MAGIC


@pytest.mark.parametrize("case", ["no_events", "empty", "single_step", "events_only"])
def test_dashboard_degenerate_runs(tmp_path, case):
    if case in ("no_events", "single_step"):
        with open(tmp_path / R.METRICS_FILE, "w") as f:
            for s in range(1 if case == "single_step" else 5):
                f.write(json.dumps({"step": s, "loss": 1.0, "risk": 0.0, "gear": 0}) + "\n")
    elif case == "events_only":
        with R.EventLog(tmp_path) as log:
            log.append("error", 3, detail="died before the first step")
    out = R.dashboard(tmp_path)
    assert out.read_bytes()[:8] == PNG_MAGIC
    expect = {"empty": 0, "events_only": 0, "no_events": 5, "single_step": 1}[case]
    assert R.summary(tmp_path)["steps"] == expect


def test_dashboard_missing_workdir(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        R.dashboard(tmp_path / "nope")


def test_dashboard_many_steps_downsamples(tmp_path):
    n = 40_000
    rng = np.random.default_rng(0)
    loss = 2.0 + rng.standard_normal(n) * 0.01
    loss[12_345] = 50.0  # a spike that decimation must keep
    gear = np.zeros(n, np.int64)
    gear[20_001:20_003] = 1  # a two-step excursion that decimation must keep
    with open(tmp_path / R.METRICS_FILE, "w") as f:
        for s in range(n):
            f.write(
                json.dumps(
                    {"step": s, "loss": loss[s], "risk": 0.0, "gear": int(gear[s]), "time": s}
                )
                + "\n"
            )
    fig = R._figure(tmp_path)
    loss_line, risk_line = fig.axes[0].lines[0], fig.axes[1].lines[0]
    assert len(loss_line.get_xdata()) <= R.MAX_POINTS + 2
    assert len(risk_line.get_xdata()) <= R.MAX_POINTS + 2
    assert 50.0 in loss_line.get_ydata()
    gear_line = fig.axes[2].lines[0]
    assert len(gear_line.get_xdata()) <= R.MAX_POINTS + 10 and 1.0 in gear_line.get_ydata()
    assert R.dashboard(tmp_path).stat().st_size > 10_000


def test_site_rows_from_site_gears_and_events(tmp_path):
    with R.EventLog(tmp_path) as log:
        for s in range(10):
            gears = {"a": [[1, 2 if 3 <= s < 5 else 1]], "b": 0}
            log.log_metrics({"step": s, "loss": 1.0, "site_gears": gears})
        log.append("safe_enter", 6, site="c", steps=3)  # no metrics mention c
        log.append("safe_enter", 8, site="d", steps=None)  # open until the end
    rows = R._site_rows(R._load(tmp_path))
    assert rows == {"a": [(3.0, 2.0)], "c": [(6.0, 3.0)], "d": [(8.0, 2.0)]}
    labels = [t.get_text() for t in R._figure(tmp_path).axes[2].get_yticklabels()]
    assert labels == ["FAST", "STABLE", "SAFE", "a", "c", "d"]


def test_one_layer_of_a_stack_in_safe_is_one_row(tmp_path):
    """The trainer's ``safe_sites`` name one layer of a stack ``blocks.attn[2]``, and its
    ``safe_enter`` event says ``site="blocks.attn", layer=2``: one row, not two (review
    helper-86); an exit names the site, and closes its layers' rows."""
    with R.EventLog(tmp_path) as log:
        for s in range(10):
            safe = ["blocks.attn[2]"] if 3 <= s < 6 else []
            log.log_metrics({"step": s, "loss": 1.0, "safe_sites": safe})
        log.append("safe_enter", 3, site="blocks.attn", layer=2, steps=8)
        log.append("safe_exit", 6, site="blocks.attn")
        log.append("safe_enter", 7, site="mlp", layer=[1, 0], steps=2)  # a stack of stacks
    rows = R._site_rows(R._load(tmp_path))
    assert rows == {"blocks.attn[2]": [(3.0, 3.0)], "mlp[1][0]": [(7.0, 2.0)]}, rows


def test_decimate_keeps_extremes():
    y = np.arange(100_000, dtype=np.float64)
    y[777] = 1e9
    y[5000:5100] = np.nan
    idx = R._decimate(y, 1000)
    assert len(idx) <= 1002 and 777 in idx and idx[0] == 0 and idx[-1] == len(y) - 1
    assert np.all(np.diff(idx) > 0)


def test_write_tensorboard(tmp_path, monkeypatch, run_dir):
    wd, _ = run_dir
    monkeypatch.setitem(sys.modules, "tensorboardX", None)  # not importable
    assert R.write_tensorboard(wd) is False

    calls = []

    class Writer:
        def __init__(self, logdir, filename_suffix=""):
            calls.append(("init", logdir))
            Path(logdir).mkdir(parents=True, exist_ok=True)
            n = len([c for c in calls if c[0] == "init"])
            (Path(logdir) / f"events.out.tfevents.{n}{filename_suffix}").write_text("x")

        def add_scalar(self, tag, value, step):
            calls.append(("scalar", tag, value, step))

        def add_text(self, tag, text, step):
            calls.append(("text", tag, step))

        def close(self):
            calls.append(("close",))

    monkeypatch.setitem(sys.modules, "tensorboardX", types.SimpleNamespace(SummaryWriter=Writer))
    with pytest.warns(RuntimeWarning):
        assert R.write_tensorboard(wd, tmp_path / "tb") is True
    assert calls[0] == ("init", str(tmp_path / "tb")) and calls[-1] == ("close",)
    losses = [c for c in calls if c[:2] == ("scalar", "loss")]
    assert len(losses) == 118 and all(math.isfinite(c[2]) for c in losses)
    assert ("text", "events/locate", 41) in calls
    # Written again (``nan2safe report`` run twice): the earlier file is replaced, not doubled;
    # a file of another writer in that folder stays.
    (tmp_path / "tb" / "events.out.tfevents.mine").write_text("y")
    with pytest.warns(RuntimeWarning):
        R.write_tensorboard(wd, tmp_path / "tb")
    left = sorted(p.name for p in (tmp_path / "tb").iterdir())
    assert left == ["events.out.tfevents.2.nan2safe", "events.out.tfevents.mine"]


def test_report_cli_names_what_is_wrong_and_writes_where_told(tmp_path, run_dir, capsys):
    from nan2safe_jax import cli

    wd, _ = run_dir
    assert cli.main(["report", str(tmp_path / "nope")]) == 2
    assert "does not exist" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert cli.main(["report", str(tmp_path / "empty")]) == 2
    assert "holds no run record" in capsys.readouterr().err
    assert not (tmp_path / "empty" / R.DASHBOARD_FILE).exists()
    assert cli.main(["locate", str(tmp_path / "nope"), "--step", "1"]) == 2
    assert "does not exist" in capsys.readouterr().err
    # The events file itself names its run; --out writes elsewhere (a read-only run).
    out = tmp_path / "elsewhere" / "dash.png"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert cli.main(["report", str(wd / R.EVENTS_FILE), "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == PNG_MAGIC
    printed = capsys.readouterr().out
    assert "steps run" in printed and f"dashboard: {out}" in printed
    assert "dash_tensorboard" in printed or "needs tensorboardX" in printed
    # A torn line (a killed process) is said once, as the command's message: the summary and
    # the dashboard each read the log, and it was printed twice from summary.py (newuser42).
    torn = tmp_path / "torn"
    shutil.copytree(wd, torn)
    with open(torn / R.EVENTS_FILE, "a") as f:
        f.write('{"type": "skip", "step": 3, "ti\n')
    assert cli.main(["report", str(torn), "--out", str(tmp_path / "torn.png")]) == 0
    lines = capsys.readouterr().err.splitlines()
    assert sum("events.jsonl: skipping" in x for x in lines) == 1, lines
    assert all(x.startswith("warning: ") for x in lines), lines


def test_demo_refuses_a_workdir_that_holds_something_else(tmp_path, capsys):
    """The demo replaces its folder: one of the user's that holds no earlier demo run is
    refused, untouched (it was deleted); an empty folder is fine to take."""
    from nan2safe_jax import cli

    mine = tmp_path / "my_run"
    mine.mkdir()
    (mine / "precious.txt").write_text("keep me")
    with pytest.raises(SystemExit) as exit_:
        cli.main(["demo", "--steps", "1", "--workdir", str(mine)])
    assert exit_.value.code == 2
    assert "holds no earlier demo run" in capsys.readouterr().err
    assert (mine / "precious.txt").read_text() == "keep me"
    from examples import demo

    (tmp_path / "empty").mkdir()
    assert demo._earlier_demo(tmp_path / "empty")
    (tmp_path / "old_demo").mkdir()
    (tmp_path / "old_demo" / "run.json").write_text('{"factory": "examples.demo:factory"}')
    assert demo._earlier_demo(tmp_path / "old_demo") and not demo._earlier_demo(mine)


def test_cli_bench_without_a_name_and_locate_with_another_models_factory_say_so(tmp_path, capsys):
    """``nan2safe bench`` alone lists the benchmarks (argparse called the optional arguments
    required); ``locate --factory`` of another model ends in one line, rc 2, not a traceback."""
    import optax
    from flax import nnx
    from tiny_models import Net

    from nan2safe_jax import Config, Trainer, TrainState, cli

    assert cli.main(["bench"]) == 2
    err = capsys.readouterr().err
    assert "name one of" in err and "overhead" in err and "'measure'" not in err
    # A module the benchmarks share is no benchmark: it ran, printed nothing and returned 0.
    assert cli.main(["bench", "measure", "--help"]) == 2
    assert "no benchmark 'measure'" in capsys.readouterr().err
    state = TrainState.create(Net(rngs=nnx.Rngs(0)), optax.adam(1e-3), Config())
    batch = (np.zeros((2, 16), np.float32), np.zeros((2, 1), np.float32))
    Trainer._save_incident(types.SimpleNamespace(workdir=tmp_path), 3, state, batch)
    argv = ["locate", str(tmp_path), "--step", "3", "--factory", "tiny_models:make_fragile"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "builds another state than the run saved at step 3" in err and "Traceback" not in err


def test_the_final_loss_and_gear_are_the_newest_records_after_a_resume(tmp_path):
    """A run killed at step 6 in SAFE resumed from checkpoint 4 and ended at step 5 at FAST:
    the report read the killed run's step 6 (loss 2.278, SAFE) as final (newuser40)."""
    with R.EventLog(tmp_path) as log:
        for s_ in range(7):
            log.log_metrics({"step": s_, "loss": 3.0 - 0.1 * s_, "gear": 2 if s_ > 4 else 0})
        time.sleep(0.01)
        log.append("resume", 4, from_step=4)
        for s_ in (4, 5):
            log.log_metrics({"step": s_, "loss": 2.25, "gear": 0})
    s = R.summary(tmp_path)
    assert (s["final_loss"], s["final_gear"]) == (2.25, 0)
