"""One process of the 2-process test in ``test_multihost.py`` (not a test module itself).

    python tests/multihost_worker.py OUT PORT PROCESS_ID

Two CPU devices per process, a 4-way data-parallel mesh over both processes, the fragile tiny
model through the Trainer; at step 3 process 1 feeds a NaN row. Writes ``OUT/result_<id>.json``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

FAULT_STEP = 3
STEPS = 8


def main(out: str, port: str, pid: str) -> int:
    import nan2safe_jax as nan2safe

    nan2safe.sharding.init_cpu(
        2, coordinator=f"127.0.0.1:{port}", num_processes=2, process_id=int(pid)
    )
    import jax
    import numpy as np
    from tiny_models import data, make_fragile

    rules = nan2safe.sharding.data_parallel(nan2safe.sharding.make_mesh((4,), ("data",)))
    model, tx, lf, cfg = make_fragile()
    workdir = Path(out) / "run"
    tr = nan2safe.Trainer(model, tx, lf, cfg, workdir, rules=rules)
    x, y = (np.asarray(a) for a in data(STEPS, seed=1))
    me = jax.process_index()
    rows = slice(16 * me, 16 * (me + 1))  # this process's half of each global batch of 32

    def batches():
        for i in range(STEPS):
            xb, yb = x[i, rows].copy(), y[i, rows]
            if i == FAULT_STEP and me == 1:
                xb[2] = np.nan
            yield xb, yb

    hist = tr.fit(batches(), steps=STEPS)
    tr.close()
    res = {
        "process": me,
        "devices": jax.device_count(),
        "local_devices": jax.local_device_count(),
        "skipped": [h["step"] for h in hist if h["skipped"]],
        "polluted": [h["step"] for h in hist if h["polluted"]],
        "gears": [h["gear"] for h in hist],
        "losses": [h["loss"] for h in hist],
        "events": [e["type"] for e in tr.events],
        "checkpoints": sorted(p.name for p in (workdir / "checkpoints").glob("[0-9]*")),
    }
    (Path(out) / f"result_{me}.json").write_text(json.dumps(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(*sys.argv[1:4]))
