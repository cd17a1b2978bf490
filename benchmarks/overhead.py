"""Tier-1 overhead: a plain optax + NNX train step vs the same model through make_train_step.

Both arms train the demo-size decoder (4 layers, d_model 256, seq 128, batch 8, vocab 256):
  plain    — the transformer written with flax.nnx modules, optax.adamw, one jax.jit step;
  nan2safe — examples.transformer (nan2safe.nn sites, probes on) through make_train_step with
             guard(optax.adamw) in FAST: loss scale, geared clip, skip-non-finite, detector.
             Every gear is FAST, so the step runs its FAST-only program (nan2safe_jax.programs;
             its general program is not needed, and is not compiled in the background here).
             The model is built without the example's fault-injection knobs
             (``TransformerConfig(knobs=False)``): the plain twin has none, and each is a
             multiply by a runtime scalar in every kernel that reads what it scales (156 of the
             demo step's ~6,500 fused instructions, counted on 2026-12-02).
Variants are interleaved over rounds so machine drift hits both alike: each round times every
arm in ``--chunks`` chunks of ``--steps`` steps after a warm-up, in a new random order each
chunk, and keeps each arm's fastest chunk (``measure.interleaved_rounds``; before 2026-12-04
the arms ran once per round in a fixed order, plain first). Prints min/median/max per arm,
the ratio of the medians, and the median of the rounds' paired ratios (each arm's round over
the plain arm's same round) with its 95% bootstrap interval and a verdict against the 1.03
target: met, missed, or not resolved by the run (the interval straddles it) —
``benchmarks/measure.py``.

``--ablation`` adds arms that split the overhead (interleaved with the others):
  general  — the nan2safe arm with ``make_train_step(fast_program=False)``: the one general
             program (every gear's path compiled, a gear switch per op) running at FAST;
  guard    — the *plain* flax.nnx model through make_train_step with guard(optax.adamw): the step
             machinery alone (loss scale, geared clip, skip, detector, polluted-input check,
             per-site learning-rate factors; the plain model has no sites and no probes);
  noprobe  — the nan2safe model with ``Config(probes=())``: the sites and their gear dispatch
             without any probe statistic;
  safe_attn — the nan2safe model with one attention site (``blocks.0.attn``) held in SAFE for
             the whole run (``safe_max_steps`` past the run's length): what a located fault
             costs every step until the site recovers (the write-up's figure: <= 1.08x). Timed
             once its partial program (nan2safe_jax.programs), built in the background from
             its first step, is ready; until then the general program runs its steps;
  safe_attn_general — the same state through the general program alone
             (``fast_program=False``): what those first steps cost.
``--arms plain,guard,guard_general`` times the arms named instead; ``guard_general`` is the
``guard`` arm with ``make_train_step(fast_program=False)``: no host read of ``next_all_fast``
before each dispatch (the plain model has no sites, so its two programs are the same).
Each round is timed on the wall clock and on the process's CPU clock (``time.process_time``:
the work done, less sensitive to other jobs on a shared machine); both ratios are reported.

``--host N`` also times N calls of each arm's step from the call to its return, the step
before it finished (``host_times``): the host's share of a step, apart from the device's.

``--compile`` times ``jax.jit(step).lower(...)`` and ``.compile()`` of each arm instead: plain,
nan2safe (the FAST-only program: what the first step waits for) and general (the general
program, which a run compiles in a background thread after its first step), each
arm in a fresh subprocess (no cache shared between arms; the persistent compilation cache is
off), with its peak RSS and the size of what it compiled (kernels, fused instructions, XLA's
flops and bytes accessed: the same on every run, where compile time moves by ±25%); a child
past ``--rss-cap-gb`` is killed and reported as such.
``--repeats N`` runs each arm N times (arms interleaved) and reports the medians: the plain
step's own compile time moves by ±25% between single runs on this machine.
``--compile --ablation`` adds the ``guard`` and ``noprobe`` arms (their FAST-only programs) and
splits what nan2safe adds to the plain step's compile: the step machinery (guard - plain), the
sites without probes (noprobe - guard), the probes (nan2safe - noprobe); in seconds and kernels.
With ``--scan-layers`` the guard arm's plain model is scanned too, and the machinery's share
is ``guard - plain_scan``.
``--compile --phases`` also splits each arm's compile by XLA's own phases, read from the log
its CPU compiler writes when asked (``measure.compile_phases``): the HLO passes, emitting the
kernels and LLVM compiling them, and the number of LLVM modules (about one per distinct
kernel XLA generates itself; an identical kernel is emitted once, a library call such as an
XNNPACK fusion is none). CPU only; the medians of the runs go in the arm's ``phases``.
``--compile --restart`` runs each arm (plain, nan2safe, general) twice per repeat against one
fresh persistent compilation cache: the first child compiles and writes the program, the second
finds it there — what a restarted run waits for (``Trainer`` keeps its cache in
``workdir/compile_cache``; ``nan2safe_jax.compile_cache``). JSON under ``"restart"``.
``--scan-layers`` builds the nan2safe model with ``nnx.scan`` over stacked blocks. The plain
arm stays a Python loop (flax's usual layout), and ``--compile`` adds the ``plain_scan`` arm:
the plain model with its blocks stacked and scanned the same way (``nnx.vmap`` / ``nnx.scan``),
the like-for-like base (``ratio_scan`` in the JSON); ``--arms`` may name it too. The
GPT-2-small shape:
``--compile --layers 12 --d-model 768 --heads 12 --seq 256 --dtype float16``.

``--donate``: every arm's step donates its state, as a training loop that keeps no old state
would (the plain step ``donate_argnums=(0, 1)``, nan2safe ``make_train_step(donate=True)``).
Without it neither does (the default): a state leaf the step returns unchanged (a gear, a knob,
a probe no kind writes) is then a copy of its input, one small kernel each (~260 in the demo's
FAST-only step; the plain step returns only its parameters and optimizer state).

With ``--devices N`` both arms run sharded over N devices (``--sharding dp``: batch over a
``data`` axis of N, parameters replicated; ``fsdp``: a ``2 x N/2`` data x fsdp mesh, parameters
and optimizer state split over ``fsdp``, the batch over ``data`` only, so how the ``fsdp``
devices share the compute is XLA's choice; ``zero3``: the same mesh and parameter split with the
batch over both axes, every device on its own rows), the plain arm jitted with the same
shardings. On CPU
the N devices are simulated: the script re-executes itself with
``XLA_FLAGS=--xla_force_host_platform_device_count=N`` (it must be set before JAX starts).

    python benchmarks/overhead.py [--rounds 5] [--steps 10] [--chunks 1] [--host N] [--json PATH]
                                  [--dtype float32] [--donate] [--devices N]
                                  [--sharding dp|fsdp|zero3] [--batch 8] [--ablation]
                                  [--compile [--restart] [--phases]] [--scan-layers]
                                  [--layers 4]
                                  [--d-model 256]
                                  [--heads 4] [--seq 128] [--rss-cap-gb 5]
    python benchmarks/overhead.py --processes 2   # N jax.distributed processes vs 1 process
                                                  # (benchmarks/overhead_processes.py)
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # measure
# Timed steps run the FAST-only program; a background compile of the general one would share the
# CPU with them (nan2safe_jax.programs).
os.environ.setdefault("NAN2SAFE_BACKGROUND_COMPILE", "0")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from measure import (  # noqa: E402
    PHASE_LOG_ENV,
    compile_phases,
    interleaved_rounds,
    paired_ratio,
    program_size,
    ratio_text,
)

import nan2safe_jax as nan2safe  # noqa: E402
from examples.transformer import Transformer, TransformerConfig, lm_loss, make_batch  # noqa: E402

TARGET = 1.03  # step time, nan2safe / plain (issue #15)
COMPILE_TARGET = 1.3


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
    """The flax twin of the example transformer; with ``cfg.scan_layers`` its blocks are
    stacked with ``nnx.vmap`` and run with ``nnx.scan``, as the example's are (the
    ``plain_scan`` arm and, under ``--scan-layers``, the ``guard`` arms' model)."""

    def __init__(self, cfg: TransformerConfig, *, rngs):
        kw = dict(dtype=cfg.dtype, param_dtype=cfg.param_dtype, rngs=rngs)
        self.embed = nnx.Embed(cfg.vocab, cfg.d_model, **kw)
        self.pos = nnx.Embed(cfg.seq_len, cfg.d_model, **kw)
        self.scan = cfg.scan_layers
        if cfg.scan_layers:

            @nnx.split_rngs(splits=cfg.num_layers)
            @nnx.vmap(in_axes=(0,), out_axes=0)
            def make_blocks(rngs):
                return PlainBlock(cfg, rngs=rngs)

            self.blocks = make_blocks(rngs)
        else:
            self.blocks = nnx.List([PlainBlock(cfg, rngs=rngs) for _ in range(cfg.num_layers)])
        self.norm = nnx.LayerNorm(cfg.d_model, epsilon=cfg.epsilon, **kw)
        self.head = nnx.Linear(cfg.d_model, cfg.vocab, **kw)

    def __call__(self, tokens, mask):
        t = tokens.shape[-1]
        x = self.embed(tokens) + self.pos(jnp.arange(t))
        causal = jnp.tril(jnp.ones((t, t), bool))
        amask = (mask[:, None, None, :] | jnp.eye(t, dtype=bool)) & causal
        if self.scan:

            @nnx.scan(in_axes=(0, nnx.Carry, None), out_axes=nnx.Carry)
            def scan_blocks(block, x, amask):
                return block(x, amask)

            x = scan_blocks(self.blocks, x, amask)
        else:
            for block in self.blocks:
                x = block(x, amask)
        return self.head(self.norm(x))


