"""Tier-1 overhead under ``jax.distributed``: ``benchmarks/overhead.py --processes N``.

The two arms of ``overhead.py`` (plain flax.nnx + optax step vs the same model through
``nan2safe.make_train_step``), data parallel over N CPU devices, measured twice with the same
global mesh, batch and model:

- ``1 process``: one process with N simulated CPU devices;
- ``N processes``: N ``jax.distributed`` processes over loopback, one CPU device each (gloo
  collectives), each feeding its own rows of every batch, as a run on N hosts would.

Each configuration runs in fresh subprocesses (``--worker``), arms interleaved over rounds as in
``overhead.py``; process 0 reports its step times. Prints both ratios nan2safe / plain, side by
side, and writes them with the raw times to ``--json``.

    python benchmarks/overhead.py --processes 2 [--rounds 5] [--steps 10] [--batch 8]
                                  [--json docs/overhead_processes.json]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT_S = 900  # per configuration; its processes are killed after that


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(processes: int, devices: int, args, out: Path) -> dict:
    """Runs one configuration; returns process 0's record plus the peak RSS of its processes."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    common = [
        "--rounds",
        str(args.rounds),
        "--steps",
        str(args.steps),
        "--batch",
        str(args.batch),
        "--dtype",
        args.dtype,
        "--layers",
        str(args.layers),
        "--d-model",
        str(args.d_model),
    ]
    port = str(_free_port())
    procs = []
    for i in range(processes):
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", str(out), *common]
        cmd += ["--devices", str(devices), "--num-processes", str(processes)]
        if processes > 1:
            cmd += ["--coordinator", f"127.0.0.1:{port}", "--process-id", str(i)]
        procs.append(
            subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        )
    try:
        logs = [p.communicate(timeout=TIMEOUT_S)[0].decode() for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for p, text in zip(procs, logs, strict=True):
        if p.returncode != 0:
            raise SystemExit(f"worker failed ({p.returncode}):\n{text[-4000:]}")
    return json.loads((out / "worker_0.json").read_text())


def table(record: dict) -> str:
    """The record of ``run_processes`` (or its JSON) as the printed table."""
    r = record
    lines = [
        f"backend {r['backend']}  dtype {r['dtype']}  "
        f"data parallel over {r['devices']} CPU devices",
        f"model: {r['layers']} layers, d_model {r['d_model']}, seq {r['seq']}, "
        f"global batch {r['batch']}; {r['rounds']} rounds x {r['steps_per_round']} steps",
        f"{'configuration':<26} {'plain ms':>9} {'nan2safe ms':>12} {'ratio':>7}",
    ]
    for name, c in r["configurations"].items():
        med = c["median_s"]
        lines.append(
            f"{name:<26} {med['plain'] * 1e3:9.2f} {med['nan2safe'] * 1e3:12.2f} {c['ratio']:6.3f}x"
        )
    return "\n".join(lines)


def run_processes(args, argv) -> dict:
    """``overhead.py --processes N``: both configurations, the table and the JSON.

    Args:
      args: ``overhead.py``'s parsed arguments (``processes``, ``rounds``, ``steps``, ``batch``,
        ``dtype``, ``layers``, ``d_model``, ``json``).
      argv: its command line, recorded in the JSON.

    Returns:
      The record written to ``--json``.
    """
    import tempfile

    n = int(args.processes)
    if n < 2:
        raise SystemExit(f"--processes must be >= 2, got {n}")
    if args.batch % n:
        raise SystemExit(f"--batch {args.batch} is not divisible by --processes {n}")
    configs = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, procs, devs in (
            (f"1 process x {n} devices", 1, n),
            (f"{n} processes x 1 device", n, 1),
        ):
            out = Path(tmp) / f"p{procs}"
            out.mkdir()
            configs[name] = _launch(procs, devs, args, out)
            print(f"{name}: ratio {configs[name]['ratio']:.3f}x", flush=True)
    first = next(iter(configs.values()))
    record = {
        "configurations": {
            k: {
                key: c[key] for key in ("ratio", "median_s", "times_s", "processes", "peak_rss_mib")
            }
            for k, c in configs.items()
        },
        "devices": n,
        "processes": n,
        **{k: first[k] for k in ("backend", "dtype", "batch", "layers", "d_model", "seq")},
        "rounds": args.rounds,
        "steps_per_round": args.steps,
        "command": " ".join(["python", "benchmarks/overhead.py", *argv]),
    }
    print(table(record))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(record, indent=1))
    return record


def _worker(argv) -> int:
    """One process of one configuration: both arms, interleaved, timed by process 0."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker", type=Path, required=True)
    ap.add_argument("--rounds", type=int)
    ap.add_argument("--steps", type=int)
    ap.add_argument("--batch", type=int)
    ap.add_argument("--dtype")
    ap.add_argument("--layers", type=int)
    ap.add_argument("--d-model", type=int)
    ap.add_argument("--devices", type=int)
    ap.add_argument("--num-processes", type=int)
    ap.add_argument("--coordinator")
    ap.add_argument("--process-id", type=int, default=0)
    a = ap.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import nan2safe_jax as nan2safe

    nan2safe.sharding.init_cpu(
        a.devices,
        coordinator=a.coordinator,
        num_processes=a.num_processes,
        process_id=a.process_id,
    )
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from overhead import make_n2s, make_plain, time_steps

    from examples.transformer import TransformerConfig, make_batch

    rules = nan2safe.sharding.data_parallel(
        nan2safe.sharding.make_mesh((jax.device_count(),), ("data",))
    )
    cfg = TransformerConfig(num_layers=a.layers, d_model=a.d_model, dtype=jnp.dtype(a.dtype))
    tx = optax.adamw(3e-4)
    me, procs = jax.process_index(), jax.process_count()
    rows = slice(me * a.batch // procs, (me + 1) * a.batch // procs)
    batches = []
    for i in range(4):  # the same global batches as overhead.py; each process feeds its rows
        b = make_batch(jax.random.key(i), cfg, a.batch)
        local = {k: np.asarray(v)[rows] for k, v in b.items()}
        batches.append(nan2safe.sharding.shard_batch(local if procs > 1 else b, rules))
    arms = {"plain": make_plain(cfg, tx, rules), "nan2safe": make_n2s(cfg, tx, rules)}
    for run in arms.values():
        time_steps(run, batches, 3)  # warm-up (compile)
    times = {k: [] for k in arms}
    for _ in range(a.rounds):
        for name, run in arms.items():
            times[name].append(time_steps(run, batches, a.steps)[0])  # wall seconds
    med = {k: statistics.median(v) for k, v in times.items()}
    record = {
        "ratio": med["nan2safe"] / med["plain"],
        "median_s": med,
        "times_s": times,
        "processes": procs,
        "devices": jax.device_count(),
        "backend": jax.default_backend(),
        "dtype": a.dtype,
        "batch": a.batch,
        "layers": a.layers,
        "d_model": a.d_model,
        "seq": cfg.seq_len,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,  # KiB
    }
    if me == 0:
        (a.worker / "worker_0.json").write_text(json.dumps(record))
    return 0


if __name__ == "__main__":
    if "--worker" not in sys.argv:
        raise SystemExit("run python benchmarks/overhead.py --processes N")
    raise SystemExit(_worker(sys.argv[1:]))
