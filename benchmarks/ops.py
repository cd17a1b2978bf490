"""FAST-path cost of each ``nan2safe_jax.nn`` site vs the plain ``flax.nnx`` module.

For every module: one jitted forward+backward (``value_and_grad`` w.r.t. parameters and input)
of the plain flax module, and one of the nan2safe site with its gear as a *traced* argument
(how the train step runs it: ``lax.switch`` over its distinct paths, the default probe set
``Config().probes`` written). The site is timed in each gear from the same executable, and once
more traced with no probe ("no-probe": the cost of the gear dispatch and FAST alone), and once
as the train step's FAST-only program runs it ("FAST-only": its gear ``fast_only_gear()``, no
switch; what every all-FAST step of ``make_train_step`` runs, ``nan2safe_jax.programs``). Rounds are
interleaved: in each round every variant is timed in ``--chunks`` chunks of ~10 ms, in a new
random order each chunk, and the round keeps each variant's fastest chunk
(``measure.interleaved_rounds``); the median over the rounds is reported, so slow drifts of a
shared machine hit all variants alike. For the target's pair (FAST-only
and flax) the JSON keeps every round, and the table adds the median of the rounds' paired ratios
with its 95% bootstrap interval and a verdict (``benchmarks/measure.py``).

    python benchmarks/ops.py [--json out.json] [--rounds 15] [--chunks 5] [--dtype float32]
                             [--forward]

Target: FAST / flax <= 1.05 per module (for what a FAST train step runs: the FAST-only column).
Demo sizes: batch 8, seq 128, d_model 256, 4 heads.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx

from nan2safe_jax import nn, probe
from nan2safe_jax.config import Config
from nan2safe_jax.ops import dispatch
from nan2safe_jax.site import SITE_VARIABLES, SiteTemplate, site_gears
from nan2safe_jax.train import watched_probes

sys.path.insert(0, str(Path(__file__).resolve().parent))
from measure import interleaved_rounds, paired_ratio, ratio_text  # noqa: E402

B, T, D, H, FF, V, E, K = 8, 128, 256, 4, 1024, 256, 8, 2
TARGET = 1.05  # FAST-only / flax per module (issue #15)


class _FlaxRouter(nnx.Module):
    """The plain top-k gate: Linear -> softmax -> top-k -> renormalise (f32 math as in FAST)."""

    def __init__(self, d, e, k, *, dtype, rngs):
        self.gate = nnx.Linear(d, e, use_bias=False, dtype=dtype, rngs=rngs)
        self.k = k

    def __call__(self, x):
        probs = jax.nn.softmax(self.gate(x), axis=-1)
        top_p, idx = jax.lax.top_k(probs, self.k)
        return top_p / jnp.sum(top_p, -1, keepdims=True), idx, probs


def _modules(dtype):
    """name -> (flax module, nan2safe module, input, call(module, x) -> float output)."""
    r = jax.random.key(0)
    x = jax.random.normal(r, (B, T, D), jnp.float32).astype(dtype)
    tokens = jax.random.randint(r, (B, T), 0, V)
    causal = nnx.make_causal_mask(jnp.ones((B, T)))  # [B, 1, T, T], the same mask for both
    kw = dict(dtype=dtype)

    def router_call(m, x):
        out = m(x)
        return out[0] if isinstance(out, tuple) and not hasattr(out, "gates") else out.gates

    return {
        "Linear": (
            nnx.Linear(D, FF, rngs=nnx.Rngs(0), **kw),
            nn.Linear(D, FF, rngs=nnx.Rngs(0), **kw),
            x,
            lambda m, x: m(x),
        ),
        "Embed": (
            nnx.Embed(V, D, rngs=nnx.Rngs(0), **kw),
            nn.Embed(V, D, rngs=nnx.Rngs(0), **kw),
            tokens,
            lambda m, x: m(x),
        ),
        "LayerNorm": (
            nnx.LayerNorm(D, rngs=nnx.Rngs(0), **kw),
            nn.LayerNorm(D, rngs=nnx.Rngs(0), **kw),
            x,
            lambda m, x: m(x),
        ),
        "RMSNorm": (
            nnx.RMSNorm(D, rngs=nnx.Rngs(0), **kw),
            nn.RMSNorm(D, rngs=nnx.Rngs(0), **kw),
            x,
            lambda m, x: m(x),
        ),
        "Conv": (
            nnx.Conv(D // 4, D // 4, (3, 3), rngs=nnx.Rngs(0), **kw),
            nn.Conv(D // 4, D // 4, (3, 3), rngs=nnx.Rngs(0), **kw),
            x.reshape(B, T // 4, 16, D // 4),  # [8, 32, 16, 64]: a 32x16 image of 64 channels
            lambda m, x: m(x),
        ),
        "BatchNorm": (
            nnx.BatchNorm(D, rngs=nnx.Rngs(0), **kw),
            nn.BatchNorm(D, rngs=nnx.Rngs(0), **kw),
            x,
            lambda m, x: m(x),
        ),
        "MultiHeadAttention": (
            nnx.MultiHeadAttention(H, D, rngs=nnx.Rngs(0), decode=False, **kw),
            nn.MultiHeadAttention(H, D, rngs=nnx.Rngs(0), **kw),
            x,
            lambda m, x: m(x, mask=causal),
        ),
        "Router": (
            _FlaxRouter(D, E, K, rngs=nnx.Rngs(0), **kw),
            nn.Router(D, E, K, rngs=nnx.Rngs(0), **kw),
            x,
            router_call,
        ),
    }


def _kinds(label: str) -> tuple[str, ...]:
    """The probe kinds a variant traces: the train step's default set (``Config().probes``)
    for the site, none for "noprobe" (the cost of the gear dispatch and the FAST path alone)."""
    return () if label in ("noprobe", "flax") else tuple(Config().probes)


def _step_fn(module, call, forward: bool, with_gear: bool, kinds=()):
    """A jitted (params, rest, x, gear) -> outputs; forward+backward unless ``forward``.

    A site runs as the train step runs it: its site variables (gears, probes) are not
    arguments but built inside from their ``SiteTemplate`` (zeros, then the gear written), and
    the outputs are what the step keeps: the probes of the kinds in ``kinds`` (the step's
    metrics) and the rest of the non-parameter state (knobs). Passing the gear and probe
    variables in and out (as an earlier version of this script did) timed buffers the step
    does not have: four extra arguments and outputs per norm, ~2% of its time.
    """
    graphdef, params, sites, rest = nnx.split(module, nnx.Param, SITE_VARIABLES, ...)
    template = SiteTemplate(sites)
    differentiable_x = lambda x: jnp.issubdtype(x.dtype, jnp.floating)

    def loss(params, rest, x, gear):
        m = nnx.merge(graphdef, params, template.zeros(), rest, copy=True)
        if with_gear:
            # FAST-only sets every site inside too, as the train step does (MultiHeadAttention's
            # projections are sites); a traced gear sets the module's own, as one site in a gear
            fast_only = gear.dtype == dispatch.FAST_ONLY
            for var in site_gears(m).values() if fast_only else [m.gear]:
                var.set_value(gear)
        with dispatch.hoisting(with_gear):  # as the train step traces its model
            y = call(m, x)
        kept = nnx.split(m, nnx.Param, SITE_VARIABLES, ...)[3]
        return jnp.sum(y.astype(jnp.float32)), (watched_probes(m, kinds), kept)

    if forward:
        fn = loss
    else:

        def fn(p, r, x, g):
            argnums = (0, 2) if differentiable_x(x) else 0
            return jax.value_and_grad(loss, argnums=argnums, has_aux=True)(p, r, x, g)

    return jax.jit(fn), params, rest


def _time(fn: Callable[[], object], iters: int) -> float:
    t0 = time.perf_counter()
    out = None
    for _ in range(iters):
        out = fn()
    jax.block_until_ready(out)
    return (time.perf_counter() - t0) / iters


def _chunks(result: dict) -> str:
    """How a round was taken (records before ``--chunks``: one timing per variant, in order)."""
    n = result.get("chunks")
    return f" (fastest of {n} shuffled chunks each)" if n else ""


def table(result: dict) -> str:
    """The results of ``main`` (or its JSON) as the printed table."""
    sh = result["shape"]
    lines = [
        f"nan2safe.nn sites vs flax.nnx, {result['mode']}, {result['dtype']}, B={sh['batch']} "
        f"T={sh['seq']} D={sh['d_model']} H={sh['heads']}; median of {result['rounds']} "
        f"interleaved rounds{_chunks(result)}; {result['backend']}"
    ]
    only = all("fast_only_ratio" in r for r in result["rows"])  # not in JSONs of older runs
    hdr = (
        f"{'module':<20}{'flax us':>10}{'FAST us':>10}{'FAST x':>8}{'no-probe x':>12}"
        + (f"{'FAST-only x':>13}" if only else "")
        + f"{'STABLE x':>10}{'SAFE x':>8}{'compile flax/site s':>22}"
    )
    lines += [hdr, "-" * len(hdr)]
    for r in result["rows"]:
        lines.append(
            f"{r['module']:<20}{r['flax_us']:>10.1f}{r['fast_us']:>10.1f}{r['fast_ratio']:>8.3f}"
            f"{r['fast_noprobe_ratio']:>12.3f}"
            + (f"{r['fast_only_ratio']:>13.3f}" if only else "")
            + f"{r['stable_ratio']:>10.3f}{r['safe_ratio']:>8.3f}"
            f"{r['compile_flax_s']:>12.2f} / {r['compile_site_s']:<7.2f}"
        )
    lines.append(
        f"worst FAST ratio: {result['worst_fast_ratio']:.3f} with probes, "
        f"{result['worst_fast_noprobe_ratio']:.3f} without (target <= 1.05). "
        "FAST traces the default probe set (Config().probes); no-probe: the same site with no "
        "probe traced."
    )
    if only:
        worst = max(r["fast_only_ratio"] for r in result["rows"])
        lines.append(
            f"worst FAST-only ratio: {worst:.3f} (the site as an all-FAST train step runs it: "
            "no gear switch, default probes)."
        )
    paired = [r for r in result["rows"] if "rounds_us" in r]  # not in JSONs of older runs
    if paired:
        lines.append(
            "FAST-only / flax, median of the rounds' paired ratios (95% CI; met / missed / not "
            "resolved at <= 1.05):"
        )
        for r in paired:
            rounds = r["rounds_us"]
            ratio = paired_ratio(rounds["FAST-only"], rounds["flax"])
            lines.append(f"  {r['module']:<20}{ratio_text(*ratio, target=TARGET)}")
    return "\n".join(lines)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument(
        "--iters",
        type=int,
        default=0,
        help="calls per round, split over the chunks (0: ~50 ms worth)",
    )
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument(
        "--chunks", type=int, default=5, help="chunks per variant per round (the fastest is kept)"
    )
    ap.add_argument("--forward", action="store_true", help="forward only (default: fwd+bwd)")
    ap.add_argument("--only", nargs="*", help="module names to run")
    args = ap.parse_args(argv)
    dtype = jnp.dtype(args.dtype)

    mods = _modules(dtype)
    if args.only:
        mods = {k: v for k, v in mods.items() if k in args.only}
    variants = {}  # (module, variant) -> thunk
    compile_s = {}
    for name, (plain, site, x, call) in mods.items():
        g0 = jnp.int32(0)
        for label, module, gears in (
            ("flax", plain, (None,)),
            ("site", site, (0, 1, 2)),
            ("noprobe", site, (0,)),
            ("fastonly", site, (0,)),
        ):
            kinds = _kinds(label)
            fn, p, r = _step_fn(module, call, args.forward, label != "flax", kinds)
            t0 = time.perf_counter()
            g_first = dispatch.fast_only_gear() if label == "fastonly" else g0
            with probe.probe_set(kinds):  # () for the flax twin, which reads no probe set
                jax.block_until_ready(fn(p, r, x, g_first))  # traces (and compiles) here
            compile_s[(name, label)] = time.perf_counter() - t0
            for g in gears:
                gear = jnp.int32(0 if g is None else g)
                tag = "flax" if g is None else ("FAST", "STABLE", "SAFE")[g]
                if label == "fastonly":
                    gear, tag = dispatch.fast_only_gear(), "FAST-only"
                key = (name, "FAST-noprobe" if label == "noprobe" else tag)
                variants[key] = lambda fn=fn, p=p, r=r, x=x, gear=gear: fn(p, r, x, gear)

    iters = {}
    for key, thunk in variants.items():
        thunk()
        n = args.iters or max(1, int(0.05 / max(_time(thunk, 2), 1e-6)))
        iters[key] = n

    chunk = {
        key: (lambda key=key: _time(variants[key], max(1, iters[key] // args.chunks)))
        for key in variants
    }
    samples = interleaved_rounds(chunk, args.rounds, args.chunks)
    med = {key: statistics.median(v) for key, v in samples.items()}

    rows = []
    for name in mods:
        base = med[(name, "flax")]
        row = {
            "module": name,
            "flax_us": base * 1e6,
            "compile_flax_s": compile_s[(name, "flax")],
            "compile_site_s": compile_s[(name, "site")],
        }
        for g in ("FAST", "STABLE", "SAFE", "FAST-noprobe", "FAST-only"):
            k = g.lower().replace("-", "_")
            row[f"{k}_us"] = med[(name, g)] * 1e6
            row[f"{k}_ratio"] = med[(name, g)] / base
        # every round's time of the target's pair, for the paired ratio and its interval
        row["rounds_us"] = {g: [t * 1e6 for t in samples[(name, g)]] for g in ("flax", "FAST-only")}
        rows.append(row)

    mode = "forward" if args.forward else "forward+backward"
    worst = max(r["fast_ratio"] for r in rows)
    worst_np = max(r["fast_noprobe_ratio"] for r in rows)
    result = {
        "benchmark": "ops",
        "mode": mode,
        "dtype": dtype.name,
        "shape": {"batch": B, "seq": T, "d_model": D, "heads": H, "ff": FF, "experts": E},
        "rounds": args.rounds,
        "chunks": args.chunks,
        "backend": jax.devices()[0].platform,
        "jax": jax.__version__,
        "machine": platform.machine(),
        "rows": rows,
        "worst_fast_ratio": worst,
        "worst_fast_noprobe_ratio": worst_np,
        "command": " ".join(
            ["python", "benchmarks/ops.py", *(sys.argv[1:] if argv is None else argv)]
        ),
    }
    print(table(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