def plain_loss(model, batch):
    tokens, mask = batch["tokens"], batch["mask"]
    logits = model(tokens, mask)[:, :-1].astype(jnp.float32)
    nll = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:])
    w = mask[:, 1:].astype(jnp.float32)
    return jnp.sum(nll * w) / jnp.maximum(jnp.sum(w), 1.0)


def make_plain(cfg, tx, rules=None, donate=False, scan=False):
    """The plain optax + NNX step; ``scan``: its blocks scanned (the ``plain_scan`` arm), else
    a Python loop of layers whatever ``cfg.scan_layers`` says (flax's usual layout)."""
    model = PlainTransformer(dataclasses.replace(cfg, scan_layers=scan), rngs=nnx.Rngs(0))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    opt_state = tx.init(params)

    def raw_step(params, opt_state, rest, batch):
        def f(p):
            return plain_loss(nnx.merge(graphdef, p, rest), batch)

        loss, grads = jax.value_and_grad(f)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    donated = dict(donate_argnums=(0, 1)) if donate else {}
    if rules is None:
        step = jax.jit(raw_step, **donated)
    else:  # the same placement nan2safe.sharding gives the nan2safe arm
        ps = jax.tree_util.tree_map(rules.param_sharding, params)
        os_ = jax.tree_util.tree_map(rules.param_sharding, opt_state)
        rs = jax.tree_util.tree_map(lambda _: rules.replicated, rest)
        params, opt_state, rest = jax.device_put((params, opt_state, rest), (ps, os_, rs))
        step = jax.jit(
            raw_step,
            in_shardings=(ps, os_, rs, rules.batch_sharding(jnp.zeros((rules.num_data_shards,)))),
            out_shardings=(ps, os_, rules.replicated),
            **donated,
        )

    carry = [params, opt_state]

    def run(batch):
        carry[0], carry[1], loss = step(carry[0], carry[1], rest, batch)
        return loss

    run.lower = lambda batch: step.lower(carry[0], carry[1], rest, batch)
    run.carry = carry  # the state the next step gets: [params, opt_state]
    return run


