"""Safe-kernel benchmark: accuracy (ulps vs the exact sum) and speed vs the plain jnp ops.

    .venv/bin/python benchmarks/kernels.py [--json PATH] [--size N] [--repeats R]

Accuracy: adversarial sums of 1M values, error in f32 ulps of the exact result
(``math.fsum``): naive f32 (XLA's ``jnp.sum`` and a sequential NumPy ``cumsum``), the
compensated ``safe_sum`` (jnp reference and Pallas kernel, interpret mode on CPU), and a
float64 sum rounded to f32.

Speed: ``safe_*`` with ``implementation=None`` (the jnp reference on CPU, compiled Pallas on
GPU/TPU) and, on an accelerator, also the reference, against ``jnp.sum`` /
``jax.nn.softmax`` / a plain layer norm / RMS norm. On CPU the Pallas kernels only run in
interpret mode, which is a correctness tool and not a speed measure, so they are not timed.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from nan2safe_jax import kernels


def f32_ulps(value: float, exact: float) -> float:
    if not math.isfinite(value):
        return math.inf
    return abs(value - exact) / float(np.spacing(np.float32(abs(exact))))


def datasets(n: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    k = n // 4
    cancel = np.concatenate([np.full(k, 1e8), np.full(k, -1e8), rng.uniform(0, 1, n - 2 * k)])
    return {
        "cancel ±1e8 + U(0,1) f32": cancel.astype(np.float32)[rng.permutation(n)],
        "normal(0,1) f32": rng.normal(size=n).astype(np.float32),
        "U(6e4,65504) f16": rng.uniform(60000, 65504, size=n).astype(np.float16),
        "1 + tiny (1e-8) f32": np.concatenate([[1.0], np.full(n - 1, 1e-8)]).astype(np.float32),
    }


def accuracy(n: int) -> list[dict]:
    rows = []
    for name, x in datasets(n).items():
        exact = math.fsum(x.astype(np.float64))
        xj = jnp.asarray(x)
        with np.errstate(over="ignore"):
            seq = float(np.cumsum(x, dtype=x.dtype)[-1])
        layout = xj.reshape(8, -1) if n % 8 == 0 else xj
        row = {
            "data": name,
            "n": n,
            "exact": exact,
            "naive_jnp_sum": f32_ulps(float(jnp.sum(xj)), exact),
            "naive_sequential": f32_ulps(seq, exact),
            "compensated_ref": f32_ulps(
                float(kernels.safe_sum(layout, implementation="reference")), exact
            ),
            "compensated_pallas": f32_ulps(
                float(kernels.safe_sum(layout, implementation="pallas")), exact
            ),
            "f64_then_f32": f32_ulps(float(np.float32(np.sum(x.astype(np.float64)))), exact),
        }
        rows.append(row)
    return rows


def _time(fn, *args, repeats: int) -> float:
    jax.block_until_ready(fn(*args))  # compile + warm up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def _plain_ln(x, s, b):
    m = x.mean(-1, keepdims=True)
    v = ((x - m) ** 2).mean(-1, keepdims=True)
    return (x - m) * jax.lax.rsqrt(v + 1e-6) * s + b


def _plain_rms(x, s):
    return x * jax.lax.rsqrt((x * x).mean(-1, keepdims=True) + 1e-6) * s


def speed(repeats: int, scale: int) -> list[dict]:
    accel = jax.default_backend() != "cpu"
    rng = np.random.default_rng(1)
    vec = jnp.asarray(rng.normal(size=(1 << 20) * scale), jnp.float32)
    mat = jnp.asarray(rng.normal(size=(4096 * scale, 1024)), jnp.float32)
    mat16 = mat.astype(jnp.bfloat16)
    s = jnp.ones((1024,), jnp.float32)
    b = jnp.zeros((1024,), jnp.float32)
    cases = [
        ("sum 1-D", vec, jnp.sum, lambda impl: lambda x: kernels.safe_sum(x, implementation=impl)),
        (
            "sum rows",
            mat,
            lambda x: jnp.sum(x, axis=-1),
            lambda impl: lambda x: kernels.safe_sum(x, -1, implementation=impl),
        ),
        (
            "softmax f32",
            mat,
            jax.nn.softmax,
            lambda impl: lambda x: kernels.safe_softmax(x, implementation=impl),
        ),
        (
            "softmax bf16",
            mat16,
            jax.nn.softmax,
            lambda impl: lambda x: kernels.safe_softmax(x, implementation=impl),
        ),
        (
            "layer_norm bf16",
            mat16,
            lambda x: _plain_ln(x, s, b),
            lambda impl: lambda x: kernels.safe_layer_norm(x, s, b, implementation=impl),
        ),
        (
            "rms_norm bf16",
            mat16,
            lambda x: _plain_rms(x, s),
            lambda impl: lambda x: kernels.safe_rms_norm(x, s, implementation=impl),
        ),
    ]
    rows = []
    for name, x, plain, safe in cases:
        row = {
            "op": name,
            "shape": "x".join(map(str, x.shape)),
            "plain_ms": _time(jax.jit(plain), x, repeats=repeats),
            "safe_default_ms": _time(jax.jit(safe(None)), x, repeats=repeats),
        }
        if accel:
            row["safe_reference_ms"] = _time(jax.jit(safe("reference")), x, repeats=repeats)
            row["safe_pallas_ms"] = _time(jax.jit(safe("pallas")), x, repeats=repeats)
        row["slowdown"] = row["safe_default_ms"] / row["plain_ms"]
        rows.append(row)
    return rows


def _fmt(v) -> str:
    if isinstance(v, float):
        if math.isinf(v):
            return "inf"
        return f"{v:.3g}" if abs(v) < 1e5 else f"{v:.3e}"
    return str(v)


def print_table(title: str, rows: list[dict], keys: list[str]) -> None:
    print(f"\n{title}")
    cells = [[_fmt(r.get(k, "-")) for k in keys] for r in rows]
    widths = [max(len(k), *(len(c[i]) for c in cells)) for i, k in enumerate(keys)]
    print("  ".join(k.ljust(w) for k, w in zip(keys, widths, strict=True)))
    print("  ".join("-" * w for w in widths))
    for c in cells:
        print("  ".join(v.ljust(w) for v, w in zip(c, widths, strict=True)))


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", metavar="PATH", help="write the results as JSON")
    p.add_argument("--size", type=int, default=1 << 20, help="elements per accuracy sum")
    p.add_argument("--repeats", type=int, default=20, help="timed runs per case (median)")
    p.add_argument("--scale", type=int, default=1, help="multiply the speed-case sizes")
    p.add_argument("--skip-accuracy", action="store_true")
    args = p.parse_args(argv)
    backend = jax.default_backend()
    device = str(jax.devices()[0].device_kind)
    print(f"backend={backend} device={device} jax={jax.__version__}")
    acc_rows = [] if args.skip_accuracy else accuracy(args.size)
    if acc_rows:
        print_table(
            "accuracy: |error| in f32 ulps of the exact sum (math.fsum)",
            acc_rows,
            [
                "data",
                "naive_jnp_sum",
                "naive_sequential",
                "compensated_ref",
                "compensated_pallas",
                "f64_then_f32",
            ],
        )
        if backend == "cpu":
            print("(compensated_pallas ran in Pallas interpret mode)")
    speed_rows = speed(args.repeats, args.scale)
    keys = ["op", "shape", "plain_ms", "safe_default_ms"]
    if backend != "cpu":
        keys += ["safe_reference_ms", "safe_pallas_ms"]
    print_table(
        "speed: median ms per call (jit); safe_default = implementation=None "
        + ("(jnp reference on CPU)" if backend == "cpu" else "(compiled Pallas)"),
        speed_rows,
        keys + ["slowdown"],
    )
    if backend == "cpu":
        print("(Pallas interpret mode is a correctness tool, not a speed measure: not timed)")
    result = {
        "backend": backend,
        "device": device,
        "jax": jax.__version__,
        "accuracy": acc_rows,
        "speed": speed_rows,
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2, default=float)
        print(f"wrote {args.json}")
    return result


if __name__ == "__main__":
    main()
