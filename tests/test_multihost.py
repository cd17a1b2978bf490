"""Two real ``jax.distributed`` processes over loopback, 2 CPU devices each (gloo collectives)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

WORKER = Path(__file__).resolve().parent / "multihost_worker.py"
TIMEOUT_S = 240


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory):
    out = tmp_path_factory.mktemp("multihost")
    port = str(_free_port())
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), str(out), port, str(i)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        for i in range(2)
    ]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=TIMEOUT_S)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for p, text in zip(procs, logs, strict=False):
        assert p.returncode == 0, text[-4000:]
    return out, [json.loads((out / f"result_{i}.json").read_text()) for i in range(2)]


@pytest.mark.slow
def test_nan_row_in_process_1_is_skipped_alike_by_both(two_processes):
    _, (r0, r1) = two_processes
    assert r0["devices"] == r1["devices"] == 4
    assert r0["local_devices"] == r1["local_devices"] == 2
    assert r0["polluted"] == r1["polluted"] == [3]
    assert r0["skipped"] == r1["skipped"]
    assert 3 in r0["skipped"]
    assert r0["gears"] == r1["gears"]
    assert r0["losses"] == r1["losses"]
    assert r0["events"] == r1["events"]
    assert "skip" in r0["events"]


@pytest.mark.slow
def test_one_event_log_and_a_checkpoint_from_both(two_processes):
    out, (r0, _) = two_processes
    run = out / "run"
    assert (run / "events.jsonl").exists()
    # Process 1 keeps its own copy aside; the run's log is process 0's alone.
    assert (run / "process_1" / "events.jsonl").exists()
    lines = (run / "events.jsonl").read_text().splitlines()
    assert [json.loads(s)["type"] for s in lines] == r0["events"]
    assert r0["checkpoints"] == ["5"]


def test_init_cpu_validates_its_arguments():
    from nan2safe_jax import sharding

    with pytest.raises(ValueError, match="local_devices"):
        sharding.init_cpu(0)
    with pytest.raises(ValueError, match="process_id"):
        sharding.init_cpu(2, coordinator="127.0.0.1:1", num_processes=2, process_id=2)
    with pytest.raises(ValueError, match="coordinator"):
        sharding.init_cpu(2, num_processes=2, process_id=1)
    with pytest.raises(ValueError, match="coordinator"):
        sharding.init_cpu(2, coordinator="localhost", num_processes=2, process_id=0)


def test_init_cpu_refuses_after_the_backend_exists():
    import jax

    from nan2safe_jax import sharding

    jax.devices()
    with pytest.raises(RuntimeError, match="before JAX initializes"):
        sharding.init_cpu(2)


def test_log_dir_and_host_arrays_are_plain_in_one_process(tmp_path):
    import jax.numpy as jnp
    import numpy as np

    from nan2safe_jax import sharding

    assert sharding.log_dir(tmp_path) == tmp_path
    tree = {"a": jnp.ones(3)}
    assert sharding.host_arrays(tree) is tree
    np.testing.assert_array_equal(tree["a"], np.ones(3))