def make_n2s(
    cfg,
    tx,
    rules=None,
    n2s_cfg=None,
    model=None,
    loss_fn=lm_loss,
    fast_program=True,
    background=False,
    donate=False,
):
    """The nan2safe arm; ``model``/``loss_fn`` default to the example transformer (the guard
    ablation passes the plain model and its loss). ``run.lower`` lowers the program an all-FAST
    state runs (the general one with ``fast_program=False``). ``background``: the step's
    background compiles on (the partial program of a state with a site out of FAST);
    ``run.wait()`` waits for them, ``run.program()`` names the program of the last step."""
    model = Transformer(cfg, rngs=nnx.Rngs(0)) if model is None else model
    n2s_cfg = nan2safe.Config() if n2s_cfg is None else n2s_cfg
    state = nan2safe.TrainState.create(model, nan2safe.optax.guard(tx), n2s_cfg)
    with _background(background):
        step = nan2safe.make_train_step(
            loss_fn, rules=rules, fast_program=fast_program, donate=donate
        )
    carry = [state]

    def run(batch):
        with _background(background):  # a sharded step builds its programs at its first call
            carry[0], m = step(carry[0], batch)
        return m["loss"]

    run.carry = carry  # the state the next step gets: [TrainState]
    run.wait = step.wait_compiled
    # the StepPrograms in use: a sharded step makes its own at its first call (the last one)
    run.program = lambda: step.programs[-1].last_program if step.programs else "general"

    program = step.jitted_fast if fast_program else step.jitted
    run.lower = lambda batch: program.lower(carry[0], batch)

    def set_site(name, gear, cfg):
        st = carry[0]
        carry[0] = st.replace(gear=nan2safe.gear.set_site(st.gear, name, gear, cfg=cfg))

    run.set_site = set_site
    return run


@contextlib.contextmanager
def _background(on: bool):
    """``NAN2SAFE_BACKGROUND_COMPILE`` set to ``on`` inside the block."""
    old = os.environ.get("NAN2SAFE_BACKGROUND_COMPILE")
    os.environ["NAN2SAFE_BACKGROUND_COMPILE"] = "1" if on else "0"
    try:
        yield
    finally:
        if old is None:
            del os.environ["NAN2SAFE_BACKGROUND_COMPILE"]
        else:
            os.environ["NAN2SAFE_BACKGROUND_COMPILE"] = old


def make_arm(name, cfg, tx, rules=None, donate=False):
    """One arm of the comparison by name (see the module docstring); ``donate``: the arm's
    step donates its state (``--donate``)."""
    if name in ("plain", "plain_scan"):
        return make_plain(cfg, tx, rules, donate, scan=name == "plain_scan")
    n2s = functools.partial(make_n2s, donate=donate)
    if name == "nan2safe":
        return n2s(cfg, tx, rules)
    if name == "general":
        return n2s(cfg, tx, rules, fast_program=False)
    if name == "noprobe":
        return n2s(cfg, tx, rules, n2s_cfg=nan2safe.Config(probes=()))
    if name in ("safe_attn", "safe_attn_general"):
        n2s_cfg = nan2safe.Config(safe_max_steps=10**6)
        partial = name == "safe_attn"
        run = n2s(cfg, tx, rules, n2s_cfg=n2s_cfg, fast_program=partial, background=partial)
        run.set_site("blocks.0.attn", nan2safe.Gear.SAFE, n2s_cfg)
        return run
    if name in ("guard", "guard_general"):
        model = PlainTransformer(cfg, rngs=nnx.Rngs(0))
        fast = name == "guard"
        return n2s(cfg, tx, rules, model=model, loss_fn=plain_loss, fast_program=fast)
    raise ValueError(f"unknown arm {name!r}")


def time_steps(run, batches, steps):
    """``(wall, cpu)`` seconds per step over ``steps`` steps."""
    t0, c0 = time.perf_counter(), time.process_time()
    loss = None
    for i in range(steps):
        loss = run(batches[i % len(batches)])
    jax.block_until_ready(loss)
    return (time.perf_counter() - t0) / steps, (time.process_time() - c0) / steps


def host_times(arms: dict, batches, calls: int) -> dict[str, list[float]]:
    """Seconds each arm's step call takes to return, the step before it finished: the host's
    share of a step (flattening the state, dispatch, building the outputs), measured apart from
    the device's. Arms interleaved, ``calls`` each.

    On a CPU backend the host and XLA's kernels share the cores, so host time during a step
    slows the step; on an accelerator it overlaps the device's work, except where the host
    waits on a result (the two-program step reads one bool per step).
    """
    out: dict[str, list[float]] = {k: [] for k in arms}
    for i in range(calls):
        for k, run in arms.items():
            jax.block_until_ready(run(batches[i % len(batches)]))
            t0 = time.perf_counter()
            loss = run(batches[(i + 1) % len(batches)])
            out[k].append(time.perf_counter() - t0)
            jax.block_until_ready(loss)
    return out


