"""Tier-1 overhead: a plain optax + NNX train step vs the same model through make_train_step.

Both arms train the demo-size decoder (4 layers, d_model 256, seq 128, batch 8, vocab 256):
  plain    — the transformer written with flax.nnx modules, optax.adamw, one jax.jit step;
  nan2safe — examples.transformer (nan2safe.nn sites, probes on) through make_train_step with
             guard(optax.adamw) in FAST: loss scale, geared clip, skip-non-finite, detector.
Variants are interleaved over rounds so machine drift hits both alike; each round times
``--steps`` steps after a warm-up. Prints min/median/max per arm and the median ratio.

With ``--devices N`` both arms run sharded over N devices (``--sharding dp``: batch over a
``data`` axis of N, parameters replicated; ``fsdp``: a ``2 x N/2`` data x fsdp mesh, parameters
and optimizer state split over ``fsdp``), the plain arm jitted with the same shardings. On CPU
the N devices are simulated: the script re-executes itself with
``XLA_FLAGS=--xla_force_host_platform_device_count=N`` (it must be set before JAX starts).

    python benchmarks/overhead.py [--rounds 5] [--steps 10] [--json PATH] [--dtype float32]
                                  [--devices N] [--sharding dp|fsdp] [--batch 8]
    python benchmarks/overhead.py --processes 2   # N jax.distributed processes vs 1 process
                                                  # (benchmarks/overhead_processes.py)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

import nan2safe_jax as nan2safe  # noqa: E402
from examples.transformer import Transformer, TransformerConfig, lm_loss, make_batch  # noqa: E402


class PlainBlock(nnx.Module):
    def __init__(self, cfg: TransformerConfig, *, rngs):
        kw = dict(dtype=cfg.dtype, param_dtype=cfg.param_dtype, rngs=rngs)
        self.ln1 = nnx.LayerNorm(cfg.d_model, epsilon=cfg.epsilon, **kw)
        self.attn = nnx.MultiHeadAttention(cfg.num_heads, cfg.d_model, decode=False, **kw)
        self.ln2 = nnx.LayerNorm(cfg.d_model, epsilon=cfg.epsilon, **kw)
        self.fc1 = nnx.Linear(cfg.d_model, cfg.ff, **kw)
        self.fc2 = nnx.Linear(cfg.ff, cfg.d_model, **kw)

    def __call__(self, x, mask):
        x = x + self.attn(self.ln1(x), mask=mask, deterministic=True)
        return x + self.fc2(jax.nn.gelu(self.fc1(self.ln2(x))))


class PlainTransformer(nnx.Module):
    def __init__(self, cfg: TransformerConfig, *, rngs):
        kw = dict(dtype=cfg.dtype, param_dtype=cfg.param_dtype, rngs=rngs)
        self.embed = nnx.Embed(cfg.vocab, cfg.d_model, **kw)
        self.pos = nnx.Embed(cfg.seq_len, cfg.d_model, **kw)
        self.blocks = nnx.List([PlainBlock(cfg, rngs=rngs) for _ in range(cfg.num_layers)])
        self.norm = nnx.LayerNorm(cfg.d_model, epsilon=cfg.epsilon, **kw)
        self.head = nnx.Linear(cfg.d_model, cfg.vocab, **kw)

    def __call__(self, tokens, mask):
        t = tokens.shape[-1]
        x = self.embed(tokens) + self.pos(jnp.arange(t))
        causal = jnp.tril(jnp.ones((t, t), bool))
        amask = (mask[:, None, None, :] | jnp.eye(t, dtype=bool)) & causal
        for block in self.blocks:
            x = block(x, amask)
        return self.head(self.norm(x))


def plain_loss(model, batch):
    tokens, mask = batch["tokens"], batch["mask"]
    logits = model(tokens, mask)[:, :-1].astype(jnp.float32)
    nll = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:])
    w = mask[:, 1:].astype(jnp.float32)
    return jnp.sum(nll * w) / jnp.maximum(jnp.sum(w), 1.0)


def make_plain(cfg, tx, rules=None):
    model = PlainTransformer(cfg, rngs=nnx.Rngs(0))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    opt_state = tx.init(params)

    def raw_step(params, opt_state, rest, batch):
        def f(p):
            return plain_loss(nnx.merge(graphdef, p, rest), batch)

        loss, grads = jax.value_and_grad(f)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    if rules is None:
        step = jax.jit(raw_step)
    else:  # the same placement nan2safe.sharding gives the nan2safe arm
        ps = jax.tree_util.tree_map(rules.param_sharding, params)
        os_ = jax.tree_util.tree_map(rules.param_sharding, opt_state)
        rs = jax.tree_util.tree_map(lambda _: rules.replicated, rest)
        params, opt_state, rest = jax.device_put((params, opt_state, rest), (ps, os_, rs))
        step = jax.jit(
            raw_step,
            in_shardings=(ps, os_, rs, rules.batch_sharding(jnp.zeros((rules.num_data_shards,)))),
            out_shardings=(ps, os_, rules.replicated),
        )

    carry = [params, opt_state]

    def run(batch):
        carry[0], carry[1], loss = step(carry[0], carry[1], rest, batch)
        return loss

    return run


def make_n2s(cfg, tx, rules=None):
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    state = nan2safe.TrainState.create(model, nan2safe.optax.guard(tx), nan2safe.Config())
    step = nan2safe.make_train_step(lm_loss, rules=rules)
    carry = [state]

    def run(batch):
        carry[0], m = step(carry[0], batch)
        return m["loss"]

    return run


def time_steps(run, batches, steps):
    t0 = time.perf_counter()
    loss = None
    for i in range(steps):
        loss = run(batches[i % len(batches)])
    jax.block_until_ready(loss)
    return (time.perf_counter() - t0) / steps


def table(record: dict) -> str:
    """The record of ``main`` (or its JSON) as the printed table."""
    if "layers" in record:
        model = f"{record['layers']} layers, d_model {record['d_model']}, seq {record['seq']}"
    else:  # a JSON from before the model size was recorded: the script's defaults ran
        model = "size not recorded (the script's defaults)"
    lines = [
        f"backend {record['backend']}  devices {record['devices']}  dtype {record['dtype']}",
        f"model: {model}, batch {record['batch']}",
    ]
    if record.get("sharding"):
        lines.append(f"sharding: {record['sharding']}  mesh {record['mesh']}")
    lines.append(f"{'arm':<10} {'min ms':>9} {'median ms':>10} {'max ms':>9}")
    for k, v in record["times_s"].items():
        med = record["median_s"][k]
        lines.append(f"{k:<10} {min(v) * 1e3:9.2f} {med * 1e3:10.2f} {max(v) * 1e3:9.2f}")
    lines.append(f"ratio nan2safe / plain (median): {record['ratio']:.3f}x")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--devices", type=int, default=0, help="shard over N devices (0: one)")
    ap.add_argument("--sharding", default="dp", choices=["dp", "fsdp"])
    ap.add_argument("--batch", type=int, default=8, help="global batch size")
    ap.add_argument("--processes", type=int, default=1, help="N processes vs one")
    args = ap.parse_args(argv)
    if args.processes > 1:  # jax.distributed over loopback: benchmarks/overhead_processes.py
        from overhead_processes import run_processes

        return run_processes(args, sys.argv[1:] if argv is None else argv)
    rules = _rules(args, argv)

    cfg = TransformerConfig(
        num_layers=args.layers, d_model=args.d_model, dtype=jnp.dtype(args.dtype)
    )
    tx = optax.adamw(3e-4)
    batches = [make_batch(jax.random.key(i), cfg, args.batch) for i in range(4)]
    if rules is not None:
        batches = [nan2safe.sharding.shard_batch(b, rules) for b in batches]
    arms = {"plain": make_plain(cfg, tx, rules), "nan2safe": make_n2s(cfg, tx, rules)}
    for run in arms.values():  # compile and warm up
        time_steps(run, batches, 3)
    times = {k: [] for k in arms}
    for _ in range(args.rounds):
        for name, run in arms.items():
            times[name].append(time_steps(run, batches, args.steps))

    med = {k: statistics.median(v) for k, v in times.items()}
    ratio = med["nan2safe"] / med["plain"]
    record = {
        "ratio": ratio,
        "median_s": med,
        "times_s": times,
        "rounds": args.rounds,
        "steps_per_round": args.steps,
        "dtype": args.dtype,
        "backend": jax.default_backend(),
        "devices": jax.device_count(),
        "sharding": None if rules is None else args.sharding,
        "mesh": None if rules is None else dict(rules.mesh.shape),
        "batch": args.batch,
        "layers": args.layers,
        "d_model": args.d_model,
        "seq": cfg.seq_len,
        "command": " ".join(
            ["python", "benchmarks/overhead.py", *(sys.argv[1:] if argv is None else argv)]
        ),
    }
    print(table(record))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(record, indent=1))
    return record


def _rules(args, argv):
    """The sharding rules for ``--devices``; re-executes with simulated CPU devices if needed."""
    n = args.devices
    if n <= 0:
        return None
    if jax.device_count() < n:
        flag = nan2safe.sharding.cpu_simulation_flags(n)
        if jax.default_backend() != "cpu" or os.environ.get("_N2S_REEXEC") == flag:
            raise SystemExit(f"--devices {n}: only {jax.device_count()} devices available")
        env = dict(os.environ, _N2S_REEXEC=flag)
        env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {flag}".strip()
        argv = sys.argv[1:] if argv is None else list(argv)
        sys.stdout.flush()
        os.execve(sys.executable, [sys.executable, str(Path(__file__).resolve()), *argv], env)
    devices = jax.devices()[:n]
    if args.sharding == "fsdp":
        if n % 2:
            raise SystemExit(f"--sharding fsdp needs an even --devices, got {n}")
        mesh = nan2safe.sharding.make_mesh((2, n // 2), ("data", "fsdp"), devices=devices)
        return nan2safe.sharding.fsdp(mesh)
    mesh = nan2safe.sharding.make_mesh((n,), ("data",), devices=devices)
    return nan2safe.sharding.data_parallel(mesh)


if __name__ == "__main__":
    main()
