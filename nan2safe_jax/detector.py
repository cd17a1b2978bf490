"""Tier 1: probe statistics and the EMA / z-score / second-difference risk score.

Detection is cheap and always on: a probe is one tensor's ``stats`` (a handful of ``lax``
reductions, on device), and ``update`` turns the statistics of every probe into one risk score
(SPEC.md, "Tier 1"). Deciding what to do with the score is ``gear.decide``'s job, not this one's.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import struct

from nan2safe_jax.config import Config
from nan2safe_jax.probe import HEADROOM, MAX_ABS, NONFINITE, NUM_STATS
from nan2safe_jax.probe import STATS as STATS  # the probe vector lives in nan2safe_jax.probe
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
        z = jnp.zeros([p], jnp.float32)
        return cls(
            names=names,
            ema=z,
            emvar=z,
            prev1=z,
            prev2=z,
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
    calm: jax.Array  # bool[] every warm probe's z below half its threshold
    nonfinite: jax.Array  # f32[] non-finite elements over all probes


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


def update(
    state: DetectorState,
    probe_stats: Mapping[str, jax.Array] | jax.Array,
    cfg: Config,
    lr: jax.ArrayLike | None = None,
) -> tuple[DetectorState, Risk]:
    """Scores this step's statistics against the baselines, then folds them in.

    Per probe, with ``x = max_abs``: ``z = (x - ema) / std`` and
    ``d2 = |x - 2 prev1 + prev2| / std``; ``risk = 0.5 [z > z_threshold] + 0.5 [d2 >
    diff_threshold]``, or 1 when the headroom passes ``headroom_limit``. A probe scores 0
    until it has ``min_history`` finite samples (warm-up). Within ``lr_cooldown`` steps of a
    learning-rate jump both thresholds are multiplied by ``lr_cooldown_factor``. Baselines are
    updated only from finite samples, so a NaN step never poisons the EMA.

    Args:
      state: the baselines.
      probe_stats: ``{name: f32[NUM_STATS]}`` (from ``stats``) or an f32[P, NUM_STATS] array.
      cfg: thresholds.
      lr: this step's learning rate, for the cool-down after a schedule jump (optional).

    Returns:
      ``(new_state, Risk)``.
    """
    if isinstance(probe_stats, Mapping):
        s = stack_stats(probe_stats, state.names)
    else:
        s = jnp.asarray(probe_stats, jnp.float32).reshape(len(state.names), NUM_STATS)
    x, headroom, bad = s[:, MAX_ABS], s[:, HEADROOM], s[:, NONFINITE]
    finite = (bad == 0) & jnp.isfinite(x)

    cooldown = state.cooldown
    if lr is not None:
        lr = jnp.asarray(lr, jnp.float32)
        rel = jnp.abs(lr - state.last_lr) / jnp.maximum(jnp.abs(state.last_lr), 1e-30)
        jumped = (state.last_lr > 0) & jnp.isfinite(rel) & (rel > cfg.lr_jump)
        cooldown = jnp.where(jumped, cfg.lr_cooldown, cooldown)
        last_lr = lr
    else:
        last_lr = state.last_lr
    relax = jnp.where(cooldown > 0, cfg.lr_cooldown_factor, 1.0)

    std = _std(state.ema, state.emvar, state.count, cfg.alpha)
    warm = state.count >= cfg.min_history
    z = jnp.where(warm & finite, (x - state.ema) / std, 0.0)
    d2 = jnp.where(warm & finite, jnp.abs(x - 2.0 * state.prev1 + state.prev2) / std, 0.0)
    stat_risk = 0.5 * (z > cfg.z_threshold * relax) + 0.5 * (d2 > cfg.diff_threshold * relax)
    over = warm & (headroom >= cfg.headroom_limit)
    per_probe = jnp.where(over, 1.0, stat_risk).astype(jnp.float32)
    risk = jnp.max(per_probe, initial=0.0)
    calm = jnp.all(jnp.where(warm, z < 0.5 * cfg.z_threshold, True))

    alpha = cfg.alpha
    first = state.count == 0
    delta = x - state.ema
    ema = jnp.where(first, x, state.ema + alpha * delta)
    emvar = jnp.where(first, 0.0, (1.0 - alpha) * (state.emvar + alpha * delta * delta))
    keep = lambda new, old: jnp.where(finite, new, old)
    new_state = state.replace(
        ema=keep(ema, state.ema),
        emvar=keep(emvar, state.emvar),
        prev1=keep(x, state.prev1),
        prev2=keep(state.prev1, state.prev2),
        count=keep(jnp.minimum(state.count + 1, 2**30), state.count).astype(jnp.int32),
        last_lr=last_lr,
        cooldown=jnp.maximum(cooldown - 1, 0).astype(jnp.int32),
    )
    return new_state, Risk(
        risk=risk,
        per_probe=per_probe,
        z=z,
        d2=d2,
        calm=calm,
        nonfinite=jnp.sum(jnp.where(jnp.isfinite(bad), bad, 1.0)),
    )