def _host_lines(record: dict) -> list[str]:
    host = record.get("host_median_s")
    if not host:
        return []
    base = host.get("plain")
    parts = [
        f"{k} {v * 1e3:.2f} ms" + (f" ({v / base:.2f}x)" if base else "") for k, v in host.items()
    ]
    return [
        f"host time per step call (median of {record['host_calls']}, the step before it done): "
        + ", ".join(parts)
    ]


def table(record: dict) -> str:
    """The record of ``main`` (or its JSON) as the printed table."""
    lines = []
    if "times_s" in record:
        lines += _timing_table(record)
        lines += _host_lines(record)
    for label, rec in record.get("compile", {}).items():
        lines += ["", f"compile time, {label}:"] + _compile_table(rec)
    for label, rec in record.get("restart", {}).items():
        lines += ["", f"restart, {label}:"] + _restart_table(rec)
    return "\n".join(lines).strip("\n")


def _model_line(record: dict) -> str:
    if "layers" in record:
        model = f"{record['layers']} layers, d_model {record['d_model']}, seq {record['seq']}"
    else:  # a JSON from before the model size was recorded: the script's defaults ran
        model = "size not recorded (the script's defaults)"
    return f"model: {model}, batch {record['batch']}"


def _timing_table(record: dict) -> list[str]:
    lines = [
        f"backend {record['backend']}  devices {record['devices']}  dtype {record['dtype']}",
        _model_line(record),
    ]
    if "rounds" in record:
        chunks = record.get("chunks", 1)  # records before --chunks: one in-order chunk
        lines.append(
            f"{record['rounds']} rounds of {record['steps_per_round']} steps"
            + (f", each arm's fastest of {chunks} shuffled chunks per round" if chunks > 1 else "")
        )
    if record.get("sharding"):
        lines.append(f"sharding: {record['sharding']}  mesh {record['mesh']}")
    cpu = record.get("cpu_median_s")
    w = max(10, *(len(k) for k in record["times_s"]))
    head = f"{'arm':<{w}} {'min ms':>9} {'median ms':>10} {'max ms':>9} {'x plain':>8}"
    head += f" {'paired x [95% CI]':>22}"
    lines.append(head + (f" {'cpu ms':>9} {'cpu x':>7}" if cpu else ""))
    base = record["median_s"]["plain"]
    plain = record["times_s"]["plain"]
    paired = {k: paired_ratio(v, plain) for k, v in record["times_s"].items()}
    for k, v in record["times_s"].items():
        med = record["median_s"][k]
        row = (
            f"{k:<{w}} {min(v) * 1e3:9.2f} {med * 1e3:10.2f} {max(v) * 1e3:9.2f} {med / base:8.3f}"
        )
        r, lo, hi = paired[k]
        row += f" {r:7.3f} [{lo:.3f}-{hi:.3f}]"
        if cpu:
            row += f" {cpu[k] * 1e3:9.2f} {cpu[k] / cpu['plain']:7.3f}"
        lines.append(row)
    if record["ratio"] is not None:
        lines.append(f"ratio nan2safe / plain (ratio of the medians): {record['ratio']:.3f}x")
        lines.append(
            "ratio nan2safe / plain (median of the rounds' ratios): "
            + ratio_text(*paired["nan2safe"], target=TARGET)
        )
        if cpu:
            lines.append(f"ratio on the CPU clock (median): {cpu['nan2safe'] / cpu['plain']:.3f}x")
            if "cpu_s" in record:
                cpu_paired = paired_ratio(record["cpu_s"]["nan2safe"], record["cpu_s"]["plain"])
                lines.append(
                    "ratio on the CPU clock (median of the rounds' ratios): "
                    + ratio_text(*cpu_paired)
                )
    ran = record.get("programs", {})
    if ran:
        lines.append("program timed: " + ", ".join(f"{k} {p}" for k, p in ran.items()))
    return lines


def _with_distinct(run: dict, key: str) -> str:
    """``"868 (210)"``: a size and, when recorded, its distinct part (``measure.program_size``)."""
    d = run.get(f"distinct_{key}")
    return f"{run[key]}" + ("" if d is None else f" ({d})")


