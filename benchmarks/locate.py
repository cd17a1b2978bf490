"""Localization benchmark: ``nan2safe.replay.locate`` vs ``jax_debug_nans`` on a train step.

A 4-layer pre-LN transformer written in plain JAX, trained with one full step (forward, ``jax.grad``
and an SGD update), in three forms: layers unrolled, ``lax.scan`` over stacked layers, and each
layer under ``jax.checkpoint``. Three faults, each injected in layer 2:

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

Usage: ``python benchmarks/locate.py [--json PATH] [--quick]``
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


def _parse_fpe(e: BaseException) -> tuple[str | None, str | None]:
    msg = str(e)
    m = re.search(r"encountered in (\S+?)[\s.,:]", msg + " ")
    prim = m.group(1) if m else None
    frames = [f for f in traceback.extract_tb(e.__traceback__) if f.filename == HERE]
    src = f"{os.path.basename(HERE)}:{frames[-1].lineno}" if frames else None
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
    ap.add_argument("--json", help="write the records to this path")
    ap.add_argument("--quick", action="store_true", help="unrolled variant only")
    ap.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        kind, variant, fault = a.child
        fn = child_locate if kind == "locate" else child_nans
        print(json.dumps(fn(variant, fault)))
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
        ln = f"{lo['primitive']}@{lo['source']} ({lo['direction'][:3]})"
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
