"""What the benchmarks measure beside the clock: paired ratios with a confidence interval, and
the size of a compiled program.

On a shared 2-core machine one round of the same step moves by ±10% (a VM's neighbours, the
CPU's clock), so a median ratio of 1.037 over 21 rounds says little about a 1.03 target on its
own. Two answers, used by ``overhead.py`` and ``ops.py``:

- ``paired_ratio``: rounds are interleaved, so round ``i`` of two arms ran under the same
  conditions; the ratio of each round's pair cancels what the round shares, and a bootstrap
  over the rounds gives the median ratio's 95% interval. A target is *met* when the interval
  lies under it, *missed* when it lies over it, and *not resolved* by the run otherwise.
- ``interleaved_rounds``: how the rounds are taken. Each round times every arm in ``chunks``
  short chunks, in a fresh random order each time, and keeps each arm's fastest chunk. A fixed
  order favoured whichever arm ran after a given other (``ops.py``'s flax arm always followed
  the previous module's heaviest arm: `Linear` read 0.93x in order and 1.00x shuffled), and
  noise on this VM only ever adds time, so a round's fastest chunk is its least disturbed
  (what ``timeit`` reports, for the same reason). The intervals of ``ops.py`` went from about
  +-0.10 to +-0.02 with five chunks.
- ``program_size``: what XLA compiled, counted from ``Compiled.as_text()`` and XLA's own cost
  analysis: kernels (fusions), the instructions fused into them, the distinct ones among both
  (what compile time follows more closely), and the flops and bytes the program touches. The
  same on every run of the same program.
"""

from __future__ import annotations

import random
import re
import statistics
from collections.abc import Callable, Mapping, Sequence
from typing import TypeVar

T = TypeVar("T")
CONFIDENCE = 0.95
BOOTSTRAP = 2000


def paired_ratio(
    arm: Sequence[float], base: Sequence[float], seed: int = 0
) -> tuple[float, float, float]:
    """The median of the per-round ratios ``arm[i] / base[i]`` and its 95% bootstrap interval.

    Args:
      arm, base: per-round times of two arms timed in the same rounds (same length, >= 1).
      seed: the bootstrap's seed (the interval is reproducible from the times).

    Returns:
      ``(median, low, high)``; with one round the interval is that round's ratio.
    """
    if len(arm) != len(base) or not arm:
        raise ValueError(f"paired_ratio: {len(arm)} and {len(base)} rounds")
    ratios = [a / b for a, b in zip(arm, base, strict=True)]
    rng = random.Random(seed)
    meds = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(BOOTSTRAP))
    tail = (1 - CONFIDENCE) / 2
    low = meds[int(tail * (BOOTSTRAP - 1))]
    high = meds[int((1 - tail) * (BOOTSTRAP - 1) + 0.5)]
    return statistics.median(ratios), low, high


def interleaved_rounds(
    arms: Mapping[str, Callable[[], T]],
    rounds: int,
    chunks: int = 1,
    seed: int = 0,
    key: Callable[[T], float] = float,
) -> dict[str, list[T]]:
    """Per-round timings of several arms, interleaved in a shuffled order.

    Args:
      arms: name -> a callable that times one chunk of that arm and returns its measurement
        (seconds, or a tuple whose order ``key`` gives).
      rounds: rounds to take; every arm gets one value per round, so round ``i`` of two arms
        pairs (``paired_ratio``).
      chunks: chunks per arm per round; the round keeps each arm's smallest (by ``key``).
      seed: the order's seed (each chunk visits the arms in a new permutation).
      key: what "smallest" compares.

    Returns:
      name -> ``rounds`` measurements.
    """
    if rounds < 1 or chunks < 1:
        raise ValueError(f"interleaved_rounds: rounds={rounds} and chunks={chunks} must be >= 1")
    rng, names = random.Random(seed), list(arms)
    out: dict[str, list[T]] = {n: [] for n in names}
    for _ in range(rounds):
        best: dict[str, T] = {}
        for _ in range(chunks):
            for n in rng.sample(names, len(names)):
                m = arms[n]()
                if n not in best or key(m) < key(best[n]):
                    best[n] = m
        for n in names:
            out[n].append(best[n])
    return out


def verdict(low: float, high: float, target: float) -> str:
    """``"met"`` (the interval is at or under ``target``), ``"missed"`` (over it) or
    ``"not resolved"`` (it straddles it: more rounds or a quieter machine would decide)."""
    if high <= target:
        return "met"
    if low > target:
        return "missed"
    return "not resolved"


def ratio_text(ratio: float, low: float, high: float, target: float | None = None) -> str:
    """``1.037x (95% CI 0.99-1.08)`` and, with a target, ``: not resolved at <= 1.03``."""
    text = f"{ratio:.3f}x (95% CI {low:.3f}-{high:.3f})"
    if target is not None:
        text += f": {verdict(low, high, target)} at <= {target:.2f}"
    return text


