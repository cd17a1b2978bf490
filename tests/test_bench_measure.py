"""benchmarks/measure.py: paired ratios with their interval, and the size of a compiled program."""

import statistics

import jax
import jax.numpy as jnp
import pytest


@pytest.fixture(scope="module")
def measure(benchmark_module):
    return benchmark_module("measure")


def _reference_interval(ratios, measure, seed=0):
    """The bootstrap written out: resample the rounds, take each resample's median, read the
    2.5% and 97.5% order statistics."""
    import random

    rng = random.Random(seed)
    meds = []
    for _ in range(measure.BOOTSTRAP):
        meds.append(statistics.median([ratios[rng.randrange(len(ratios))] for _ in ratios]))
    meds.sort()
    n = measure.BOOTSTRAP - 1
    return meds[int(0.025 * n)], meds[int(0.975 * n + 0.5)]


def test_paired_ratio_is_the_median_of_the_rounds_ratios_with_its_bootstrap_interval(measure):
    base = [10.0, 12.0, 9.0, 11.0, 10.5, 13.0, 9.5]
    arm = [10.4, 12.9, 9.1, 11.6, 10.6, 13.1, 10.2]
    ratio, low, high = measure.paired_ratio(arm, base)
    ratios = [a / b for a, b in zip(arm, base, strict=True)]
    assert ratio == statistics.median(ratios)
    assert (low, high) == _reference_interval(ratios, measure)
    assert min(ratios) <= low <= ratio <= high <= max(ratios)
    assert measure.paired_ratio(arm, base) == (ratio, low, high)  # the seed makes it repeatable


def test_a_round_shared_by_both_arms_cancels_in_the_paired_ratio(measure):
    """A slow spell that hits both arms of a round moves the ratio of medians, not the paired
    ratio: the reason the benchmarks pair rounds."""
    slow = [1.0, 1.0, 3.0, 3.0, 3.0, 1.0, 1.0, 1.0, 3.0]
    base = [s * 1.0 for s in slow]
    arm = [s * 1.02 for s in slow]
    assert measure.paired_ratio(arm, base) == pytest.approx((1.02, 1.02, 1.02))


def test_paired_ratio_needs_rounds_of_both_arms(measure):
    with pytest.raises(ValueError, match="rounds"):
        measure.paired_ratio([1.0, 2.0], [1.0])
    with pytest.raises(ValueError, match="rounds"):
        measure.paired_ratio([], [])


@pytest.mark.parametrize(
    "low, high, expected",
    [(0.98, 1.02, "met"), (1.031, 1.09, "missed"), (0.99, 1.05, "not resolved")],
)
def test_verdict_reads_the_interval_against_the_target(measure, low, high, expected):
    assert measure.verdict(low, high, 1.03) == expected
    assert measure.ratio_text(1.0, low, high, 1.03).endswith(f"{expected} at <= 1.03")


class _FakeCompiled:
    """A ``Compiled`` stand-in: its text and cost analysis as given."""

    def __init__(self, text, cost):
        self._text, self._cost = text, cost

    def as_text(self):
        return self._text

    def cost_analysis(self):
        return self._cost


_HLO = """HloModule m

%fused_a (p0: f32[4]) -> f32[4] {
  %p0 = f32[4]{0} parameter(0)
  %e = f32[4]{0} exponential(%p0)
  ROOT %n = f32[4]{0} negate(%e)
}

%fused_b (q0: f32[4]) -> f32[] {
  %q0 = f32[4]{0} parameter(0)
  %z = f32[] constant(0)
  ROOT %r = f32[] reduce(%q0, %z), dimensions={0}, to_apply=%add
}

%body (t: f32[4]) -> f32[4] {
  %t = f32[4]{0} parameter(0)
  ROOT %f2 = f32[4]{0} fusion(%t), kind=kLoop, calls=%fused_a
}

%fused_c (r0: f32[4]) -> f32[4] {
  %r0 = f32[4]{0} parameter(0)
  %e2 = f32[4]{0} exponential(%r0), metadata={op_name="exp"}
  ROOT %n2 = f32[4]{0} negate(%e2)
}

ENTRY %main (x: f32[4]) -> f32[] {
  %x = f32[4]{0} parameter(0)
  %f1 = f32[4]{0} fusion(%x), kind=kLoop, calls=%fused_a, metadata={op_name="exp"}
  %f4 = f32[4]{0} fusion(%f1), kind=kLoop, calls=%fused_c
  ROOT %f3 = f32[] fusion(%f4), kind=kLoop, calls=%fused_b
}
"""


def test_program_size_counts_every_kernel_and_what_is_fused_into_it(measure):
    size = measure.program_size(
        _FakeCompiled(_HLO, [{"flops": 12.0, "bytes accessed": 48.0, "utilization": 1.0}])
    )
    # fused_a is called twice (the entry and a loop body), fused_c is fused_a under other names
    # and metadata: four kernels of 3 instructions each, two of them distinct
    assert size == {
        "kernels": 4,
        "fused_instructions": 3 * 4,
        "distinct_kernels": 2,
        "distinct_fused_instructions": 3 + 3,
        "flops": 12.0,
        "bytes_accessed": 48.0,
    }
    assert measure.program_size(_FakeCompiled(_HLO, None))["flops"] == 0.0