def _compile_table(rec: dict) -> list[str]:
    reps = rec.get("repeats", 1)
    lines = [
        f"`{rec['command']}`",
        f"backend {rec['backend']}  dtype {rec['dtype']}  scan_layers {rec['scan_layers']}"
        + (f"  median of {reps} runs per arm" if reps > 1 else ""),
        _model_line(rec),
    ]
    sized = all("kernels" in r for r in rec["arms"].values())  # not in JSONs of older runs
    head = f"{'arm':<10} {'trace s':>8} {'compile s':>10} {'peak RSS GB':>12}"
    if sized:
        head += f" {'kernels (distinct)':>19} {'fused instrs (distinct)':>24} {'GB accessed':>12}"
    lines.append(head)
    for k, r in rec["arms"].items():
        if r.get("error"):
            lines.append(f"{k:<10} {r['error']}")
            continue
        line = f"{k:<10} {r['lower_s']:8.1f} {r['compile_s']:10.1f} {r['rss_gb']:12.2f}"
        if sized:
            line += (
                f" {_with_distinct(r, 'kernels'):>19} {_with_distinct(r, 'fused_instructions'):>24}"
                f" {r['bytes_accessed'] / 1e9:12.3f}"
            )
        if len(r.get("compile_s_runs", ())) > 1:
            line += "   compile runs " + " ".join(f"{t:.1f}" for t in r["compile_s_runs"])
        lines.append(line)
    lines += _phase_lines(rec["arms"])
    if rec.get("ratio") is not None:
        lines.append(
            f"compile ratio nan2safe / plain: {rec['ratio']:.2f}x (target <= {COMPILE_TARGET})"
            + (" (plain: a Python loop of layers)" if rec.get("ratio_scan") is not None else "")
        )
    if rec.get("ratio_scan") is not None:
        lines.append(
            f"compile ratio nan2safe / plain_scan (both scanned): {rec['ratio_scan']:.2f}x"
            f" (target <= {COMPILE_TARGET})"
        )
    arms = rec["arms"]
    if sized and "kernels" in arms.get("plain", {}) and "kernels" in arms.get("nan2safe", {}):
        n, p = arms["nan2safe"], arms["plain"]
        distinct = ""
        if "distinct_kernels" in n and "distinct_kernels" in p:
            distinct = (
                f", distinct kernels {n['distinct_kernels'] / p['distinct_kernels']:.2f}x, "
                "distinct fused instructions "
                f"{n['distinct_fused_instructions'] / p['distinct_fused_instructions']:.2f}x"
            )
        lines.append(
            "program size nan2safe / plain (the same on every run): "
            f"kernels {n['kernels'] / p['kernels']:.2f}x, fused instructions "
            f"{n['fused_instructions'] / p['fused_instructions']:.2f}x{distinct}, bytes accessed "
            f"{n['bytes_accessed'] / max(p['bytes_accessed'], 1):.2f}x (XLA's cost analysis: "
            "every branch of a conditional counted, the skip's too; a scanned body once)"
        )
    if rec.get("ratio_general") is not None:
        lines.append(
            f"compile ratio general / plain: {rec['ratio_general']:.2f}x (the general program: "
            "compiled in a background thread while the FAST-only one trains)"
        )
    if rec.get("split"):
        parts = []
        for step, before, after in split_steps("plain_scan" in rec["arms"]):
            d = rec["split"][step]
            kern = (
                f", {d['kernels']:+d} kernels ({d['distinct_kernels']:+d} distinct)"
                if "kernels" in d and "distinct_kernels" in d
                else ""
            )
            if step == "sites" and rec.get("scan_layers") and "plain_scan" not in rec["arms"]:
                step = "sites and the layer scan"  # records before plain_scan: guard unrolled
            parts.append(f"{step} ({after} - {before}) {d['compile_s']:+.1f} s{kern}")
        lines.append("compile added by: " + "; ".join(parts))
    return lines


def _phase_lines(arms: dict) -> list[str]:
    """``--phases``: each arm's compile by XLA's phases (medians), if the record has them."""
    have = {k: r["phases"] for k, r in arms.items() if r.get("phases")}
    if not have:
        return []
    lines = ["XLA's phases (median s): HLO passes / emitting kernels / LLVM, and LLVM modules"]
    for k, p in have.items():
        lines.append(
            f"  {k:<10} {p['hlo_passes_s']:.2f} / {p['emit_s']:.2f} / {p['llvm_s']:.2f}, "
            f"{p['llvm_modules']:.0f} modules"
        )
    return lines


def _restart_table(rec: dict) -> list[str]:
    """``--compile --restart``: each arm's compile in a fresh process with an empty persistent
    compilation cache (it writes the program there), then in a second fresh process that finds
    it there: what a run's first start and each restart wait for."""
    lines = [
        f"`{rec['command']}`",
        f"backend {rec['backend']}  dtype {rec['dtype']}  scan_layers {rec['scan_layers']}"
        f"  median of {rec['repeats']} runs per arm",
        _model_line(rec),
        f"{'arm':<10} {'trace s':>8} {'first compile s':>16} {'restart compile s':>18}"
        f" {'restart trace + compile s':>26}",
    ]
    for k, r in rec["arms"].items():
        if r.get("error"):
            lines.append(f"{k:<10} {r['error']}")
            continue
        lines.append(
            f"{k:<10} {r['lower_s']:8.1f} {r['compile_s']:16.1f} {r['restart_compile_s']:18.2f}"
            f" {r['restart_lower_s'] + r['restart_compile_s']:26.1f}"
        )
    arms = rec["arms"]
    if all("restart_compile_s" in arms.get(a, {}) for a in ("plain", "nan2safe")):
        n, p = arms["nan2safe"], arms["plain"]
        first = lambda r: r["lower_s"] + r["compile_s"]  # noqa: E731
        again = lambda r: r["restart_lower_s"] + r["restart_compile_s"]  # noqa: E731
        lines.append(
            "restart compile nan2safe / plain: "
            f"{n['restart_compile_s'] / p['restart_compile_s']:.2f}x; nan2safe's restart "
            f"compile / plain's first compile: {n['restart_compile_s'] / p['compile_s']:.2f}x"
        )
        lines.append(
            "time to the first step on a restart (trace + compile) nan2safe / plain: "
            f"{again(n) / again(p):.2f}x (both with the cache); against plain without one: "
            f"{again(n) / first(p):.2f}x"
        )
    return lines