_FUSION = re.compile(r"^\s*(?:ROOT )?%?[\w.\-]+ = [^\n]*? fusion\([^\n]*?calls=%?([\w.\-]+)", re.M)
_COMPUTATION = re.compile(r"^%?([\w.\-]+) \([^\n]*\) -> [^\n]*\{\n(.*?)\n\}", re.M | re.S)


def _anonymous(body: str) -> str:
    """A fused computation without its names and metadata: two kernels that compute the same
    thing on the same shapes read the same (XLA's CPU backend compiles such a kernel once)."""
    return re.sub(r"%[\w.\-]+", "%", re.sub(r", metadata=\{[^}]*\}", "", body))


def program_size(compiled) -> dict[str, float]:
    """The size of a compiled program.

    Args:
      compiled: a ``jax.stages.Compiled``.

    Returns:
      ``kernels`` (fusions, wherever they sit: the entry, loop bodies, branches),
      ``fused_instructions`` (the instructions inside them), ``distinct_kernels`` and
      ``distinct_fused_instructions`` (the same over kernels that differ once names are
      ignored: an identical kernel, e.g. one per repeated layer, compiles once, and compile
      time followed these more closely than the raw counts here), and XLA's cost analysis:
      ``flops`` and ``bytes_accessed`` (every branch of a conditional counted, so a branch
      that only runs on a skipped step counts as if it ran; a loop body, e.g. scanned
      layers, once however many times it runs). A missing cost analysis (some backends)
      reads as 0.
    """
    text = compiled.as_text()
    bodies = {m.group(1): m.group(2) for m in _COMPUTATION.finditer(text)}
    called = [m.group(1) for m in _FUSION.finditer(text)]
    fused = sum(bodies.get(name, "").count("\n") + 1 for name in called)
    distinct = {_anonymous(bodies.get(name, "")) for name in called}
    cost = compiled.cost_analysis()
    if isinstance(cost, (list, tuple)):  # one dict per device program in older JAX
        cost = cost[0] if cost else {}
    cost = cost or {}
    return {
        "kernels": len(called),
        "fused_instructions": fused,
        "distinct_kernels": len(distinct),
        "distinct_fused_instructions": sum(b.count("\n") + 1 for b in distinct),
        "flops": float(cost.get("flops", 0.0)),
        "bytes_accessed": float(cost.get("bytes accessed", 0.0)),
    }


# XLA's CPU compiler logs its phases with these (``TF_CPP_VMODULE``, shown at
# ``TF_CPP_MIN_LOG_LEVEL`` 0): ``compile_phases`` reads a compile child's stderr written so.
PHASE_LOG_ENV = {
    "TF_CPP_MIN_LOG_LEVEL": "0",
    "TF_CPP_VMODULE": "hlo_pass_pipeline=1,cpu_compiler=1",
}
_STAMP = re.compile(r"^[IWEF]\d{4} (\d\d):(\d\d):(\d\d\.\d+)")
_US = re.compile(r"time: [^(]*\((\d+) us\)")


def _stamp(line: str) -> float | None:
    m = _STAMP.match(line)
    return None if m is None else int(m[1]) * 3600 + int(m[2]) * 60 + float(m[3])


def compile_phases(log: str) -> dict[str, float]:
    """Where XLA's CPU compiler spent the largest compile of ``log`` (stderr of a process run
    with ``PHASE_LOG_ENV``): its HLO passes, then, from the scheduled module, emitting every
    kernel (one LLVM module each, verified as it is made) and LLVM compiling them.

    Compile time on the CPU follows the number of LLVM modules more than their size (a kernel
    of one scalar costs about what a matmul's epilogue does), which is why the step's small
    bookkeeping kernels show up in its compile time; this splits it by phase.

    Args:
      log: the process's stderr.

    Returns:
      ``hlo_passes_s``, ``emit_s``, ``llvm_s`` and ``llvm_modules`` of the program whose
      ``Compiling [...] using JIT`` took longest; empty when the log has none (another
      backend, or a JAX whose XLA logs otherwise).
    """
    lines = log.splitlines()
    best: dict[str, float] = {}
    best_s = -1.0
    for i, line in enumerate(lines):
        if "] Compiling: " not in line or _stamp(line) is None:
            continue
        name = line.split("] Compiling: ", 1)[1].strip()
        passes = next(
            (ln for ln in reversed(lines[max(0, i - 3) : i]) if f"HLO passes on [{name}]" in ln),
            "",
        )
        verified, scheduled, done = [], None, None
        for ln in lines[i + 1 :]:
            if "HLO passes after scheduling" in ln and scheduled is None:
                scheduled = _stamp(ln)
            elif "Running LLVM verifier" in ln:
                verified.append(_stamp(ln))
            elif "Compilation finished" in ln:
                done = _stamp(ln)
                break
        m = _US.search(passes)
        if None in (scheduled, done, m) or not verified or None in verified:
            continue
        total = done - _stamp(line)
        if total > best_s:
            best_s = total
            best = {
                "hlo_passes_s": int(m[1]) / 1e6,
                "emit_s": verified[-1] - _stamp(line),
                "llvm_s": done - verified[-1],
                "llvm_modules": float(len(verified)),
            }
    return best
