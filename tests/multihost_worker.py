"""One process of the multi-process tests in ``test_multihost.py`` (not a test module itself).

    python tests/multihost_worker.py MODE OUT [PORT PROCESS_ID]

Two CPU devices per process, the fragile tiny model through the Trainer, a global batch of 32
rows of which each process feeds its own 16 (process 1: rows 16..31). Modes:

- ``dp`` / ``fsdp``: two processes, 12 steps on a data-parallel ``(4,)`` mesh or a ZeRO-3
  ``1 x 4`` data x fsdp mesh (parameters split over all four devices, i.e. across both
  processes). Process 1 feeds a NaN at step 3 (a polluted batch: skipped) and a constant row
  at step 6 (0/0 in the eps-free LayerNorm: tier 2 locates it). Checkpoints at steps 5 and 10.
  ``fsdp`` also writes ``OUT/ckpt_10.npz``: the gathered values of checkpoint 10.
- ``single``: ONE process, a ``(2,)`` data-parallel mesh: resumes the 2-process run from
  checkpoint 10, trains to step 15 (checkpoint 15, written by one process) and writes
  ``OUT/ckpt_15.npz``.
- ``resume``: two processes, the ZeRO-3 mesh again: resume from checkpoint 15, two more steps.
- ``kill0`` / ``kill1``: two processes, the ZeRO-3 mesh; process 0 (the coordinator) or 1
  kills itself (SIGKILL) while drawing the batch of step 4. The other must then stop with an
  error, not wait forever.

Writes ``OUT/<mode>_<process>.json``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

STEPS = 12
NAN_STEP, CONSTANT_STEP = 3, 6
NAN_ROW, CONSTANT_ROW = 2, 4  # local rows of process 1: global rows 18 and 20
KILL_STEP = 4
HEARTBEAT_S = 5
HANG_TIMEOUT_S = 60  # longer than the first step's compile on a loaded 2-core machine


def _rules(nan2safe, mode: str):
    sh = nan2safe.sharding
    if mode in ("fsdp", "resume", "kill0", "kill1"):
        mesh = sh.make_mesh((1, 4), ("data", "fsdp"))
        return sh.fsdp(mesh, data_axis=("data", "fsdp"), min_size=64)
    n = 2 if mode == "single" else 4
    return sh.data_parallel(sh.make_mesh((n,), ("data",)))


def _values(state) -> list:
    """The state's arrays as whole numpy arrays (gathered from every process)."""
    import jax
    import numpy as np
    from jax.experimental import multihost_utils

    leaves = [
        jax.random.key_data(x) if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else x
        for x in jax.tree_util.tree_leaves(state)
    ]
    if jax.process_count() > 1:
        leaves = multihost_utils.process_allgather(leaves, tiled=True)
    return [np.asarray(x) for x in leaves]


def _same(values: list, path: Path) -> bool:
    import numpy as np

    saved = np.load(path)
    return len(saved.files) == len(values) and all(
        np.array_equal(saved[f"arr_{i}"], v) for i, v in enumerate(values)
    )