def _model_cfg(args) -> TransformerConfig:
    return TransformerConfig(
        num_layers=args.layers,
        d_model=args.d_model,
        num_heads=args.heads,
        seq_len=args.seq,
        dtype=jnp.dtype(args.dtype),
        scan_layers=args.scan_layers,
        knobs=False,  # the plain twin has no fault-injection knobs
    )


def _compile_child(args) -> None:
    """In a fresh process: lower and compile one arm's step; prints one JSON line."""
    cfg = _model_cfg(args)
    batch = make_batch(jax.random.key(0), cfg, args.batch)
    run = make_arm(args.compile_child, cfg, optax.adamw(3e-4), donate=args.donate)
    t0 = time.perf_counter()
    lowered = run.lower(batch)
    t1 = time.perf_counter()
    compiled = lowered.compile()
    t2 = time.perf_counter()
    rec = {"lower_s": t1 - t0, "compile_s": t2 - t1, **program_size(compiled)}
    print("RESULT " + json.dumps(rec), flush=True)


def _run_child(
    argv: list[str],
    arm: str,
    cap_gb: float,
    timeout_s: float,
    cache_dir: str | None = None,
    phases: bool = False,
) -> dict:
    """Runs ``--compile-child arm`` in a subprocess; its peak RSS from ``os.wait4``; killed
    past ``cap_gb`` of RSS or ``timeout_s``. The persistent compilation cache is off, or at
    ``cache_dir`` (every program written, however fast it compiled). ``phases``: XLA logs its
    compile to a file and the record gets ``phases`` (``measure.compile_phases``)."""
    cmd = [sys.executable, str(Path(__file__).resolve()), *argv, "--compile-child", arm]
    env = dict(os.environ, JAX_ENABLE_COMPILATION_CACHE="false")
    if cache_dir is not None:
        env |= dict(
            JAX_ENABLE_COMPILATION_CACHE="true",
            JAX_COMPILATION_CACHE_DIR=cache_dir,
            JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
        )
    log = None
    if phases:
        log = tempfile.TemporaryFile()  # not a pipe: XLA's log would fill it while we read stdout
        env |= PHASE_LOG_ENV
    stderr = subprocess.DEVNULL if log is None else log
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=stderr, env=env)
    killed: list[str] = []

    def watch():
        t0 = time.monotonic()
        while proc.poll() is None:
            try:
                status = Path(f"/proc/{proc.pid}/status").read_text()
                rss_kb = int(
                    next(ln for ln in status.splitlines() if ln.startswith("VmRSS")).split()[1]
                )
            except (OSError, StopIteration, ValueError):
                rss_kb = 0
            if rss_kb > cap_gb * 2**20 or time.monotonic() - t0 > timeout_s:
                killed.append(f"killed: RSS {rss_kb / 2**20:.1f} GB, {time.monotonic() - t0:.0f} s")
                proc.kill()
                return
            time.sleep(0.2)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    out = proc.stdout.read().decode()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    watcher.join()
    rss_gb = usage.ru_maxrss / 2**20  # KiB on Linux
    split = {}
    if log is not None:
        log.seek(0)
        split = compile_phases(log.read().decode(errors="replace"))
        log.close()
    line = next((ln for ln in out.splitlines() if ln.startswith("RESULT ")), None)
    if line is None:
        return {"error": killed[0] if killed else f"exit {proc.returncode}", "rss_gb": rss_gb}
    rec = {**json.loads(line[len("RESULT ") :]), "rss_gb": rss_gb}
    return {**rec, "phases": split} if split else rec


def _compile_main(args, argv) -> dict:
    orig = list(sys.argv[1:] if argv is None else argv)
    argv = [a for a in orig if a != "--compile"]
    if "--json" in argv:
        i = argv.index("--json")
        del argv[i : i + 2]
    if args.restart:
        return _restart_main(args, argv, orig)
    names = ("plain",) + (("plain_scan",) if args.scan_layers else ()) + ("nan2safe", "general")
    names += ("guard", "noprobe") if args.ablation else ()
    runs: dict[str, list[dict]] = {a: [] for a in names}
    for _ in range(args.repeats):  # arms interleaved, so a slow spell hits all of them
        for a in names:
            runs[a].append(
                _run_child(argv, a, args.rss_cap_gb, args.child_timeout, phases=args.phases)
            )
    arms = {a: _median_run(r) for a, r in runs.items()}
    ratio = lambda a: (  # noqa: E731
        arms[a]["compile_s"] / arms["plain"]["compile_s"]
        if "compile_s" in arms[a] and "compile_s" in arms["plain"]
        else None
    )
    extra = dict(
        ratio=ratio("nan2safe"),
        ratio_general=ratio("general"),
        split=compile_split(arms, scan=args.scan_layers),
    )
    if args.scan_layers and "compile_s" in arms["plain_scan"] and "compile_s" in arms["nan2safe"]:
        extra["ratio_scan"] = arms["nan2safe"]["compile_s"] / arms["plain_scan"]["compile_s"]
    return _write_compile_record(args, orig, arms, "compile", _compile_table, **extra)


