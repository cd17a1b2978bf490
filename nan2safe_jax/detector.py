"""Tier 1: probe statistics and the EMA / z-score / second-difference risk score.

Detection is cheap and always on: a probe is one tensor's ``stats`` (a handful of ``lax``
reductions, on device), and ``update`` turns the statistics of every probe into one risk score
(docs/design.md, "Tier 1"). Deciding what to do with the score is ``gear.decide``'s job, not
this one's.

The score is calibrated, so that healthy training reads as a flat line at 0: each signal's
threshold follows from a target false-alarm rate shared over the probes (``thresholds``), the
acceleration signal counts only near the dtype's limit, the baseline is a winsorized EMA that a
precursor cannot hijack, and the headroom line needs no baseline at all. ``-inf`` (a mask fill)
is neither an overflow nor a non-finite value for a probe (``nonfinite_count``, ``headroom``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import struct

from nan2safe_jax import numerics
from nan2safe_jax.config import Config
from nan2safe_jax.probe import (
    HEADROOM,
    MAX_ABS,
    NONFINITE,
    NUM_STATS,
    NamedValues,
    rows_finite,
)
from nan2safe_jax.probe import STATS as STATS  # the probe vector lives in nan2safe_jax.probe
from nan2safe_jax.probe import headroom as headroom
from nan2safe_jax.probe import nonfinite_count as nonfinite_count
from nan2safe_jax.probe import stats as stats


class DetectorState(struct.PyTreeNode):
    """EMA baselines of every probe's ``max_abs``, as vectors over probes.

    ``names`` is static (part of the tree structure): the probe set is fixed when the state is
    created, so the step compiles once.
    """

    names: tuple[str, ...] = struct.field(pytree_node=False)
    ema: jax.Array  # f32[P] EMA of max_abs
    emvar: jax.Array  # f32[P] EMA of the squared deviation
    prev1: jax.Array  # f32[P] last finite max_abs
    prev2: jax.Array  # f32[P] the one before
    count: jax.Array  # i32[P] finite samples seen (saturating)
    last_lr: jax.Array  # f32[] learning rate at the previous update (< 0: unknown)
    cooldown: jax.Array  # i32[] steps left with relaxed thresholds

    @classmethod
    def create(cls, names) -> DetectorState:
        """A fresh state for the probes ``names`` (order is kept)."""
        names = tuple(names)
        if len(set(names)) != len(names):
            raise ValueError(f"probe names must be unique, got {names!r}")
        p = len(names)
        # One array per field: a state whose leaves share an array cannot be donated.
        z = lambda: jnp.zeros([p], jnp.float32)  # noqa: E731
        return cls(
            names=names,
            ema=z(),
            emvar=z(),
            prev1=z(),
            prev2=z(),
            count=jnp.zeros([p], jnp.int32),
            last_lr=jnp.full([], -1.0, jnp.float32),
            cooldown=jnp.zeros([], jnp.int32),
        )


class Risk(NamedTuple):
    """What the detector saw this step (all on device)."""

    risk: jax.Array  # f32[] max over probes, in [0, 1]
    per_probe: jax.Array  # f32[P]
    z: jax.Array  # f32[P] z-score of max_abs against the baseline (0 while warming up)
    d2: jax.Array  # f32[P] second difference in baseline std units
    calm: jax.Array  # bool[] no signal fired and every z below the calm line (Thresholds.calm)
    nonfinite: jax.Array  # f32[] non-finite elements over all probes


class Thresholds(NamedTuple):
    """The thresholds ``update`` applies, for a given Config and number of probes."""

    z: float  # level shift: z-score of max_abs
    d2: float  # acceleration: second difference, in baseline std units
    calm: float  # z below which a probe counts as calm (recovery)
    rate: float | None  # false-positive rate per step of each signal of one probe (None: raw)


EULER_GAMMA = 0.5772156649015329
# Baseline std units at which a deviation is clipped before it updates the EMA (``_fold``).
# A 3-sigma winsorized EMA lets the std grow by at most ~6% per step (alpha = 2/129), so a
# value racing away keeps z and d2 growing; clipping changes the std estimate of healthy
# (even Gumbel-tailed) noise by a few percent, which the estimation margin covers.
WINSOR = 3.0


def gumbel_quantile(rate: float) -> float:
    """``q`` with ``P(Z > q) = rate`` for a standardized (mean 0, std 1) Gumbel variable.

    The Gumbel law is the limit law of a maximum, which is what ``max_abs`` is; its tail is
    exponential, far heavier than a Gaussian's (a Gaussian 5-sigma event has rate 3e-7, a
    Gumbel one 1e-3), so quantiles from it keep the false-positive rate of a max-type
    statistic where it is meant to be.
    """
    return (-math.log(-math.log1p(-rate)) - EULER_GAMMA) * math.sqrt(6.0) / math.pi


def thresholds(cfg: Config, num_probes: int) -> Thresholds:
    """Per-probe thresholds from the target false-alarm rate (Bonferroni over probes).

    ``cfg.false_alarm_rate`` is the rate, per step, at which stationary noise may make *any*
    signal of *any* probe fire (risk >= 0.5). Each of the ``2 * num_probes`` signals gets an
    equal share ``rate``; by the union bound the whole detector then stays within the target.
    The z threshold is the Gumbel quantile at ``rate``. The second difference of i.i.d. noise
    has ``sqrt(6)`` times the noise's std and two tails, so its threshold is ``sqrt(6)`` times
    the quantile at ``rate / 2``. Neither is ever below ``cfg.z_threshold`` /
    ``cfg.diff_threshold``; with ``false_alarm_rate=None`` those are used as given.

    Calm (what recovery counts) is SPEC's "every z below half its threshold", with the same
    care for the number of probes: the calm line is raised, if need be, to the quantile at
    which stationary noise breaks a ``recovery_window`` of calm steps with probability at most
    1/4 (all probes together), so that a false alarm costs one recovery window and not the
    rest of the run. It never exceeds the z threshold.

    ``update`` multiplies these by a margin for the baseline's own estimation noise
    (``_estimation_margin``) and, after a learning-rate jump, by ``lr_cooldown_factor``.

    Args:
      cfg: the Config.
      num_probes: the number of probes the maximum is taken over.

    Returns:
      ``Thresholds(z, d2, calm, rate)``.
    """
    p = max(int(num_probes), 1)
    if cfg.false_alarm_rate is None:
        z = float(cfg.z_threshold)
        return Thresholds(z, float(cfg.diff_threshold), 0.5 * z, None)
    rate = cfg.false_alarm_rate / (2 * p)
    z = max(float(cfg.z_threshold), gumbel_quantile(rate))
    d2 = max(float(cfg.diff_threshold), math.sqrt(6.0) * gumbel_quantile(rate / 2))
    calm = min(z, max(0.5 * z, gumbel_quantile(1.0 / (4 * cfg.recovery_window * p))))
    return Thresholds(z, d2, calm, rate)


def _std(ema: jax.Array, emvar: jax.Array, count: jax.Array, alpha: float) -> jax.Array:
    """Baseline std: the EMA variance, debiased for its zero start (as Adam's moments are).

    Without the correction the variance starts at 0 and only reaches its level after ~window
    samples, so every early z is inflated. A relative floor keeps z scale-invariant and finite
    for a probe that has been constant.
    """
    updates = jnp.maximum(count - 1, 1).astype(jnp.float32)
    debias = jnp.maximum(1.0 - jnp.power(1.0 - alpha, updates), alpha)
    var = jnp.maximum(emvar, 0.0) / debias
    return jnp.maximum(jnp.sqrt(var), 1e-3 * jnp.abs(ema) + 1e-30)


def stack_stats(probe_stats: Mapping[str, jax.Array], names: tuple[str, ...]) -> jax.Array:
    """f32[P, NUM_STATS] in ``names`` order; a probe missing this step reads as all zeros."""
    zero = jnp.zeros([NUM_STATS], jnp.float32)
    return jnp.stack([jnp.asarray(probe_stats.get(n, zero), jnp.float32) for n in names])


def _computed_once(state: DetectorState, fn, *operands):
    """``fn(*operands)`` behind ``numerics.computed_once``: each probe's statistics (a scalar
    chain after its reduction) are computed once, by the kernel that writes them, instead of
    again inside every reader of the stack. The predicate is never false (counts are not
    negative), only unknown until run time."""
    return numerics.computed_once(fn, jnp.all(state.count >= 0), *operands)


def stack_blocks(
    state: DetectorState, blocks: Sequence[tuple[tuple[str, ...], jax.Array]]
) -> NamedValues:
    """Every block's rows in one ``f32[P, NUM_STATS]``, named row by row, in block order.

    A block is ``(row names, f32[rows, NUM_STATS])`` (``site.ProbeBlock``): a scanned probe's
    layers stay one operand of the stack's conditional; slicing them into rows first made a
    kernel of every layer (60 at GPT-2 small scanned). The train step stacks its probes with
    it once, for the detector (``update`` takes the result as is) and the metrics alike.

    Args:
      state: the detector (its counts give ``_computed_once`` its predicate).
      blocks: ``[(names, stats)]``.

    Returns:
      ``NamedValues(names, f32[P, NUM_STATS])``.
    """
    names = tuple(n for block_names, _ in blocks for n in block_names)
    values = _computed_once(state, lambda *xs: jnp.concatenate(xs), *(b for _, b in blocks))
    return NamedValues(names, values)


def _estimation_margin(count: jax.Array, cfg: Config) -> jax.Array:
    """Threshold factor for the noise of the baseline itself: ``1 + sqrt(alpha_eff)``.

    ``z`` divides by an *estimated* std; its relative error, about ``sqrt(alpha) / 2`` for
    Gaussian and ``sqrt(alpha)`` for max-type (Gumbel) samples, fattens the tail of ``z``
    beyond the noise's own. A debiased EMA of ``n < window`` samples behaves like a window of
    ``n`` (``alpha_eff = 2 / (n + 1)``), so the margin is larger just after warm-up. Without
    it the false-positive rate is a few times the target (tests/test_detector.py measures it).
    With ``false_alarm_rate=None`` the thresholds are the raw ones and no margin applies.
    """
    if cfg.false_alarm_rate is None:
        return jnp.ones(count.shape, jnp.float32)
    n = jnp.maximum(count, 1).astype(jnp.float32)
    return 1.0 + jnp.sqrt(jnp.maximum(cfg.alpha, 2.0 / (n + 1.0)))


def _lr_cooldown(state: DetectorState, cfg: Config, lr) -> tuple[jax.Array, jax.Array]:
    """``(cooldown, last_lr)`` after this step's learning rate: a jump restarts the cool-down."""
    if lr is None:
        return state.cooldown, state.last_lr
    lr = jnp.asarray(lr, jnp.float32)
    rel = jnp.abs(lr - state.last_lr) / jnp.maximum(jnp.abs(state.last_lr), 1e-30)
    jumped = (state.last_lr > 0) & jnp.isfinite(rel) & (rel > cfg.lr_jump)
    return jnp.where(jumped, cfg.lr_cooldown, state.cooldown), lr


