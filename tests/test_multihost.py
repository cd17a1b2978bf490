"""Real ``jax.distributed`` runs: 2 processes x 2 CPU devices over loopback (gloo collectives).

The 2-process scenarios (``tests/multihost_worker.py``) are slow and run with ``make
multihost``; every launch has a hard timeout and its processes are killed when it expires, so
nothing can hang the machine. The logic they rely on (the timeout options, the lost-process
error, the agreement check, the log layout) has fast single-process tests below.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from nan2safe_jax import sharding

WORKER = Path(__file__).resolve().parent / "multihost_worker.py"
TIMEOUT_S = 420  # per launch: a 2-process run takes ~1 min here, ~3 on a loaded 2-core machine
CONSTANT_ROW = 20  # global row of process 1's constant row (tier 2 locates it)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(mode: str, out: Path, processes: int = 2) -> list[tuple[int, str]]:
    """Runs the worker in ``processes`` processes; ``(returncode, output)`` of each.

    Every process is killed once ``TIMEOUT_S`` has passed; a launch that needed that fails the
    test as a hang.
    """
    port = str(_free_port())
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    args = [[str(WORKER), mode, str(out), port, str(i)] for i in range(processes)]
    if processes == 1:
        args = [[str(WORKER), mode, str(out)]]
    procs = [
        subprocess.Popen(
            [sys.executable, *a],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
            start_new_session=True,
        )
        for a in args
    ]
    logs, hung = [], []
    try:
        for p in procs:
            try:
                logs.append(p.communicate(timeout=TIMEOUT_S)[0])
            except subprocess.TimeoutExpired:
                hung.append(p.pid)
                os.killpg(p.pid, signal.SIGKILL)
                logs.append(p.communicate()[0])
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    assert not hung, f"{mode}: processes {hung} still running after {TIMEOUT_S} s (a hang)"
    return [(p.returncode, text) for p, text in zip(procs, logs, strict=True)]


def _ok(mode: str, out: Path, processes: int = 2) -> list[dict]:
    for rc, text in _launch(mode, out, processes):
        assert rc == 0, text[-4000:]
    return [json.loads((out / f"{mode}_{i}.json").read_text()) for i in range(processes)]


@pytest.fixture(scope="module")
def dp(tmp_path_factory):
    out = tmp_path_factory.mktemp("multihost_dp")
    return out, _ok("dp", out)


@pytest.fixture(scope="module")
def fsdp_chain(tmp_path_factory):
    """2 processes (FSDP across both) -> 1 process resumes -> 2 processes resume again."""
    out = tmp_path_factory.mktemp("multihost_fsdp")
    two = _ok("fsdp", out)
    one = _ok("single", out, processes=1)[0]
    back = _ok("resume", out)
    return out, two, one, back


def _same_incident_in_both(r0: dict, r1: dict) -> None:
    assert r0["devices"] == r1["devices"] == 4
    assert r0["local_devices"] == r1["local_devices"] == 2
    # Step 3: process 1's NaN row (a polluted batch); step 6: its constant row (0/0 in a site).
    assert r0["polluted"] == r1["polluted"] == [3]
    assert r0["skipped"] == r1["skipped"] == [3, 6]
    assert r0["gears"] == r1["gears"]
    assert r0["gears"][6] == 0 and r0["gears"][7] == 1  # both downshift after step 6
    assert r0["site_gears"] == r1["site_gears"]
    assert r0["losses"] == r1["losses"]
    assert r0["events"] == r1["events"]
    assert r0["locate"] == r1["locate"] and len(r0["locate"]) == 1
    loc = r0["locate"][0]
    assert loc["step"] == 6 and loc["site"] == "blocks.0"
    assert loc["shards"]["processes"] == [1]  # process 1 held the bad row
    assert loc["shards"]["by_shard"][0]["rows"] == [CONSTANT_ROW]
    assert r0["checkpoints"] == r1["checkpoints"] == [0, 5, 10]


def _one_log(run: Path, r0: dict) -> None:
    lines = (run / "events.jsonl").read_text().splitlines()
    types = [json.loads(s)["type"] for s in lines]  # later resumes of the run append to it
    assert types[: len(r0["events"])] == r0["events"] and types.count("locate") == 1
    assert (run / "process_1" / "events.jsonl").exists()  # process 1's copy, kept aside


@pytest.mark.slow
def test_data_parallel_nan_row_in_process_1_is_handled_alike_by_both(dp):
    out, (r0, r1) = dp
    _same_incident_in_both(r0, r1)
    assert r0["kernel_spec"] == "P()"  # data parallel: parameters replicated
    _one_log(out / "run_dp", r0)


@pytest.mark.slow
def test_fsdp_across_processes_nan_row_in_process_1_is_handled_alike_by_both(fsdp_chain):
    out, (r0, r1), _, _ = fsdp_chain
    _same_incident_in_both(r0, r1)
    # Every parameter split over all 4 devices: each process holds a quarter per device.
    assert r0["kernel_spec"] == "P('fsdp', None)" and r0["kernel_processes"] == [0, 1]
    assert r0["kernel_local_shape"] == [4, 16]
    assert r0["locate"][0]["shards"]["num_shards"] == 4
    _one_log(out / "run", r0)
    assert (out / "run" / "incidents" / "step_6" / "batch.npz").exists()


@pytest.mark.slow
def test_checkpoint_of_two_processes_restores_in_one_and_back(fsdp_chain):
    _, _, one, back = fsdp_chain
    # 2 processes (FSDP over 4 devices) wrote step 10; 1 process on a (2,) data mesh restores it
    assert one["processes"] == 1 and one["devices"] == 2
    assert one["resumed_from"][-1] == 10 and one["restored_equal"]
    assert one["kernel_spec"] == "P()"
    assert one["finite"] == [True] * 5 and one["checkpoints"] == [5, 10, 15]
    # ... and 1 process wrote step 15, which 2 processes restore onto the FSDP mesh again.
    for r in back:
        assert r["processes"] == 2 and r["resumed_from"][-1] == 15 and r["restored_equal"]
        assert r["kernel_processes"] == [0, 1] and r["kernel_local_shape"] == [4, 16]
        assert r["finite"] == [True, True]
    assert back[0]["losses"] == back[1]["losses"]


@pytest.mark.slow
@pytest.mark.parametrize("victim", [1, 0])
def test_a_killed_process_stops_the_other_with_a_clear_error(tmp_path, victim):
    (rc0, log0), (rc1, log1) = _launch(f"kill{victim}", tmp_path)
    rcs, logs = {0: rc0, 1: rc1}, {0: log0, 1: log1}
    survivor = 1 - victim
    assert rcs[victim] == -signal.SIGKILL, logs[victim][-4000:]
    assert rcs[survivor] != 0  # it stopped (within TIMEOUT_S: _launch fails a hang)
    text = logs[survivor]
    # Whichever notices the death first stops the survivor, each with the cause in its message:
    # the step's collective (nan2safe's RuntimeError), the coordination service's heartbeats
    # (a dead process 1), or, when process 0 (the service's host) dies, the survivor's own poll
    # of the service, which JAX ends with a fatal error of its own (SIGABRT). The last is a race
    # with the collective: 1 run in 12 here.
    clear = "a collective with another process failed" in text
    heartbeat = "stopped sending heartbeats" in text or "heartbeat timeout" in text
    service = victim == 0 and "distributed service detected fatal errors" in text
    assert clear or heartbeat or service, text[-4000:]
    assert not (tmp_path / f"kill{victim}_{survivor}.json").exists()


@pytest.mark.slow
def test_a_process_that_hangs_without_dying_ends_the_run_after_the_timeout(tmp_path):
    """Process 1's loader hangs at step 4, alive: no heartbeat is missed, so JAX stops nothing.
    Each process's watchdog ends it after ``HANG_TIMEOUT_S`` without a finished step (exit
    code 124), with an ``error`` event saying why, instead of waiting forever."""
    results = _launch("hang", tmp_path)
    for i, (rc, text) in enumerate(results):
        assert rc == 124, (i, text[-4000:])
        assert "no training step finished" in text, text[-4000:]
    events = (tmp_path / "run" / "events.jsonl").read_text()
    assert "no training step finished" in events and "hang_timeout_s" in events


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["cfgmix", "localdir"])
def test_a_config_or_workdir_that_differs_between_processes_is_refused(tmp_path, mode):
    """Each hung silently at the first checkpoint (a checkpoint_every of 5 on one process and 7
    on the other; a workdir on disks local to each process): now both processes raise at
    once, naming the field or the processes."""
    res = _ok(mode, tmp_path)
    for r in res:
        assert r["error"] is not None
        if mode == "cfgmix":
            assert "checkpoint_every (processes [1])" in r["error"], r
        else:
            assert "is not one folder shared" in r["error"], r
    assert not list(tmp_path.glob("run*/.nan2safe_shared.*"))  # the markers are cleaned up


# ----------------------------------------------------------------- fast, one process


def test_init_cpu_validates_its_arguments():
    with pytest.raises(ValueError, match="local_devices"):
        sharding.init_cpu(0)
    with pytest.raises(ValueError, match="process_id"):
        sharding.init_cpu(2, coordinator="127.0.0.1:1", num_processes=2, process_id=2)
    with pytest.raises(ValueError, match="coordinator"):
        sharding.init_cpu(2, num_processes=2, process_id=1)
    with pytest.raises(ValueError, match="coordinator"):
        sharding.init_cpu(2, coordinator="localhost", num_processes=2, process_id=0)
    with pytest.raises(ValueError, match="heartbeat_timeout_s"):
        sharding.init_cpu(2, coordinator="h:1", num_processes=2, heartbeat_timeout_s=0)


def test_init_cpu_refuses_after_the_backend_exists():
    import jax

    jax.devices()
    with pytest.raises(RuntimeError, match="before JAX initializes"):
        sharding.init_cpu(2)


def test_distributed_options_bound_the_wait_for_a_lost_process():
    assert sharding.distributed_options(None) is None
    opts = sharding.distributed_options("10.0.0.1:1234", 4, 3, heartbeat_timeout_s=7)
    assert opts == {
        "coordinator_address": "10.0.0.1:1234",
        "num_processes": 4,
        "process_id": 3,
        "initialization_timeout": 60,
        "heartbeat_timeout_seconds": 7,
        "shutdown_timeout_seconds": 21,
    }
    with pytest.raises(ValueError, match="init_timeout_s"):
        sharding.distributed_options("h:1", 2, 0, init_timeout_s=0)


def test_lost_process_error_names_the_cause():
    gloo = RuntimeError(
        "UNKNOWN: Gloo all-reduce failed: [pair.cc:547] Connection closed by peer [127.0.0.1]:1"
    )
    err = sharding.lost_process_error(gloo, process=0, count=2)
    assert isinstance(err, RuntimeError)
    assert "process 0 of 2" in str(err) and "died" in str(err) and "Gloo" in str(err)
    assert sharding.lost_process_error(gloo, process=0, count=1) is None  # one process
    other = RuntimeError("RESOURCE_EXHAUSTED: out of memory")
    assert sharding.lost_process_error(other, process=0, count=2) is None


def test_agreement_of_a_host_decision():
    decision = ["located", "blocks.0", "div"]
    assert sharding.agree(decision, "tier-2 decision") is decision  # one process: as is
    sharding.check_agreement([5, 5, 5], "tier-2 decision")
    with pytest.raises(RuntimeError, match=r"processes \[1, 3\] took another tier-2 decision"):
        sharding.check_agreement([5, 6, 5, 7], "tier-2 decision")
    assert sharding._digest(decision) == sharding._digest(list(decision))
    assert sharding._digest(decision) != sharding._digest(["transient", None, None])


def test_log_dir_and_host_arrays_are_plain_in_one_process(tmp_path):
    import jax.numpy as jnp
    import numpy as np

    assert sharding.log_dir(tmp_path) == tmp_path
    tree = {"a": jnp.ones(3)}
    assert sharding.host_arrays(tree) is tree
    np.testing.assert_array_equal(tree["a"], np.ones(3))


def test_fields_that_differ_between_processes_are_named():
    sharding.check_field_agreement([[1, 2, 3], [1, 2, 3]], ["a", "b", "c"], "the Config")
    with pytest.raises(ValueError, match=r"the Config differs .*b \(processes \[1, 2\]\)"):
        sharding.check_field_agreement(
            [[1, 2, 3], [1, 5, 3], [1, 6, 3]], ["a", "b", "c"], "the Config"
        )
    sharding.agree_fields({"a": 1}, "the Config")  # one process: nothing to compare
    # settings that compare equal have one digest (a review found 5 and 5.0 refused)
    same = [{"z": 5, "t": (1, 2)}, {"z": 5.0, "t": [1.0, 2]}, {"z": np.float32(5), "t": (1, 2)}]
    digests = [sharding._digest(sharding._canonical(r)) for r in same]
    assert len(set(digests)) == 1
    assert sharding._digest(sharding._canonical({"z": 5.5})) != digests[0]


def test_a_workdir_some_process_cannot_see_is_named(tmp_path):
    from nan2safe_jax.workdir import check_shared, check_shared_table

    check_shared_table([[True, True], [True, True]], tmp_path)
    with pytest.raises(ValueError, match=r"process 1 does not see processes \[0\]"):
        check_shared_table([[True, False], [False, True]], tmp_path)
    check_shared(tmp_path)  # one process: nothing to check, nothing written
    assert not list(tmp_path.iterdir())
