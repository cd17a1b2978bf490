"""Localization benchmark: ``nan2safe.replay.locate_step`` vs ``jax_debug_nans`` on train steps.

Two suites.

``--suite ladder`` (default; writes ``docs/locate.json``, ``--markdown`` prints the README table):
a scale ladder of ``examples/transformer.py``'s model, built from ``nan2safe.nn`` sites and
trained by ``nan2safe.make_train_step`` (the Trainer's real step; at FAST, its FAST-only
program): ``tiny``, ``demo`` (2 layers,
d_model 128, seq 64, batch 8), ``4x256`` (4 layers, d_model 256, seq 128, batch 8) and ``gpt2s``
(12 layers, d_model 768, 12 heads, seq 256, batch 2), each unrolled, with ``scan_layers`` and
with ``remat`` (``nnx.remat`` around each block); two faults, each a fault a stock flax model
has, written in the example model's own code:
``masked_row`` (f32; the model's hand-written attention, ``attention="user"``, fills masked
logits with ``-inf``; a left-padded row under a key-padding + causal mask has a fully masked
attention row: ``-inf - -inf``; the culprit is user code, in no site) and ``fp16_logits`` (fp16,
attention with dropout configured so flax's explicit path keeps the logits in fp16; the middle
layer's ``qk_gain`` knob at 1e5 overflows them: ``dot_general`` in the attention site). Per
rung, each arm in its own fresh process with its peak RSS (an arm whose RSS passes
``RSS_LIMIT_GB`` is aborted): ``plain`` (the step's first call: compile + run), ``locate``
(``locate_step`` after the step has run once, as in the Trainer: cold, then warm = a second
incident on a fresh trace), ``nans`` (``jax_debug_nans`` on, first call of the step: compile,
run, op-by-op re-run). Right = the primitive, the site and the user line are the expected ones
(``fp16_logits``: the attention site, ``Block.__call__``'s attention call; ``masked_row``: no
site, ``UserAttention``'s softmax line). ``--merge`` keeps the records of an existing JSON that
this run does not redo.

``--suite faults`` (the earlier suite): a 4-layer pre-LN transformer written in plain JAX, trained
with one full step (forward, ``jax.grad`` and an SGD update), in three forms: layers unrolled,
``lax.scan`` over stacked layers, and each layer under ``jax.checkpoint``. Three faults, each
injected in layer 2:

  * ``logits_fp16``: fp16 attention logits overflow (q and k projections scaled up): the
    ``dot_general`` makes inf, the softmax then NaN from ``inf - inf``; a ``-inf`` causal mask is
    also present.
  * ``masked_row``: a fully padded sequence -> the padding-masked softmax divides 0/0 (``div``).
  * ``sqrt_grad``: a ``jnp.where(h > 0, jnp.sqrt(h), 0)`` activation: the forward is finite, the
    gradient is NaN; the root cause is the forward ``sqrt``.

For each case, in fresh subprocesses (so no compile is shared): ``locate`` cold (trace + every
compile) and warm (same jaxpr again), and ``jax_debug_nans`` cold (first call of a fresh ``jit``
with the flag on: compile, run, de-optimized re-run) and warm, with what each names; ``retr`` is
a second incident on the same step, traced afresh (as the trainer does) and located again. Also
whether ``jax_debug_nans`` notices anything when switched on only after the step was compiled.

``--level stable`` (writes ``docs/locate_stable.json``): the same ladder with the state's level
at STABLE, as after tier 1's downshift. The general program runs the step; ``locate`` is
``locate_step`` on the ``make_train_step`` step, which replays the step traced with the state's
gears as constants (``programs.replay_programs``), as the Trainer does; ``general`` replays the
general program itself (what tier 2 did before).

Usage: ``python benchmarks/locate.py [--rungs demo,4x256] [--layouts unrolled,scan,remat]
[--faults masked_row,fp16_logits] [--level fast|stable] [--json PATH] [--merge]``,
``--suite faults [--quick]``, ``--markdown``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
import traceback

HERE = os.path.abspath(__file__)
EXPECTED = {"logits_fp16": "dot_general", "masked_row": "div", "sqrt_grad": "sqrt"}


def _marker_lines() -> dict[str, int]:
    out = {}
    with open(HERE) as f:
        for i, line in enumerate(f, 1):
            m = re.search(r"# FAULT:(\w+)\s*$", line)
            if m:
                out[m.group(1)] = i
    return out


# ------------------------------------------------------------------------------------------------
# the model (imported lazily so the parent process stays light)


def build(variant: str, fault: str):
    import jax
    import jax.numpy as jnp
    from jax import lax

    L, B, T, D, H, F, V = 4, 2, 16, 64, 4, 128, 97
    dtype = jnp.float16 if fault == "logits_fp16" else jnp.float32
    key = jax.random.key(0)
    ks = jax.random.split(key, 8)

    def init(k, shape, scale):
        return (jax.random.normal(k, shape, jnp.float32) * scale).astype(dtype)

    layers = {
        "wq": init(ks[0], (L, D, D), D**-0.5),
        "wk": init(ks[1], (L, D, D), D**-0.5),
        "wv": init(ks[2], (L, D, D), D**-0.5),
        "wo": init(ks[3], (L, D, D), D**-0.5),
        "w1": init(ks[4], (L, D, F), D**-0.5),
        "w2": init(ks[5], (L, F, D), F**-0.5),
        "g1": jnp.ones((L, D), dtype),
        "g2": jnp.ones((L, D), dtype),
    }
    if fault == "logits_fp16":
        layers["wq"] = layers["wq"].at[2].multiply(300.0)
        layers["wk"] = layers["wk"].at[2].multiply(300.0)
    params = {
        "embed": init(ks[6], (V, D), 1.0),
        "head": init(ks[7], (D, V), D**-0.5),
        "layers": layers,
    }
    tokens = jax.random.randint(jax.random.key(1), (B, T), 0, V)
    pad = jnp.ones((B, T), bool)
    if fault == "masked_row":
        pad = pad.at[1].set(False)  # sequence 1 is all padding
    use_sqrt = jnp.asarray([0.0, 0.0, 1.0, 0.0] if fault == "sqrt_grad" else [0.0] * 4)
    batch = {"tokens": tokens, "pad": pad, "sqrt": use_sqrt}

    def norm(x, g):
        mu = x.mean(-1, keepdims=True)
        var = ((x - mu) ** 2).mean(-1, keepdims=True)
        return (x - mu) * lax.rsqrt(var + 1e-5) * g

    def attention(x, p, pad):
        q = (x @ p["wq"]).reshape(B, T, H, D // H)
        k = (x @ p["wk"]).reshape(B, T, H, D // H)
        v = (x @ p["wv"]).reshape(B, T, H, D // H)
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k)  # FAULT:logits_fp16
        causal = jnp.tril(jnp.ones((T, T), bool))
        s = jnp.where(causal, s, -jnp.inf)
        e = jnp.exp(s - s.max(-1, keepdims=True)) * pad[:, None, None, :]
        a = e / e.sum(-1, keepdims=True)  # FAULT:masked_row
        return jnp.einsum("bhqk,bkhd->bqhd", a, v).reshape(B, T, D) @ p["wo"]

    def layer(x, p, pad, use_sqrt):
        x = x + attention(norm(x, p["g1"]), p, pad)
        h = norm(x, p["g2"]) @ p["w1"]
        # double-where guarded sqrt, except in the faulty layer (use_sqrt) where it is unguarded
        safe = jnp.where((h > 0) | (use_sqrt > 0), h, 1.0)
        act = jnp.where(h > 0, jnp.sqrt(safe), 0.0)  # FAULT:sqrt_grad
        h = jnp.where(use_sqrt > 0, act, jax.nn.gelu(h))
        return x + h @ p["w2"]

    def forward(params, batch):
        x = params["embed"][batch["tokens"]]
        ly = params["layers"]
        if variant == "scan":

            def body(x, pl):
                p, s = pl
                return layer(x, p, batch["pad"], s), None

            x, _ = lax.scan(body, x, (ly, batch["sqrt"]))
        else:
            f = jax.checkpoint(layer) if variant == "remat" else layer
            for i in range(L):
                x = f(x, jax.tree.map(lambda a, i=i: a[i], ly), batch["pad"], batch["sqrt"][i])
        logits = (x @ params["head"]).astype(jnp.float32)
        logp = jax.nn.log_softmax(logits)
        return -jnp.take_along_axis(logp, batch["tokens"][..., None], -1).mean()

    def step(params, batch):
        loss, grads = jax.value_and_grad(forward)(params, batch)
        new = jax.tree.map(lambda p, g: (p - 0.01 * g).astype(p.dtype), params, grads)
        return new, loss

    return step, (params, batch)


# ------------------------------------------------------------------------------------------------
# one measurement, in a child process


def _short(path: str | None) -> str:
    if not path:
        return "-"
    f, _, line = path.rpartition(":")
    return f"{os.path.basename(f)}:{line}"


def child_locate(variant: str, fault: str) -> dict:
    import jax

    from nan2safe_jax import replay

    step, args = build(variant, fault)
    t0 = time.perf_counter()
    jaxpr = jax.make_jaxpr(jax.jit(step))(*args)
    r = replay.locate(jaxpr, args)
    cold = time.perf_counter() - t0
    t1 = time.perf_counter()
    replay.locate(jaxpr, args)
    warm = time.perf_counter() - t1
    t2 = time.perf_counter()  # a second incident: the trainer traces the step afresh
    r2 = replay.locate(jax.make_jaxpr(jax.jit(step))(*args), args)
    retrace = time.perf_counter() - t2
    assert r2.primitive == r.primitive and r2.source == r.source
    n = _count(jaxpr.jaxpr)
    return {
        "cold_s": cold,
        "warm_s": warm,
        "retrace_s": retrace,
        "eqns": n,
        "primitive": r.primitive if r else None,
        "source": _short(r.source) if r else None,
        "direction": r.direction if r else None,
        "kind": r.kind if r else None,
        "diagnosis": r.diagnosis if r else None,
        "eqn_path": list(map(str, r.eqn_path)) if r else None,
        "replays": r.replays if r else None,
        "first_nan": r.first_nan.primitive if r and r.first_nan else None,
    }


def _count(jaxpr) -> int:
    from nan2safe_jax.replay import _jax_compat as jc

    n = 0
    for e in jaxpr.eqns:
        body = jc.call_body(e)
        if body is not None:
            n += _count(body[0])
        elif e.primitive.name == "scan":
            n += 1 + _count(jc.scan_params(e)["jaxpr"])
        elif e.primitive.name == "while":
            n += 1 + _count(jc.while_params(e)["body_jaxpr"])
        elif e.primitive.name == "cond":
            n += 1 + sum(_count(b[0]) for b in jc.cond_branches(e))
        else:
            n += 1
    return n


def _parse_fpe(e: BaseException, file: str | None = None) -> tuple[str | None, str | None]:
    msg = str(e)
    m = re.search(r"encountered in (\S+?)[\s.,:]", msg + " ")
    prim = m.group(1) if m else None
    frames = [
        f
        for f in traceback.extract_tb(e.__traceback__)
        if (f.filename == HERE if file is None else f.filename.endswith(file))
    ]
    src = f"{os.path.basename(frames[-1].filename)}:{frames[-1].lineno}" if frames else None
    return prim, src


def child_nans(variant: str, fault: str) -> dict:
    import jax

    step, args = build(variant, fault)
    out: dict = {}
    jax.config.update("jax_debug_nans", True)
    for phase in ("cold", "warm"):
        f = jax.jit(step) if phase == "cold" else f  # noqa: F821 - warm reuses the cold jit
        t0 = time.perf_counter()
        try:
            jax.block_until_ready(f(*args))
            prim, src = None, None
        except FloatingPointError as e:
            prim, src = _parse_fpe(e)
        out[f"{phase}_s"] = time.perf_counter() - t0
        if phase == "cold":
            out.update(primitive=prim, source=src)
    # switched on only after the step was compiled and run once
    jax.config.update("jax_debug_nans", False)
    g = jax.jit(step)
    jax.block_until_ready(g(*args))
    jax.config.update("jax_debug_nans", True)
    try:
        jax.block_until_ready(g(*args))
        out["late_switch"] = "silent"
    except FloatingPointError as e:
        out["late_switch"] = _parse_fpe(e)[0] or "raised"
    return out


# ------------------------------------------------------------------------------------------------
# the scale ladder: examples/transformer.py's model (nan2safe.nn sites) in the Trainer's real step

RUNGS = {
    "tiny": dict(num_layers=1, d_model=32, num_heads=2, seq_len=16, batch=2),
    "demo": dict(num_layers=2, d_model=128, num_heads=4, seq_len=64, batch=8),
    "4x256": dict(num_layers=4, d_model=256, num_heads=4, seq_len=128, batch=8),
    "gpt2s": dict(num_layers=12, d_model=768, num_heads=12, seq_len=256, batch=2),
}
LAYOUTS = ("unrolled", "scan", "remat")
LADDER_FAULTS = {
    # a left-padded batch under a key-padding + causal mask: a fully masked row in the model's
    # hand-written attention (-inf fill): -inf - -inf, in user code (no site)
    "masked_row": ("sub", "div"),
    # fp16 attention logits of one layer scaled past 65504 (flax's explicit attention path)
    "fp16_logits": ("dot_general",),
    # (``--level stable`` only, not a default) a zero residual stream (``embed_scale`` 0) into a
    # LayerNorm with epsilon 0: 0 * rsqrt(0) in the first layer's norm site, which STABLE does
    # not floor (SAFE does): a fault tier 1's downshift does not prevent
    "zero_norm": ("rsqrt", "mul", "div"),
}
LADDER_DEFAULT = ("masked_row", "fp16_logits")
# fault -> (marker of the expected user line in examples/transformer.py, site expected)
LADDER_WHERE = {
    "masked_row": ("weights = jax.nn.softmax(logits", None),
    "fp16_logits": ("self.attn(qk, qk, h", "attn"),
    "zero_norm": ("h = self.ln1(x)", "ln1"),
}
# fp16_logits: the q·k gain of the middle layer (logits of O(1) -> past 65504). At STABLE the
# attention site keeps that in range (the fault tier 1's downshift prevents): the step is finite.
QK_GAIN = 1e5
RSS_LIMIT_GB = 8.0


def _rss_guard(limit_gb: float) -> None:
    """Ends this process (exit 3) as soon as its resident memory passes ``limit_gb``."""
    import threading

    def watch():
        while True:
            with open("/proc/self/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        if int(line.split()[1]) > limit_gb * 1024**2:
                            print(json.dumps({"error": f"RSS above {limit_gb} GB: aborted"}))
                            sys.stdout.flush()
                            os._exit(3)
            time.sleep(0.1)

    threading.Thread(target=watch, daemon=True).start()


def build_ladder(rung: str, layout: str, fault: str, level: str = "fast"):
    """``(program, replayed, (state, batch))``: the Trainer's jitted step program that runs a
    faulty batch, what tier 2 replays for it, and the arguments.

    ``level``: ``fast`` (every gear FAST: the FAST-only program runs and is replayed) or
    ``stable`` (the level at STABLE, as after tier 1's downshift: the general program runs; the
    replay is the ``make_train_step`` step itself, which ``locate_step`` replays in the program
    traced with the gears as constants, as the Trainer does)."""
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))
    import nan2safe_jax as nan2safe
    from examples.transformer import Transformer, TransformerConfig, lm_loss, set_knob

    r = RUNGS[rung]
    fp16 = fault == "fp16_logits"
    cfg = TransformerConfig(
        num_layers=r["num_layers"],
        d_model=r["d_model"],
        num_heads=r["num_heads"],
        seq_len=r["seq_len"],
        vocab=128,
        dtype=jnp.float16 if fp16 else jnp.float32,
        param_dtype=jnp.float32,
        pad_mask="keys",
        scan_layers=layout == "scan",
        remat=layout == "remat",
        layers="nan2safe",
        attention="mha" if fp16 else "user",
        attn_dropout=0.1 if fp16 else 0.0,
        epsilon=0.0 if fault == "zero_norm" else 1e-6,
    )
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    if fp16:
        set_knob(model, "qk_gain", QK_GAIN, layer=cfg.num_layers // 2)
    if fault == "zero_norm":
        set_knob(model, "embed_scale", 0.0)
    b, t = r["batch"], r["seq_len"]
    tokens = jax.random.randint(jax.random.key(1), (b, t), 1, cfg.vocab, dtype=jnp.int32)
    mask = jnp.ones((b, t), bool)
    if fault == "masked_row":
        mask = mask.at[1, : t // 2].set(False)  # row 1 left-padded: its first queries see no key
    batch = {"tokens": jnp.where(mask, tokens, 0), "mask": mask}
    state = nan2safe.TrainState.create(model, optax.sgd(1e-3), nan2safe.Config())
    step = nan2safe.make_train_step(lm_loss)
    if level == "stable":
        gear = nan2safe.gear.set_level(state.gear, nan2safe.Gear.STABLE)
        return step.jitted, step, (state.replace(gear=gear), batch)
    # Every gear is FAST: the program that runs the step, and that the Trainer replays, is the
    # FAST-only one (nan2safe_jax.programs).
    return step.jitted_fast, step.jitted_fast, (state, batch)


def _user_line(marker: str) -> str:
    """``transformer.py:LINE`` of the line of examples/transformer.py holding ``marker``."""
    path = os.path.join(os.path.dirname(os.path.dirname(HERE)), "examples", "transformer.py")
    with open(path) as f:
        for i, line in enumerate(f, 1):
            if marker in line:
                return f"transformer.py:{i}"
    return "?"


def _maxrss_gb() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2


def child_ladder(arm: str, rung: str, layout: str, fault: str, level: str = "fast") -> dict:
    """One arm: ``plain``, ``locate``, ``nans``, or (at ``level`` stable) ``general``: the
    general program replayed, what tier 2 did before it replayed the known-gear program."""
    import jax

    _rss_guard(RSS_LIMIT_GB)
    step, replayed, args = build_ladder(rung, layout, fault, level)
    if arm == "general":
        replayed = step
    out: dict = {}
    if arm == "nans":
        jax.config.update("jax_debug_nans", True)
        t0 = time.perf_counter()
        try:
            jax.block_until_ready(step(*args))
            prim, src = None, None
        except FloatingPointError as e:
            prim, src = _parse_fpe(e, "transformer.py")
        except Exception as e:  # noqa: BLE001 - jax's own InternalFloatingPointError (remat)
            if "FloatingPointError" not in type(e).__name__:
                raise
            prim, src = None, None
            out["raised"] = f"{type(e).__name__}: {str(e)[:200]}"
        out.update(cold_s=time.perf_counter() - t0, primitive=prim, source=src)
        out["rss_gb"] = _maxrss_gb()
        return out
    t0 = time.perf_counter()
    jax.block_until_ready(step(*args))  # the production step (compiled and run, as in training)
    out["step_s"] = time.perf_counter() - t0
    out["step_rss_gb"] = _maxrss_gb()
    if arm == "plain":
        return out

    from nan2safe_jax import replay

    t0 = time.perf_counter()
    r = replay.locate_step(replayed, *args)
    out["cold_s"] = time.perf_counter() - t0
    out["rss_gb"] = _maxrss_gb()
    t0 = time.perf_counter()
    r2 = replay.locate_step(replayed, *args)  # a second incident: traced again, same shapes
    out["warm_s"] = time.perf_counter() - t0
    out.update(
        primitive=r.primitive,
        source=_short(r.source),
        user_source=_short(r.user_source),
        site=r.site,
        kind=r.kind,
        direction=r.direction,
        diagnosis=r.diagnosis,
        replays=r.replays,
        reproducible=r.reproducible,
        reason=r.reason,
        warm_same=(r2.primitive, r2.source) == (r.primitive, r.source),
        eqn_path=[str(p) for p in r.eqn_path],
    )
    return out


def _run_ladder_child(arm: str, rung: str, layout: str, fault: str, level: str = "fast") -> dict:
    cmd = [sys.executable, HERE, "--child", arm, rung, layout, fault, level]
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(HERE)))
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    except subprocess.TimeoutExpired:
        return {"error": "timeout (900 s)"}
    for line in p.stdout.splitlines()[::-1]:
        if line.startswith("{"):
            return json.loads(line)
    return {"error": (p.stderr or p.stdout)[-800:]}


def ladder(
    rungs: list[str], layouts: list[str], faults: list[str], level: str = "fast"
) -> list[dict]:
    """Every rung x layout x fault, each arm in its own fresh process."""
    records = []
    arms = (
        ("plain", "locate", "nans") if level == "fast" else ("plain", "locate", "general", "nans")
    )
    for rung in rungs:
        for layout in layouts:
            for fault in faults:
                rec = {"rung": rung, **RUNGS[rung], "layout": layout, "fault": fault}
                for arm in arms:
                    rec[arm] = _run_ladder_child(arm, rung, layout, fault, level)
                    print(f"done {rung}/{layout}/{fault}/{arm}", file=sys.stderr, flush=True)
                lo, na, pl = rec["locate"], rec["nans"], rec["plain"]
                marker, want_site = LADDER_WHERE[fault]
                want_line = _user_line(marker)
                rec["expected"] = (
                    f"{'|'.join(LADDER_FAULTS[fault])} called from {want_line}, "
                    f"site {'*' + want_site if want_site else None}"
                )
                site = lo.get("site")
                rec["locate_correct"] = (
                    lo.get("primitive") in LADDER_FAULTS[fault]
                    and lo.get("user_source") == want_line
                    and (site is None if want_site is None else (site or "").endswith(want_site))
                )
                rec["nans_correct"] = na.get("primitive") in LADDER_FAULTS[fault]
                if "rss_gb" in lo and "step_rss_gb" in pl:
                    rec["rss_ratio"] = lo["rss_gb"] / pl["step_rss_gb"]
                if "cold_s" in lo and "cold_s" in na:
                    rec["time_ratio"] = lo["cold_s"] / na["cold_s"]
                ge = rec.get("general")
                if ge is not None:
                    rec["general_correct"] = (ge.get("primitive"), ge.get("user_source")) == (
                        lo.get("primitive"),
                        lo.get("user_source"),
                    )
                records.append(rec)
    return records


def print_ladder(records: list[dict]) -> None:
    hdr = (
        f"{'rung':6} {'layout':8} {'fault':11} | {'step':>5} {'RSS':>5} | {'locate':>6} "
        f"{'warm':>5} {'RSS':>5} {'xRSS':>4} {'rpl':>3} {'names':44} ok | {'dbg_nans':>8} "
        f"{'RSS':>5} {'names':12} ok"
    )
    print(hdr)
    print("-" * len(hdr))
    for r in records:
        lo, na, pl = r["locate"], r["nans"], r["plain"]
        err = lo.get("error") or na.get("error") or pl.get("error")
        if err:
            print(f"{r['rung']:6} {r['layout']:8} {r['fault']:11} | ERROR {err[-200:]!r}")
            continue
        names = f"{lo['primitive']}@{lo['user_source']}"
        if not lo.get("reproducible", True):
            names = "not reproducible"
        print(
            f"{r['rung']:6} {r['layout']:8} {r['fault']:11} | {pl['step_s']:>4.1f}s "
            f"{pl['step_rss_gb']:>4.2f}G | {lo['cold_s']:>5.1f}s {lo['warm_s']:>4.2f}s "
            f"{lo['rss_gb']:>4.2f}G {r['rss_ratio']:>4.2f} {lo['replays']:>3} {names:44} "
            f"{'Y' if r['locate_correct'] else 'N'}  | {na['cold_s']:>7.1f}s {na['rss_gb']:>4.2f}G "
            f"{str(na['primitive']):12} {'Y' if r['nans_correct'] else 'N'}"
        )
    print(
        "step: the production step's first call (compile + run); locate: replay.locate_step after "
        "it (cold: every replay compiled), warm: a second incident; dbg_nans: jax_debug_nans on, "
        "first call of the step (compile + run + op-by-op re-run); RSS: peak of each fresh "
        "process; xRSS: locate peak / plain step peak"
    )


def _model_label(r: dict) -> str:
    """A ladder record's model, as the README tables name it."""
    return f"{r['num_layers']}L d{r['d_model']} T{r['seq_len']} B{r['batch']}"


