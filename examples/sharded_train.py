"""Sharded training: the example transformer on a data x fsdp mesh, through the Trainer.

Single host, simulated devices (CPU): the script sets
``XLA_FLAGS=--xla_force_host_platform_device_count=N`` before it imports JAX.

    python examples/sharded_train.py --devices 8 --mesh 2x4 --steps 30 --fault-step 12

``--fault-step K`` hands over, at step K, a batch whose row ``--fault-row`` is left-padded: with
the key-padding mask and causal attention that query sees only padding keys, its softmax row is
fully masked. FAST is flax's attention now, which fills masked logits with ``finfo.min``
(not -inf), so that row stays finite and no incident follows (run on 2 processes here: no
event). A NaN incident across processes is exercised by ``make multihost``
(``tests/multihost_worker.py``: a NaN row and a 0/0 row in process 1's rows).

Multi-process (one process per host, or several on one machine over loopback; every process
runs the same command with its own ``--process-id``, gets mesh-size / num-processes CPU devices
through ``nan2safe.sharding.init_cpu`` and passes only its own rows of every batch):

    python examples/sharded_train.py --coordinator 127.0.0.1:12345 --num-processes 2 \\
        --process-id 0 --mesh 2x2 --steps 12 --fault-step 5 --workdir runs/mh   # and id 1

``--mesh 2x2``: the data axis spans the processes and each process splits the parameters over
its own two devices; ``--mesh 1x4 --zero3``: parameters and batch split over all four devices,
so every parameter is split across the processes.

``jax.distributed.initialize`` connects the processes (gloo collectives on CPU); JAX's SPMD
engine does the rest. Checkpoints (orbax) need a ``--workdir`` every process can reach.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

_REPO = Path(__file__).resolve().parents[1]
if str(_REPO) not in sys.path:
    sys.path.insert(0, str(_REPO))


def _args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--devices", type=int, default=8, help="simulated CPU devices (single host)")
    ap.add_argument("--mesh", default="2x4", help="data x fsdp, e.g. 2x4 (8x1: data parallel)")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--batch", type=int, default=8, help="global batch size")
    ap.add_argument(
        "--zero3",
        action="store_true",
        help="split the batch over both mesh axes (with --mesh 1xN: parameters and batch over "
        "every device, across processes)",
    )
    ap.add_argument("--fault-step", type=int, default=None)
    ap.add_argument("--fault-row", type=int, default=5)
    ap.add_argument("--workdir", default="runs/sharded")
    ap.add_argument("--coordinator", default=None, help="host:port of process 0 (multi-host)")
    ap.add_argument("--num-processes", type=int, default=None)
    ap.add_argument("--process-id", type=int, default=None)
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = _args(argv)
    import jax
    import numpy as np
    import optax
    from flax import nnx
    from jax.experimental import multihost_utils

    import nan2safe_jax as nan2safe
    from examples.transformer import Transformer, TransformerConfig, lm_loss, make_batch

    data_n, fsdp_n = (int(v) for v in args.mesh.lower().split("x"))
    if args.coordinator is None:
        nan2safe.sharding.init_cpu(args.devices)  # simulated devices, one process
    else:  # this process's share of the mesh's devices
        procs = args.num_processes
        if (data_n * fsdp_n) % procs:
            raise ValueError(f"--mesh {args.mesh} does not split over {procs} processes")
        nan2safe.sharding.init_cpu(
            data_n * fsdp_n // procs,
            coordinator=args.coordinator,
            num_processes=procs,
            process_id=args.process_id,
        )
    mesh = nan2safe.sharding.make_mesh((data_n, fsdp_n), ("data", "fsdp"))
    if fsdp_n > 1:
        data_axis = ("data", "fsdp") if args.zero3 else "data"
        rules = nan2safe.sharding.fsdp(mesh, data_axis=data_axis, min_size=256)
    else:
        rules = nan2safe.sharding.data_parallel(mesh)

    cfg = TransformerConfig(num_layers=2, d_model=64, num_heads=4, seq_len=32, pad_mask="keys")
    ncfg = nan2safe.Config(checkpoint_every=10, min_history=8, safe_max_steps=4)
    workdir = Path(args.workdir)
    if jax.process_index() == 0 and workdir.exists():
        shutil.rmtree(workdir)  # a fresh run each time (remove this line to resume)
    if jax.process_count() > 1:  # nobody writes into the workdir before it is cleared
        multihost_utils.sync_global_devices("workdir cleared")
    trainer = nan2safe.Trainer(
        Transformer(cfg, rngs=nnx.Rngs(0)), optax.adamw(3e-3), lm_loss, ncfg, workdir, rules=rules
    )

    local_rows = args.batch // jax.process_count()  # each process feeds its own rows

    def batches():
        for i in range(args.steps):
            key = jax.random.fold_in(jax.random.key(i), jax.process_index())
            b = {k: np.array(v) for k, v in make_batch(key, cfg, local_rows, pad=False).items()}
            if i == args.fault_step and args.fault_row // local_rows == jax.process_index():
                # Left padding: real tokens at the end, so early queries see only padding keys.
                # Only the process that owns global row --fault-row changes its batch.
                b["mask"][args.fault_row % local_rows, : cfg.seq_len // 2] = False
            yield b

    history = trainer.fit(batches(), steps=args.steps)
    if jax.process_index() != 0:
        return 0
    kernel = jax.tree_util.tree_leaves(trainer.state.params)[-1]
    procs = jax.process_count()
    print(f"devices {jax.device_count()} ({procs} processes), mesh {dict(mesh.shape)}")
    holders = sorted({d.process_index for d in kernel.sharding.device_set})
    print(f"a parameter {kernel.shape}: {kernel.sharding.spec} on processes {holders}")
    print(f"loss {history[0]['loss']:.3f} -> {history[-1]['loss']:.3f} over {len(history)} steps")
    for e in trainer.events:
        if e["type"] in ("downshift", "locate", "safe_enter", "safe_exit", "recover"):
            brief = {k: e[k] for k in ("site", "cause", "action", "shards") if k in e}
            if "report" in e:
                brief["culprit"] = f"{e['report']['primitive']} in {e['report']['site']}"
            print(f"step {e['step']:3d} {e['type']:<10} {json.dumps(brief)[:300]}")
    gear = trainer.state.gear.level
    same = nan2safe.sharding.is_replicated(gear)
    print(f"gear {int(gear)} on every device: {same} ({len(gear.addressable_shards)} copies)")
    return 0 if np.isfinite(history[-1]["loss"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
