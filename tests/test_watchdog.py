"""The hang watchdog: fires once when armed and not beaten for its timeout; the Trainer logs
why before its process ends (a peer that hangs without dying is never declared dead)."""

from __future__ import annotations

import threading
import time

import optax
import pytest
from flax import nnx
from tiny_models import Net, data, loss_fn

from nan2safe_jax import Config, Trainer
from nan2safe_jax import watchdog as watchdog_lib
from nan2safe_jax.runlog import read_events


def _fired_within(dog, seconds):
    end = time.monotonic() + seconds
    while time.monotonic() < end and not dog.fired:
        time.sleep(0.02)
    return dog.fired


def test_fires_once_when_armed_and_not_beaten():
    calls = []
    dog = watchdog_lib.Watchdog(0.3, calls.append, poll_s=0.02)
    try:
        time.sleep(0.5)  # not armed: nothing counts
        assert not dog.fired
        dog.arm()
        for _ in range(8):  # beaten more often than the timeout: alive
            time.sleep(0.1)
            dog.beat()
        assert not dog.fired
        dog.disarm()
        time.sleep(0.5)
        assert not dog.fired
        dog.arm()
        assert _fired_within(dog, 10)
        time.sleep(0.2)
        assert len(calls) == 1 and calls[0] > 0.3
    finally:
        dog.stop()


@pytest.mark.parametrize("bad", [0, -1.0, float("inf"), "soon", True])
def test_a_bad_timeout_names_the_argument(tmp_path, bad):
    with pytest.raises(ValueError, match="hang_timeout_s"):
        Trainer(Net(rngs=nnx.Rngs(0)), optax.adam(1e-3), loss_fn, Config(), tmp_path / "r",
                hang_timeout_s=bad)  # fmt: skip


def test_a_trainer_stuck_in_fit_logs_why_before_it_ends(tmp_path, monkeypatch):
    """A data loader that hangs after two steps: the watchdog logs an ``error`` event and calls
    ``exit_on_hang`` (here recorded instead of ending pytest); in one process the default
    ("auto") arms nothing."""
    ended = threading.Event()
    monkeypatch.setattr(watchdog_lib, "exit_on_hang", lambda waited: ended.set())
    cfg = Config(checkpoint_every=5)
    tr = Trainer(Net(rngs=nnx.Rngs(0)), optax.adam(1e-3), loss_fn, cfg, tmp_path / "run")
    assert tr.hang_timeout_s is None  # one process, "auto": no watchdog
    x, y = data(4)
    tr.fit([(x[0], y[0])], steps=1)  # the step compiles before the watchdog counts
    tr.hang_timeout_s = 1.0

    def stuck_loader():
        yield x[1], y[1]
        yield x[2], y[2]
        assert ended.wait(60), "the watchdog never fired"
        raise RuntimeError("the loader was stuck")

    with pytest.raises(RuntimeError, match="the loader was stuck"):
        tr.fit(stuck_loader(), steps=3)
    assert tr.step == 3
    (why,) = [e for e in read_events(tmp_path / "run") if "no training step" in str(e)]
    assert why["type"] == "error" and "hang_timeout_s" in why["detail"]
    assert tr._watchdog is None  # its thread ends with ``fit``: it holds no dropped trainer
    tr.close()


def test_a_log_that_blocks_does_not_keep_a_hung_process_alive(tmp_path, monkeypatch):
    """The main thread may hold the event log's lock (a write to a dead filesystem): the
    watchdog's event is given ``_HANG_LOG_S`` and the process ends all the same (review: it
    waited for the lock forever)."""
    from nan2safe_jax import trainer as trainer_lib

    ended = []
    monkeypatch.setattr(watchdog_lib, "exit_on_hang", ended.append)
    monkeypatch.setattr(trainer_lib, "_HANG_LOG_S", 0.2)
    tr = Trainer(Net(rngs=nnx.Rngs(0)), optax.adam(1e-3), loss_fn, Config(), tmp_path / "run")
    never = threading.Event()
    monkeypatch.setattr(tr.log, "append", lambda *a, **k: never.wait(30))
    t0 = time.monotonic()
    tr._on_hang(7.0)
    assert ended == [7.0] and time.monotonic() - t0 < 10
    never.set()
    monkeypatch.undo()
    tr.close()