def _write_compile_record(args, orig, arms: dict, key: str, render, **extra) -> dict:
    """The record of a ``--compile`` run (``arms`` and the model), printed with ``render`` and
    merged into ``--json``'s file under ``key`` and the model's label (the timing record of
    the same file is kept)."""
    rec = {
        "arms": arms,
        **extra,
        "dtype": args.dtype,
        "scan_layers": args.scan_layers,
        "backend": jax.default_backend(),
        "batch": args.batch,
        "layers": args.layers,
        "d_model": args.d_model,
        "heads": args.heads,
        "seq": args.seq,
        "repeats": args.repeats,
        "command": _command(orig),
    }
    label = f"{args.layers}L d{args.d_model} seq{args.seq} {args.dtype}"
    label += " scan" if args.scan_layers else " unrolled"
    print("\n".join(render(rec)))
    if args.json:
        doc = json.loads(args.json.read_text()) if args.json.exists() else {}
        doc.setdefault(key, {})[label] = rec
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(doc, indent=1))
    return rec


def _restart_main(args, argv: list[str], orig: list[str]) -> dict:
    """``--compile --restart``: per arm and repeat, a fresh cache directory, one child that
    compiles into it and one that finds the program there (``_restart_table``)."""
    names = ("plain", "nan2safe", "general")
    pairs: dict[str, list[tuple[dict, dict]]] = {a: [] for a in names}
    for _ in range(args.repeats):
        for a in names:
            cache = tempfile.mkdtemp(prefix="n2s-restart-")
            try:
                first = _run_child(argv, a, args.rss_cap_gb, args.child_timeout, cache)
                again = _run_child(argv, a, args.rss_cap_gb, args.child_timeout, cache)
            finally:
                shutil.rmtree(cache, ignore_errors=True)
            pairs[a].append((first, again))
    arms = {a: restart_arm(p) for a, p in pairs.items()}
    return _write_compile_record(args, orig, arms, "restart", _restart_table)


def restart_arm(pairs: list[tuple[dict, dict]]) -> dict:
    """One arm's ``--restart`` record from its repeats' ``(first, again)`` child records.

    Args:
      pairs: per repeat, the child that compiled into the empty cache and the one after it.

    Returns:
      ``_median_run`` of the first children (``lower_s``, ``compile_s``, ...) with the medians
      (and every run) of the second ones as ``restart_lower_s`` / ``restart_compile_s``; a
      repeat where either child failed counts as failed.
    """
    firsts = []
    for first, again in pairs:
        if "compile_s" in first and "compile_s" in again:
            again = {"restart_lower_s": again["lower_s"], "restart_compile_s": again["compile_s"]}
            firsts.append({**first, **again})
        else:
            bad = first if "compile_s" not in first else again
            firsts.append({"error": bad.get("error", "failed"), "rss_gb": bad.get("rss_gb", 0.0)})
    rec = _median_run(firsts)
    ok = [r for r in firsts if "restart_compile_s" in r]
    for k in ("restart_lower_s", "restart_compile_s"):
        if ok:
            rec[k] = statistics.median(r[k] for r in ok)
            rec[f"{k}_runs"] = [r[k] for r in ok]
    return rec


# The compile ablation's steps, each arm against the one before it: what the step machinery
# adds to the plain step (the guard arm: make_train_step on the plain model), what the sites add
# without a probe, what the probes add (the nan2safe arm). Scanned, the machinery's base is
# the scanned plain step (``plain_scan``): the guard arm's plain model is scanned too.
SPLIT = (
    ("machinery", "plain", "guard"),
    ("sites", "guard", "noprobe"),
    ("probes", "noprobe", "nan2safe"),
)


def split_steps(scan: bool) -> list[tuple[str, str, str]]:
    """``SPLIT`` with the machinery's base ``plain_scan`` when ``scan``."""
    return [(st, "plain_scan" if scan and b == "plain" else b, a) for st, b, a in SPLIT]


def compile_split(arms: dict, scan: bool = False) -> dict | None:
    """``--compile --ablation``: each step of ``SPLIT`` as the seconds of compile it adds (the
    arms' medians) and the kernels it adds (raw and distinct: the same on every run); None
    without the ablation's arms (or with an arm that did not finish).

    Args:
      arms: arm name -> ``_median_run`` record.
      scan: the ``--scan-layers`` record: the machinery is ``guard - plain_scan``.

    Returns:
      ``{step: {"compile_s": ..., "kernels": ..., "distinct_kernels": ...}}`` or None.
    """
    steps = split_steps(scan)
    needed = {arm for _, before, after in steps for arm in (before, after)}
    if any("compile_s" not in arms.get(a, {}) for a in needed):
        return None
    out = {}
    for step, before, after in steps:
        a, b = arms[before], arms[after]
        out[step] = {"compile_s": b["compile_s"] - a["compile_s"]}
        for k in ("kernels", "distinct_kernels"):
            if k in a and k in b:
                out[step][k] = b[k] - a[k]
    return out


SIZE_KEYS = (
    "kernels",
    "fused_instructions",
    "distinct_kernels",
    "distinct_fused_instructions",
    "flops",
    "bytes_accessed",
)


def _median_run(runs: list[dict]) -> dict:
    """One arm's record over its repeats: the median ``lower_s`` and ``compile_s`` (each run's
    in ``*_runs``) and the largest peak RSS; the first error if no run finished."""
    ok = [r for r in runs if "compile_s" in r]
    if not ok:
        return runs[0]
    rec = {k: statistics.median(r[k] for r in ok) for k in ("lower_s", "compile_s")}
    rec |= {f"{k}_runs": [r[k] for r in ok] for k in ("lower_s", "compile_s")}
    rec["rss_gb"] = max(r["rss_gb"] for r in runs)
    rec |= {k: ok[0][k] for k in SIZE_KEYS if k in ok[0]}  # the same program every run
    split = [r["phases"] for r in ok if "phases" in r]
    if split:
        rec["phases"] = {k: statistics.median(p[k] for p in split) for k in split[0]}
    if len(ok) < len(runs):
        rec["failed_runs"] = [r["error"] for r in runs if "compile_s" not in r]
    return rec