def markdown_stable(records: list[dict]) -> str:
    """The README table of the ``--level stable`` ladder (``docs/locate_stable.json``)."""
    rows = [
        "| model | layout | fault | plain step (general program) | locate cold | warm | "
        "locate peak RSS | × step | names (user line) | general program replayed: cold | "
        "its RSS | same culprit | `jax_debug_nans` cold |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in records:
        lo, ge, na, pl = r["locate"], r["general"], r["nans"], r["plain"]
        err = lo.get("error") or ge.get("error") or na.get("error") or pl.get("error")
        if err:
            rows.append(f"| {r['rung']} | {r['layout']} | {r['fault']} | error: {err[-80:]} |")
            continue
        model = _model_label(r)
        names = f"`{lo['primitive']}` ({lo['user_source']}) {'✔' if r['locate_correct'] else '✘'}"
        if not lo.get("reproducible", True):
            names = "not reproducible ✘"
        rows.append(
            f"| {model} | {r['layout']} | {r['fault']} | {pl['step_s']:.1f} s | "
            f"{lo['cold_s']:.1f} s | {lo['warm_s']:.2f} s | {lo['rss_gb']:.2f} GB | "
            f"{r['rss_ratio']:.2f} | {names} | {ge['cold_s']:.1f} s | {ge['rss_gb']:.2f} GB | "
            f"{'✔' if r.get('general_correct') else '✘'} | {na['cold_s']:.1f} s |"
        )
    return "\n".join(rows)


def markdown_ladder(records: list[dict]) -> str:
    """The README table, from ``docs/locate.json``'s ladder records."""
    rows = [
        "| model | layout | fault | plain step (compile + run) | step peak RSS | locate cold | "
        "warm | locate peak RSS | × step | replays | names (user line) | `jax_debug_nans` cold "
        "| its RSS | it names |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in records:
        lo, na, pl = r["locate"], r["nans"], r["plain"]
        if lo.get("error") or na.get("error") or pl.get("error"):
            err = (lo.get("error") or na.get("error") or pl.get("error"))[-80:]
            rows.append(f"| {r['rung']} | {r['layout']} | {r['fault']} | error: {err} |")
            continue
        ok = "✔" if r["locate_correct"] else "✘"
        nok = "✔" if r["nans_correct"] else "✘"
        model = _model_label(r)
        rows.append(
            f"| {model} | {r['layout']} | {r['fault']} | {pl['step_s']:.1f} s | "
            f"{pl['step_rss_gb']:.2f} GB | {lo['cold_s']:.1f} s | {lo['warm_s']:.2f} s | "
            f"{lo['rss_gb']:.2f} GB | {r['rss_ratio']:.2f} | {lo['replays']} | "
            f"`{lo['primitive']}` ({lo['user_source']}) {ok} | {na['cold_s']:.1f} s | "
            f"{na['rss_gb']:.2f} GB | `{na['primitive']}` {nok} |"
        )
    return "\n".join(rows)


# ------------------------------------------------------------------------------------------------
# driver


def _run_child(kind: str, variant: str, fault: str) -> dict:
    cmd = [sys.executable, HERE, "--child", kind, variant, fault]
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(HERE)))
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1200)
    for line in p.stdout.splitlines()[::-1]:
        if line.startswith("{"):
            return json.loads(line)
    return {"error": (p.stderr or p.stdout)[-800:]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the records to this path (default: docs/locate.json)")
    ap.add_argument("--suite", choices=("ladder", "faults"), default="ladder")
    ap.add_argument("--rungs", default="demo,4x256", help=f"ladder rungs of {list(RUNGS)}")
    ap.add_argument("--layouts", default=",".join(LAYOUTS))
    ap.add_argument("--faults", default=",".join(LADDER_DEFAULT), help=f"of {list(LADDER_FAULTS)}")
    ap.add_argument("--quick", action="store_true", help="faults suite: unrolled variant only")
    ap.add_argument(
        "--level",
        choices=("fast", "stable"),
        default="fast",
        help="ladder: the state's level (stable: after tier 1's downshift; default JSON "
        "docs/locate_stable.json)",
    )
    ap.add_argument(
        "--merge",
        action="store_true",
        help="ladder: keep the records of the existing --json file that this run does not redo",
    )
    ap.add_argument(
        "--markdown", action="store_true", help="print the README table of an existing JSON"
    )
    ap.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    a = ap.parse_args()
    default = "locate.json" if a.level == "fast" else "locate_stable.json"
    if a.markdown:
        path = a.json or os.path.join(os.path.dirname(os.path.dirname(HERE)), "docs", default)
        render = markdown_ladder if a.level == "fast" else markdown_stable
        with open(path) as f:
            print(render(json.load(f)["ladder"]))
        return
    if a.child:
        if len(a.child) in (4, 5):
            print(json.dumps(child_ladder(*a.child)))
            return
        kind, variant, fault = a.child
        fn = child_locate if kind == "locate" else child_nans
        print(json.dumps(fn(variant, fault)))
        return
    if a.suite == "ladder":
        records = ladder(a.rungs.split(","), a.layouts.split(","), a.faults.split(","), a.level)
        path = a.json or os.path.join(os.path.dirname(os.path.dirname(HERE)), "docs", default)
        cmd = "python benchmarks/locate.py " + " ".join(sys.argv[1:])
        commands = [cmd]
        if a.merge and os.path.exists(path):
            with open(path) as f:
                old = json.load(f)
            redone = {(r["rung"], r["layout"], r["fault"]) for r in records}
            kept = [r for r in old["ladder"] if (r["rung"], r["layout"], r["fault"]) not in redone]
            records = kept + records
            commands = old.get("commands", []) + commands
        order = {k: i for i, k in enumerate(RUNGS)}
        records.sort(key=lambda r: (order.get(r["rung"], 99), r["layout"], r["fault"]))
        if a.level == "fast":
            print_ladder(records)
        else:
            print(markdown_stable(records))
        with open(path, "w") as f:
            doc = {"commands": commands, "ladder": records, "rss_limit_gb": RSS_LIMIT_GB}
            json.dump(doc, f, indent=1)
        return

    lines = _marker_lines()
    variants = ["unrolled"] if a.quick else ["unrolled", "scan", "remat"]
    records = []
    for variant in variants:
        for fault in EXPECTED:
            loc = _run_child("locate", variant, fault)
            nans = _run_child("nans", variant, fault)
            want = f"{EXPECTED[fault]}@{os.path.basename(HERE)}:{lines[fault]}"
            rec = {
                "variant": variant,
                "fault": fault,
                "expected": want,
                "locate": loc,
                "nans": nans,
            }
            rec["locate_correct"] = f"{loc.get('primitive')}@{loc.get('source')}" == want
            rec["nans_correct"] = f"{nans.get('primitive')}@{nans.get('source')}" == want
            records.append(rec)
            print(f"done {variant}/{fault}", file=sys.stderr, flush=True)

    hdr = (
        f"{'variant':9} {'fault':12} {'eqns':>5} | {'locate cold':>11} {'warm':>6} {'retr':>5} "
        f"{'rpl':>3} "
        f"{'names':34} ok | {'debug_nans cold':>15} {'warm':>6} {'names':28} ok | late switch"
    )
    print(hdr)
    print("-" * len(hdr))
    for r in records:
        lo, na = r["locate"], r["nans"]
        if "error" in lo or "error" in na:
            print(f"{r['variant']:9} {r['fault']:12} ERROR {lo.get('error') or na.get('error')}")
            continue
        ln = f"{lo['primitive']}@{lo['source']} ({(lo['direction'] or '-')[:3]})"
        nn = f"{na['primitive']}@{na['source']}"
        print(
            f"{r['variant']:9} {r['fault']:12} {lo['eqns']:>5} | {lo['cold_s']:>10.2f}s "
            f"{lo['warm_s']:>5.2f}s {lo.get('retrace_s', float('nan')):>4.2f}s "
            f"{lo['replays']:>3} {ln:34} "
            f"{'Y' if r['locate_correct'] else 'N'}"
            f"  | {na['cold_s']:>14.2f}s {na['warm_s']:>5.2f}s {nn:28} "
            f"{'Y' if r['nans_correct'] else 'N'}  | {na['late_switch']}"
        )
    print(f"expected: {', '.join(f'{k}: {v}' for k, v in EXPECTED.items())} at the FAULT lines")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(records, f, indent=1)


if __name__ == "__main__":
    main()