def _fold(
    state: DetectorState, x: jax.Array, finite: jax.Array, limit: jax.Array, cfg: Config
) -> DetectorState:
    """The baselines with this step's finite samples folded in (a NaN step changes nothing).

    Each sample's deviation from the EMA is clipped to ``limit`` (a winsorized EMA, at
    ``WINSOR`` baseline stds): a value past it updates the baseline as if it sat on it. A
    precursor then cannot teach the baseline that it is normal (with a plain EMA the std of
    a geometrically growing value catches up with it, and its z and d2 stop growing), while a
    genuine level shift of healthy training is still learned, at a bounded pace.

    A finite sample whose fold would overflow f32 (a deviation past ~1e20 before warm-up, when
    nothing clips it) is left out like a NaN one: folded, it would make the baseline inf for
    good, blind the probe, and make every later checkpoint of the state refused as non-finite.
    """
    alpha = cfg.alpha
    first = state.count == 0
    delta = jnp.clip(x - state.ema, -limit, limit)
    ema = jnp.where(first, x, state.ema + alpha * delta)
    emvar = jnp.where(first, 0.0, (1.0 - alpha) * (state.emvar + alpha * delta * delta))
    finite = finite & jnp.isfinite(ema) & jnp.isfinite(emvar)
    keep = lambda new, old: jnp.where(finite, new, old)
    return state.replace(
        ema=keep(ema, state.ema),
        emvar=keep(emvar, state.emvar),
        prev1=keep(x, state.prev1),
        prev2=keep(state.prev1, state.prev2),
        count=keep(jnp.minimum(state.count + 1, 2**30), state.count).astype(jnp.int32),
    )