def _command(argv) -> str:
    return " ".join(["python", "benchmarks/overhead.py", *(sys.argv[1:] if argv is None else argv)])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=10, help="steps per chunk")
    ap.add_argument(
        "--chunks", type=int, default=1, help="chunks per arm per round (the fastest is kept)"
    )
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--scan-layers", action="store_true")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--devices", type=int, default=0, help="shard over N devices (0: one)")
    ap.add_argument("--sharding", default="dp", choices=["dp", "fsdp", "zero3"])
    ap.add_argument("--batch", type=int, default=8, help="global batch size")
    ap.add_argument("--processes", type=int, default=1, help="N processes vs one")
    ap.add_argument("--ablation", action="store_true", help="add guard, noprobe, safe_attn")
    ap.add_argument("--arms", help="comma-separated arms to time instead (plain first)")
    ap.add_argument(
        "--donate", action="store_true", help="every arm's step donates its state (in place)"
    )
    ap.add_argument(
        "--host", type=int, default=0, help="also time N calls' host share per arm (host_times)"
    )
    ap.add_argument("--compile", action="store_true", help="time lower + compile per arm")
    ap.add_argument(
        "--phases",
        action="store_true",
        help="--compile: split each arm's compile by XLA's phases (CPU: its own log)",
    )
    ap.add_argument("--rss-cap-gb", type=float, default=5.0)
    ap.add_argument("--repeats", type=int, default=1, help="--compile: runs per arm (median)")
    ap.add_argument(
        "--restart",
        action="store_true",
        help="--compile: each arm's first compile, then a restart's (persistent cache)",
    )
    ap.add_argument("--child-timeout", type=float, default=600.0)
    ap.add_argument("--compile-child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.processes > 1:  # jax.distributed over loopback: benchmarks/overhead_processes.py
        from overhead_processes import run_processes

        return run_processes(args, sys.argv[1:] if argv is None else argv)
    if args.compile_child:
        return _compile_child(args)
    if args.compile:
        return _compile_main(args, argv)
    rules = _rules(args, argv)

    cfg = _model_cfg(args)
    tx = optax.adamw(3e-4)
    batches = [make_batch(jax.random.key(i), cfg, args.batch) for i in range(4)]
    if rules is not None:
        batches = [nan2safe.sharding.shard_batch(b, rules) for b in batches]
    names = ["plain", "nan2safe"]
    names += (
        ["general", "guard", "noprobe", "safe_attn", "safe_attn_general"] if args.ablation else []
    )
    if args.arms:
        names = args.arms.split(",")
        if names[0] != "plain":
            raise SystemExit("--arms: the first arm must be plain (the ratios' base)")
    arms = {k: make_arm(k, cfg, tx, rules, args.donate) for k in names}
    for run in arms.values():  # compile and warm up
        time_steps(run, batches, 3)
    for run in arms.values():  # background compiles (safe_attn's partial program) done
        if hasattr(run, "wait"):
            run.wait()
            time_steps(run, batches, 1)
    programs = {k: run.program() for k, run in arms.items() if hasattr(run, "program")}
    chunk = {k: (lambda run=run: time_steps(run, batches, args.steps)) for k, run in arms.items()}
    rounds = interleaved_rounds(chunk, args.rounds, args.chunks, key=lambda m: m[0])
    times = {k: [wall for wall, _ in v] for k, v in rounds.items()}
    cpu = {k: [c for _, c in v] for k, v in rounds.items()}

    med = {k: statistics.median(v) for k, v in times.items()}
    ratio = med["nan2safe"] / med["plain"] if "nan2safe" in med else None
    record = {
        "ratio": ratio,
        "median_s": med,
        "times_s": times,
        "cpu_median_s": {k: statistics.median(v) for k, v in cpu.items()},
        "cpu_s": cpu,
        "rounds": args.rounds,
        "steps_per_round": args.steps,
        "chunks": args.chunks,
        "donate": args.donate,
        "dtype": args.dtype,
        "backend": jax.default_backend(),
        "devices": jax.device_count(),
        "sharding": None if rules is None else args.sharding,
        "mesh": None if rules is None else dict(rules.mesh.shape),
        "batch": args.batch,
        "layers": args.layers,
        "d_model": args.d_model,
        "seq": cfg.seq_len,
        "programs": programs,
        "command": _command(argv),
    }
    if args.host:
        host = host_times(arms, batches, args.host)
        record["host_median_s"] = {k: statistics.median(v) for k, v in host.items()}
        record["host_calls"] = args.host
    print(table(record))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        old = json.loads(args.json.read_text()) if args.json.exists() else {}
        if "compile" in old:  # compile records of the same file are kept
            record["compile"] = old["compile"]
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
    if args.sharding in ("fsdp", "zero3"):
        if n % 2:
            raise SystemExit(f"--sharding {args.sharding} needs an even --devices, got {n}")
        mesh = nan2safe.sharding.make_mesh((2, n // 2), ("data", "fsdp"), devices=devices)
        data_axis = ("data", "fsdp") if args.sharding == "zero3" else "data"
        return nan2safe.sharding.fsdp(mesh, data_axis=data_axis)
    mesh = nan2safe.sharding.make_mesh((n,), ("data",), devices=devices)
    return nan2safe.sharding.data_parallel(mesh)


if __name__ == "__main__":
    main()