def test_program_size_of_a_real_program_grows_with_its_kernels(measure):
    """Two reductions over different axes are two kernels (XLA fuses the elementwise work
    into each); one elementwise chain is one."""
    x = jnp.ones((64, 64), jnp.float32)
    one = jax.jit(lambda x: jnp.exp(x) * 2).lower(x).compile()
    two = jax.jit(lambda x: (jnp.sum(jnp.exp(x), 0), jnp.max(jnp.tanh(x), 1))).lower(x).compile()
    small, big = measure.program_size(one), measure.program_size(two)
    assert small["kernels"] >= 1 and small["fused_instructions"] >= 3
    assert big["kernels"] > small["kernels"]
    assert big["fused_instructions"] > small["fused_instructions"]
    assert big["distinct_kernels"] == big["kernels"] == 2  # a sum and a max: not the same kernel
    assert big["flops"] > small["flops"] > 0
    assert small["bytes_accessed"] >= 2 * x.nbytes  # reads x, writes its result


def test_interleaved_rounds_keeps_each_rounds_fastest_chunk(measure):
    """Each arm's value of a round is the smallest of its chunks in that round (by ``key``),
    and every arm gets one value per round."""
    seq = {"a": iter([3.0, 1.0, 2.0, 5.0, 4.0, 6.0]), "b": iter([(2.0, 9), (1.5, 8)] * 3)}
    arms = {n: (lambda it=it: next(it)) for n, it in seq.items()}
    out = measure.interleaved_rounds(
        arms, rounds=2, chunks=3, key=lambda m: m[0] if isinstance(m, tuple) else m
    )
    assert out == {"a": [1.0, 4.0], "b": [(1.5, 8), (1.5, 8)]}


def test_interleaved_rounds_visits_every_arm_once_per_chunk_in_shuffled_orders(measure):
    """No arm always runs after the same other: each chunk is a permutation of the arms, and
    the permutations differ (a fixed order biased the arm that followed the heaviest one)."""
    calls = []
    arms = {n: (lambda n=n: calls.append(n) or 1.0) for n in "abcde"}
    measure.interleaved_rounds(arms, rounds=4, chunks=5, seed=3)
    chunks = [tuple(calls[i : i + 5]) for i in range(0, len(calls), 5)]
    assert len(chunks) == 20
    assert all(sorted(c) == list("abcde") for c in chunks)
    assert len(set(chunks)) > 10


@pytest.mark.parametrize("rounds, chunks", [(0, 1), (1, 0)])
def test_interleaved_rounds_needs_a_round_and_a_chunk(measure, rounds, chunks):
    with pytest.raises(ValueError, match="rounds=.* and chunks="):
        measure.interleaved_rounds({"a": lambda: 1.0}, rounds=rounds, chunks=chunks)


def _phase_log(name, t0, passes_us, modules, emit_s, llvm_s):
    """XLA's CPU compile log of one program, as ``PHASE_LOG_ENV`` makes it write one."""
    stamp = lambda t: f"I1204 16:{int(t // 60):02d}:{t % 60:09.6f}   1 x.cc:1] "  # noqa: E731
    lines = [
        stamp(t0 - 0.1) + f"Running HLO passes on [{name}] for CPU time: 1 ms ({passes_us} us)",
        stamp(t0) + f"Compiling: {name}",
        stamp(t0 + 0.01) + "Running HLO pass pipeline on module x: HLO passes after scheduling",
    ]
    for i in range(modules):
        t = t0 + emit_s * (i + 1) / modules
        lines.append(stamp(t) + "CpuCompiler - Running LLVM verifier time: 9 us (9 us)")
    lines.append(stamp(t0 + emit_s + llvm_s) + "Compilation finished")
    return "\n".join(lines)


def test_compile_phases_splits_the_largest_compile_of_xlas_log(measure):
    small = _phase_log("jit_broadcast", 10.0, 900, 1, 0.01, 0.02)
    large = _phase_log("jit_train_step", 20.0, 340_000, 168, 0.7, 0.9)
    got = measure.compile_phases("noise\n" + small + "\n" + large + "\nW1204 later\n")
    assert got["llvm_modules"] == 168 and got["hlo_passes_s"] == pytest.approx(0.34)
    assert got["emit_s"] == pytest.approx(0.7) and got["llvm_s"] == pytest.approx(0.9)
    assert measure.compile_phases(small)["llvm_modules"] == 1
    assert measure.compile_phases("no XLA log here") == {}


def test_compile_phases_reads_this_jaxs_own_log(measure):
    """The log format is XLA's, not ours: read a real one (a child compiles two programs)."""
    import os
    import subprocess
    import sys

    if jax.default_backend() != "cpu":
        pytest.skip("only XLA's CPU compiler writes this log")
    code = (
        "import jax, jax.numpy as jnp\n"
        "x = jnp.ones((64, 64))\n"
        "f = jax.jit(lambda x: [jnp.sum(jnp.sin(x @ x) * i) for i in range(8)])\n"
        "jax.block_until_ready(f(x))\n"
    )
    env = dict(os.environ, JAX_ENABLE_COMPILATION_CACHE="false", **measure.PHASE_LOG_ENV)
    # XLA's default emitters, as the benchmarks compile (the suite's older ones, conftest.py,
    # may emit the program as one LLVM module)
    flags = env.get("XLA_FLAGS", "").replace("--xla_cpu_use_fusion_emitters=false", "")
    env["XLA_FLAGS"] = flags.strip()
    log = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    ).stderr
    got = measure.compile_phases(log)
    assert got["llvm_modules"] >= 2, got
    assert all(got[k] >= 0 for k in ("hlo_passes_s", "emit_s", "llvm_s")), got
