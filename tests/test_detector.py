"""Detector: probe statistics and the risk score, against a NumPy reference of docs/design.md."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nan2safe_jax import Config, detector, probe

CFG = Config(min_history=8)


class ReferenceDetector:
    """The write-up's PrecursorDetector for one probe, in plain Python (docs/design.md formulas)."""

    def __init__(self, cfg):
        self.cfg, self.ema, self.var, self.hist = cfg, None, 0.0, []

    def step(self, x, headroom=0.0):
        cfg = self.cfg
        risk = 0.0
        if len(self.hist) >= cfg.min_history:
            debias = max(1 - (1 - cfg.alpha) ** max(len(self.hist) - 1, 1), cfg.alpha)
            std = max(math.sqrt(self.var / debias), 1e-3 * abs(self.ema) + 1e-30)
            z = (x - self.ema) / std
            d2 = abs(x - 2 * self.hist[-1] + self.hist[-2]) / std
            risk = 0.5 * (z > cfg.z_threshold) + 0.5 * (d2 > cfg.diff_threshold)
            if headroom >= cfg.headroom_limit:
                risk = 1.0
        if self.ema is None:
            self.ema = x
        else:
            delta = x - self.ema
            self.ema += cfg.alpha * delta
            self.var = (1 - cfg.alpha) * (self.var + cfg.alpha * delta * delta)
        self.hist.append(x)
        return risk


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16, jnp.float32])
def test_stats_against_numpy(dtype):
    x = np.array([[1.0, -3.0, np.nan], [np.inf, 2.0, 0.5]], np.float32)
    s = np.asarray(detector.stats(jnp.asarray(x, dtype)))
    fin = x[np.isfinite(x)]
    np.testing.assert_allclose(s[probe.MAX_ABS], np.max(np.abs(fin)), rtol=1e-2)
    np.testing.assert_allclose(s[probe.MEAN], fin.mean(), rtol=1e-2)
    np.testing.assert_allclose(s[probe.VAR], fin.var(), rtol=1e-2)
    assert s[probe.NONFINITE] == 2
    assert s[probe.HEADROOM] == 1.0  # an inf element is the end of headroom


def test_headroom_is_relative_to_the_dtype():
    s16 = detector.stats(jnp.asarray([30000.0], jnp.float16))
    s32 = detector.stats(jnp.asarray([30000.0], jnp.float32))
    assert float(s16[4]) == pytest.approx(30000 / 65504, rel=1e-3)
    assert float(s32[4]) < 1e-30


def _feed(values, headroom=None, cfg=CFG):
    state = detector.DetectorState.create(["p"])
    upd = jax.jit(detector.update, static_argnums=2)
    risks = []
    for i, v in enumerate(values):
        h = 0.0 if headroom is None else headroom[i]
        s = jnp.asarray([v, 0.0, 0.0, 0.0 if np.isfinite(v) else 1.0, h], jnp.float32)
        state, out = upd(state, {"p": s}, cfg)
        risks.append(float(out.risk))
    return state, risks


def test_matches_reference_on_a_noisy_then_spiking_series():
    rng = np.random.default_rng(0)
    values = list(10 + rng.normal(0, 0.5, 60)) + [10 + 0.5 * 3**k for k in range(8)]
    ref = ReferenceDetector(CFG)
    expected = [ref.step(v) for v in values]
    _, got = _feed(values)
    np.testing.assert_allclose(got, expected, atol=1e-6)
    assert max(got[-8:]) == 1.0
    assert max(got[:60]) < 1.0


def test_nan_never_poisons_the_baseline():
    values = [1.0, 1.1, 0.9, 1.0, float("nan"), 1.05, float("inf"), 1.0]
    state, _ = _feed(values)
    assert np.all(np.isfinite(state.ema)) and np.all(np.isfinite(state.emvar))
    assert int(state.count[0]) == 6


def test_headroom_alone_is_full_risk_after_warmup():
    values = [1.0] * 12
    head = [0.0] * 11 + [0.6]
    _, risks = _feed(values, head)
    assert risks[-1] == 1.0


def test_lr_jump_relaxes_thresholds():
    cfg = Config(window=16, min_history=8, lr_cooldown=5)
    rng = np.random.default_rng(1)
    series = list(10 + rng.normal(0, 0.3, 30)) + [10 + 0.3 * 7, 10 + 0.3 * 14]
    plain, relaxed = [], []
    for lr_change, out in ((False, plain), (True, relaxed)):
        state = detector.DetectorState.create(["p"])
        for i, v in enumerate(series):
            lr = 1e-3 if (not lr_change or i < 29) else 5e-3
            s = jnp.asarray([v, 0, 0, 0, 0], jnp.float32)
            state, r = detector.update(state, {"p": s}, cfg, lr=lr)
            out.append(float(r.risk))
    assert plain[-1] > relaxed[-1]


def test_missing_probe_reads_as_zero_and_order_is_kept():
    state = detector.DetectorState.create(["a", "b"])
    stacked = detector.stack_stats({"b": jnp.ones(5)}, state.names)
    np.testing.assert_array_equal(stacked[0], 0)
    np.testing.assert_array_equal(stacked[1], 1)
    with pytest.raises(ValueError, match="unique"):
        detector.DetectorState.create(["a", "a"])


def test_detector_state_round_trips_through_jit():
    state, _ = _feed([1.0, 2.0, 3.0])
    out = jax.jit(lambda s: s)(state)
    assert out.names == state.names
    for a, b in zip(jax.tree_util.tree_leaves(out), jax.tree_util.tree_leaves(state), strict=True):
        np.testing.assert_array_equal(a, b)


series = st.lists(
    st.floats(min_value=1e-3, max_value=1e3, allow_nan=False), min_size=3, max_size=40
)


@settings(max_examples=30, deadline=None)
@given(series)
def test_risk_is_in_unit_interval(values):
    _, risks = _feed(values)
    assert all(0.0 <= r <= 1.0 for r in risks)


@settings(max_examples=20, deadline=None)
@given(series, st.sampled_from([0.25, 4.0, 1024.0]))
def test_z_is_scale_invariant(values, c):
    def zs(vals):
        state = detector.DetectorState.create(["p"])
        out = []
        for v in vals:
            state, r = detector.update(state, jnp.asarray([[v, 0, 0, 0, 0]], jnp.float32), CFG)
            out.append((float(r.z[0]), float(r.risk)))
        return out

    a, b = zs(values), zs([v * c for v in values])
    np.testing.assert_allclose([x[0] for x in a], [x[0] for x in b], rtol=1e-3, atol=1e-3)


@settings(max_examples=30, deadline=None)
@given(st.lists(st.floats(min_value=0, max_value=1e30, allow_nan=False), min_size=1, max_size=7))
def test_no_trigger_during_warmup(values):
    head = [1.0] * len(values)
    _, risks = _feed(values, head)
    assert risks == [0.0] * len(values)