def main(mode: str, out: str, port: str | None = None, pid: str | None = None) -> int:
    import nan2safe_jax as nan2safe

    if mode == "single":
        nan2safe.sharding.init_cpu(2)
    else:
        nan2safe.sharding.init_cpu(
            2,
            coordinator=f"127.0.0.1:{port}",
            num_processes=2,
            process_id=int(pid),
            heartbeat_timeout_s=HEARTBEAT_S,
        )
    import jax
    import numpy as np
    from tiny_models import data, make_fragile

    out = Path(out)
    rules = _rules(nan2safe, mode)
    model, tx, lf, cfg = make_fragile()
    workdir = out / ("run_dp" if mode == "dp" else "run")
    me, procs = jax.process_index(), jax.process_count()
    if mode in ("cfgmix", "localdir"):  # refused at once, on every process, instead of a hang
        if mode == "cfgmix" and me == 1:
            cfg = dataclasses.replace(cfg, checkpoint_every=cfg.checkpoint_every + 2)
        if mode == "localdir":
            workdir = out / f"run_local_{me}"
        try:
            nan2safe.Trainer(model, tx, lf, cfg, workdir, rules=rules).close()
            error = None
        except ValueError as err:
            error = str(err)
        (out / f"{mode}_{me}.json").write_text(json.dumps({"error": error}))
        return 0
    # "hang": process 1's loader hangs (alive: its heartbeats go on); each watchdog ends its
    # process after HANG_TIMEOUT_S without a finished step (exit code 124).
    timeout = HANG_TIMEOUT_S if mode == "hang" else "auto"
    tr = nan2safe.Trainer(model, tx, lf, cfg, workdir, rules=rules, hang_timeout_s=timeout)
    res: dict = {"process": me, "processes": procs, "devices": jax.device_count()}
    res["local_devices"] = jax.local_device_count()
    res["resumed_from"] = [e["from_step"] for e in tr.events if e["type"] == "resume"]
    if mode == "single":
        res["restored_equal"] = _same(_values(tr.state), out / "ckpt_10.npz")
    if mode == "resume":
        res["restored_equal"] = _same(_values(tr.state), out / "ckpt_15.npz")
    kernel = tr.state.params["blocks"][0]["up"]["kernel"][...]
    res["kernel_spec"] = str(kernel.sharding.spec)
    res["kernel_processes"] = sorted({d.process_index for d in kernel.sharding.device_set})
    res["kernel_local_shape"] = list(kernel.addressable_shards[0].data.shape)

    steps = {"single": 5, "resume": 2}.get(mode, STEPS)
    x, y = (np.asarray(a) for a in data(STEPS + 8, seed=1))
    rows = slice(16 * me, 16 * (me + 1)) if procs > 1 else slice(0, 32)
    start = tr.step

    def batches():
        for i in range(start, start + steps):
            xb, yb = x[i, rows].copy(), y[i, rows]
            if mode == f"kill{me}" and i == KILL_STEP:
                os.kill(os.getpid(), signal.SIGKILL)
            if mode == "hang" and me == 1 and i == KILL_STEP:
                time.sleep(10_000)
            if mode in ("dp", "fsdp") and me == 1 and i == NAN_STEP:
                xb[NAN_ROW] = np.nan
            if mode in ("dp", "fsdp") and me == 1 and i == CONSTANT_STEP:
                xb[CONSTANT_ROW] = 1.5  # zero variance: 0/0 in the eps-free LayerNorm
            yield xb, yb

    print(f"process {me}: training from step {start}", flush=True)
    hist = tr.fit(batches(), steps=steps)
    tr.close()
    res.update(
        skipped=[h["step"] for h in hist if h["skipped"]],
        polluted=[h["step"] for h in hist if h["polluted"]],
        gears=[h["gear"] for h in hist],
        site_gears=[h["site_gears"] for h in hist],
        losses=[h["loss"] for h in hist],
        finite=[h["finite"] for h in hist],
        events=[e["type"] for e in tr.events],
        locate=[
            {"step": e["step"], "site": e["report"]["site"], "shards": e["shards"]}
            for e in tr.events
            if e["type"] == "locate"
        ],
        checkpoints=sorted(int(p.name) for p in (workdir / "checkpoints").glob("[0-9]*")),
    )
    if mode == "fsdp":
        ck = nan2safe.checkpoint.Checkpointer(workdir / "checkpoints", async_save=False)
        values = _values(ck.restore(10, tr.state))
        ck.close()
        if me == 0:
            np.savez(out / "ckpt_10.npz", *values)
    if mode == "single":
        np.savez(out / "ckpt_15.npz", *_values(tr.state))
    (out / f"{mode}_{me}.json").write_text(json.dumps(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(*sys.argv[1:5]))