def update(
    state: DetectorState,
    probe_stats: Mapping[str, jax.Array] | NamedValues | jax.Array,
    cfg: Config,
    lr: jax.ArrayLike | None = None,
) -> tuple[DetectorState, Risk]:
    """Scores this step's statistics against the baselines, then folds them in.

    Per probe, with ``x = max_abs``: the level shift ``z = (x - ema) / std`` and the
    acceleration ``d2 = |x - 2 prev1 + prev2| / std``;
    ``risk = 0.5 [z > z_thr] + 0.5 [d2 > d2_thr and headroom >= diff_headroom]``, or 1 when the
    headroom reaches ``headroom_limit``. The thresholds come from ``thresholds(cfg, P)`` so that
    stationary noise fires a signal on at most ``false_alarm_rate`` of steps over all ``P``
    probes. The acceleration counts only near the dtype's limit (``diff_headroom``): far from it
    a racing value is not yet a numerical danger, and without that context the second
    difference of plain noise fires far too often. A probe's z and d2 score 0 until it has
    ``min_history`` finite samples (warm-up); the headroom needs no baseline and is live from
    the first step. Within ``lr_cooldown`` steps of a learning-rate jump both thresholds are
    multiplied by ``lr_cooldown_factor``. Baselines are updated only from finite samples, so a
    NaN step never poisons the EMA, and (calibrated mode) with deviations clipped at
    ``WINSOR`` stds (``_fold``), so a precursor does not become its own baseline.

    ``calm`` (what recovery counts) holds when no signal fired and every warm probe's z is
    below half its threshold.

    Args:
      state: the baselines.
      probe_stats: ``{name: f32[NUM_STATS]}`` (from ``stats``), matched by name; a
        ``NamedValues`` in ``state.names``' order (``stack_blocks``), or an
        f32[P, NUM_STATS] array, taken as is.
      cfg: thresholds.
      lr: this step's learning rate, for the cool-down after a schedule jump (optional).

    Returns:
      ``(new_state, Risk)``.
    """
    if isinstance(probe_stats, NamedValues) and probe_stats.names == state.names:
        s = jnp.asarray(probe_stats.values, jnp.float32)  # ``stack_blocks``' stack, as is
    elif isinstance(probe_stats, Mapping):  # matched by name (``_computed_once``)
        names = state.names
        stack = lambda p: stack_stats(p, names)  # noqa: E731
        probes = {n: jnp.asarray(v, jnp.float32) for n, v in probe_stats.items() if n in names}
        s = _computed_once(state, stack, probes)
    else:
        s = jnp.asarray(probe_stats, jnp.float32).reshape(len(state.names), NUM_STATS)
    x, head, bad = s[:, MAX_ABS], s[:, HEADROOM], s[:, NONFINITE]
    finite = rows_finite(s)
    thr = thresholds(cfg, len(state.names))

    cooldown, last_lr = _lr_cooldown(state, cfg, lr)
    relax = jnp.where(cooldown > 0, cfg.lr_cooldown_factor, 1.0)

    std = _std(state.ema, state.emvar, state.count, cfg.alpha)
    scored = (state.count >= cfg.min_history) & finite
    z = jnp.where(scored, (x - state.ema) / std, 0.0)
    d2 = jnp.where(scored, jnp.abs(x - 2.0 * state.prev1 + state.prev2) / std, 0.0)
    scale = relax * _estimation_margin(state.count, cfg)
    z_fire = z > thr.z * scale
    d2_fire = (d2 > thr.d2 * scale) & (head >= cfg.diff_headroom)
    over = head >= cfg.headroom_limit
    per_probe = jnp.where(over, 1.0, 0.5 * z_fire + 0.5 * d2_fire).astype(jnp.float32)
    risk = jnp.max(per_probe, initial=0.0)
    calm = (risk <= 0.0) & jnp.all(z < thr.calm * scale)

    # Winsorize once the baseline is warm (before, its std means little); the raw rule
    # (false_alarm_rate=None) is the write-up's plain EMA.
    winsor = state.count >= cfg.min_history if cfg.false_alarm_rate is not None else False
    limit = jnp.where(winsor, WINSOR * std, jnp.inf)
    new_state = _fold(state, x, finite, limit, cfg).replace(
        last_lr=last_lr, cooldown=jnp.maximum(cooldown - 1, 0).astype(jnp.int32)
    )
    return new_state, Risk(
        risk=risk,
        per_probe=per_probe,
        z=z,
        d2=d2,
        calm=calm,
        nonfinite=jnp.sum(jnp.where(jnp.isfinite(bad), bad, 1.0)),
    )
