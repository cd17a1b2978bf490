"""Detector: probe statistics and the risk score, against a NumPy reference of docs/design.md."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats

from nan2safe_jax import Config, detector, probe

CFG = Config(min_history=8)
RAW = Config(min_history=8, false_alarm_rate=None, diff_headroom=0.0)  # the write-up's rule


def _gumbel_q(rate):
    """Independent reference: standardized Gumbel upper quantile via scipy."""
    return (stats.gumbel_r.isf(rate) - np.euler_gamma) / (np.pi / np.sqrt(6.0))


class ReferenceDetector:
    """The write-up's PrecursorDetector for one probe, in plain Python (docs/design.md), with the
    calibrated thresholds (Bonferroni over ``num_probes``, Gumbel tail, estimation margin),
    the headroom gate on the second difference, and headroom live from the first step."""

    def __init__(self, cfg, num_probes=1):
        self.cfg, self.ema, self.var, self.hist = cfg, None, 0.0, []
        if cfg.false_alarm_rate is None:
            self.zt, self.dt = cfg.z_threshold, cfg.diff_threshold
        else:
            rate = cfg.false_alarm_rate / (2 * num_probes)
            self.zt = max(cfg.z_threshold, _gumbel_q(rate))
            self.dt = max(cfg.diff_threshold, np.sqrt(6.0) * _gumbel_q(rate / 2))

    def step(self, x, headroom=0.0):
        cfg = self.cfg
        risk, limit = 0.0, math.inf
        n = len(self.hist)
        if n >= cfg.min_history:
            m = 1.0
            if cfg.false_alarm_rate is not None:
                m = 1.0 + math.sqrt(max(cfg.alpha, 2.0 / (n + 1)))
            debias = max(1 - (1 - cfg.alpha) ** max(n - 1, 1), cfg.alpha)
            std = max(math.sqrt(self.var / debias), 1e-3 * abs(self.ema) + 1e-30)
            z = (x - self.ema) / std
            d2 = abs(x - 2 * self.hist[-1] + self.hist[-2]) / std
            gate = headroom >= cfg.diff_headroom
            risk = 0.5 * (z > self.zt * m) + 0.5 * (d2 > self.dt * m and gate)
            if cfg.false_alarm_rate is not None:
                limit = detector.WINSOR * std
        if headroom >= cfg.headroom_limit:
            risk = 1.0
        if self.ema is None:
            self.ema = x
        else:
            delta = min(max(x - self.ema, -limit), limit)
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
    assert s[probe.HEADROOM] == 1.0  # a +inf element is the end of headroom


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16, jnp.float32])
def test_neg_inf_mask_fill_is_not_overflow(dtype):
    scores = jnp.asarray([[3.0, -jnp.inf, -jnp.inf], [-2.0, 1.0, -jnp.inf]], dtype)
    s = np.asarray(detector.stats(scores))
    assert (
        s[probe.MAX_ABS] == 3.0 and s[probe.NONFINITE] == 0
    )  # -inf: neither a max_abs nor a non-finite value
    assert s[probe.HEADROOM] < 1e-3  # nor headroom 1
    s = np.asarray(detector.stats(scores.at[0, 0].set(jnp.inf)))
    assert s[probe.NONFINITE] == 1 and s[probe.HEADROOM] == 1.0  # +inf is an overflow
    s = np.asarray(detector.stats(scores.at[0, 0].set(jnp.nan)))
    assert s[probe.NONFINITE] == 1 and s[probe.HEADROOM] < 1.0


def test_masked_scores_never_raise_risk_from_the_first_step():
    state = detector.DetectorState.create(["scores"])
    rng = np.random.default_rng(0)
    for _ in range(40):
        x = rng.normal(size=(4, 8)).astype(np.float32)
        x[:, 5:] = -np.inf  # key padding
        x[1, :] = -np.inf  # and one fully masked row
        state, r = detector.update(
            state, {"scores": detector.stats(jnp.asarray(x, jnp.float16))}, CFG
        )
        assert float(r.risk) == 0.0 and float(r.nonfinite) == 0.0


def test_headroom_is_relative_to_the_dtype():
    s16 = detector.stats(jnp.asarray([30000.0], jnp.float16))
    s32 = detector.stats(jnp.asarray([30000.0], jnp.float32))
    assert float(s16[4]) == pytest.approx(30000 / 65504, rel=1e-3)
    assert float(s32[4]) < 1e-30


def _feed(values, headroom=None, cfg=CFG):
    """Feeds one probe's ``max_abs`` (and headroom) series through the jitted update."""
    state = detector.DetectorState.create(["p"])
    upd = jax.jit(detector.update, static_argnums=2)
    risks = []
    for i, v in enumerate(values):
        h = 0.0 if headroom is None else headroom[i]
        s = jnp.asarray([v, 0.0, 0.0, 0.0 if np.isfinite(v) else 1.0, h], jnp.float32)
        state, out = upd(state, {"p": s}, cfg)
        risks.append(float(out.risk))
    return state, risks


@pytest.mark.parametrize("cfg", [RAW, CFG], ids=["raw", "calibrated"])
def test_matches_reference_on_a_noisy_then_spiking_series(cfg):
    rng = np.random.default_rng(0)
    values = list(10 + rng.normal(0, 0.5, 60)) + [10 + 0.5 * 3**k for k in range(10)]
    head = [v / 65504 for v in values]  # an fp16 tensor: the last values near its limit
    ref = ReferenceDetector(cfg)
    expected = [ref.step(v, h) for v, h in zip(values, head, strict=True)]
    _, got = _feed(values, head, cfg)
    np.testing.assert_allclose(got, expected, atol=1e-6)
    assert max(got[-10:]) == 1.0
    assert max(got[:60]) < 1.0


def test_thresholds_follow_the_rate_and_the_number_of_probes():
    cfg = Config()
    one, many = detector.thresholds(cfg, 1), detector.thresholds(cfg, 64)
    assert many.z > one.z >= cfg.z_threshold and many.d2 > one.d2 >= cfg.diff_threshold
    assert many.rate == pytest.approx(cfg.false_alarm_rate / 128)
    assert many.z == pytest.approx(_gumbel_q(many.rate), rel=1e-6)
    assert many.d2 == pytest.approx(np.sqrt(6) * _gumbel_q(many.rate / 2), rel=1e-6)
    assert 0.5 * many.z <= many.calm <= many.z
    raw = detector.thresholds(RAW, 64)
    assert (raw.z, raw.d2, raw.calm, raw.rate) == (5.0, 3.0, 2.5, None)
    # A loose target never goes below the floors.
    loose = detector.thresholds(Config(false_alarm_rate=0.49), 1)
    assert (loose.z, loose.d2) == (5.0, 3.0)


def test_nan_never_poisons_the_baseline():
    values = [1.0, 1.1, 0.9, 1.0, float("nan"), 1.05, float("inf"), 1.0]
    state, _ = _feed(values)
    assert np.all(np.isfinite(state.ema)) and np.all(np.isfinite(state.emvar))
    assert int(state.count[0]) == 6


def test_a_finite_outlier_whose_fold_would_overflow_is_left_out_of_the_baseline():
    """A 1e21 sample in warm-up (nothing clips it yet) would make ``emvar`` inf for good: the
    probe blind, the state non-finite (every later checkpoint refused). It is left out like a
    NaN, and a real jump later still scores."""
    rng = np.random.default_rng(0)
    values = list(1.0 + 0.05 * rng.standard_normal(40))
    values[3] = 1e21
    state, _ = _feed(values)
    assert np.all(np.isfinite(state.ema)) and np.all(np.isfinite(state.emvar))
    assert int(state.count[0]) == 39
    _, risk = detector.update(state, {"p": probe.stats(jnp.full((4,), 50.0))}, CFG)
    assert float(risk.z[0]) > 100


def test_headroom_is_live_from_the_first_step():
    # No baseline needed: a tensor at 60% of its dtype's max is full risk during warm-up.
    _, risks = _feed([1.0, 1.0, 40000.0], [1 / 65504, 1 / 65504, 40000 / 65504])
    assert risks == [0.0, 0.0, 1.0]
    _, risks = _feed([1.0] * 12, [0.0] * 11 + [0.6])
    assert risks[-1] == 1.0


def test_acceleration_counts_only_near_the_limit():
    # The same racing series, far from (f32) and near (fp16 values) the dtype's limit.
    rng = np.random.default_rng(3)
    values = list(100 + rng.normal(0, 1.0, 200)) + [100 + 4.0**k for k in range(1, 5)]
    far = [v / 3.4e38 for v in values]
    near = [v / 65504 for v in values]
    _, r_far = _feed(values, far)
    _, r_near = _feed(values, near)
    assert max(r_far) == 0.5  # z alone: half a point, no downshift
    assert max(r_near) == 1.0


def test_lr_jump_relaxes_thresholds():
    cfg = Config(window=16, min_history=8, lr_cooldown=5, false_alarm_rate=None)
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
def test_no_statistical_trigger_during_warmup(values):
    # Only the headroom line may fire before min_history samples; below it, nothing does.
    _, risks = _feed(values, [0.49] * len(values))
    assert risks == [0.0] * len(values)
    _, risks = _feed(values, [0.5] * len(values))
    assert risks == [1.0] * len(values)


def _scan(series, cfg, head=None):
    """Runs ``update`` over ``series`` (f32[T, P] of max_abs) in one ``lax.scan``."""
    t, p = series.shape
    rows = np.zeros((t, p, detector.NUM_STATS), np.float32)
    rows[..., 0] = series
    if head is not None:
        rows[..., 4] = head
    state = detector.DetectorState.create([f"p{i}" for i in range(p)])

    def body(s, r):
        s, out = detector.update(s, r, cfg)
        return s, (out.per_probe, out.risk, out.calm)

    _, out = jax.jit(lambda s, r: jax.lax.scan(body, s, r))(state, jnp.asarray(rows))
    return [np.asarray(a) for a in out]


def _upper(rate, n):
    """A sound upper bound for an observed frequency at true ``rate`` over ``n`` trials
    (mean + 4 binomial standard deviations + one event)."""
    return rate + 4 * math.sqrt(rate * (1 - rate) / n) + 1 / n


@pytest.mark.parametrize("noise", ["gaussian", "gumbel", "gumbel_ar1"])
def test_false_positive_rate_on_stationary_noise(noise):
    # 16 probes x 6000 steps of stationary noise; max_abs is a maximum, hence Gumbel-like.
    rng = np.random.default_rng(0)
    t, p = 6000, 16
    if noise == "gaussian":
        e = rng.normal(size=(t, p))
    else:
        e = rng.gumbel(size=(t, p))
    if noise == "gumbel_ar1":  # a slowly wandering statistic (autocorrelated)
        e = jax.lax.scan(lambda c, u: (0.9 * c + u,) * 2, jnp.zeros(p), jnp.asarray(e))[1]
        e = np.asarray(e)
    series = (10 + 0.3 * e).astype(np.float32)
    warm = CFG.min_history
    # Ungated second difference: each signal's own rate is measured, with a loose target so
    # that thousands of samples see events (the floors z_threshold / diff_threshold stay
    # below the calibrated thresholds here).
    cfg = Config(
        min_history=warm,
        false_alarm_rate=0.1,
        z_threshold=1.0,
        diff_threshold=1.0,
        diff_headroom=0.0,
    )
    thr = detector.thresholds(cfg, p)
    per_probe, risk, calm = _scan(series, cfg, head=np.full((t, p), 0.01))
    n = (t - warm) * p
    fired = per_probe[warm:] >= 0.5
    assert fired.mean() <= _upper(2 * thr.rate, n)  # each probe: both signals together
    assert (risk[warm:] >= 0.5).mean() <= _upper(cfg.false_alarm_rate, t - warm)
    # Default Config: no downshift, risk >= 0.5 on at most false_alarm_rate of steps, and calm
    # is the rule, not the exception (a false alarm costs one recovery window).
    per_probe, risk, calm = _scan(series, Config(min_history=warm), head=np.full((t, p), 0.01))
    assert risk.max() < 1.0
    assert (risk[warm:] >= 0.5).mean() <= _upper(Config().false_alarm_rate, t - warm)
    assert calm[warm:].mean() >= 0.99


def test_linear_drift_is_not_a_precursor():
    # A statistic that grows steadily (weights growing during healthy training) plus noise.
    rng = np.random.default_rng(1)
    t = 4000
    series = (10 + 0.01 * np.arange(t) + 0.3 * rng.gumbel(size=t)).astype(np.float32)[:, None]
    per_probe, risk, calm = _scan(series, Config(), head=series / 65504)
    assert risk.max() < 1.0
    assert (risk[Config().min_history :] >= 0.5).mean() <= 0.005


@pytest.mark.parametrize("rate", [1.1, 1.35, 1.5, 2.0])
def test_geometric_growth_downshifts_before_overflow(rate):
    # An fp16 statistic: stationary around 8, then growing geometrically until it overflows.
    rng = np.random.default_rng(2)
    calm_steps = 400
    growth = np.float32(rate) ** np.arange(1, 120, dtype=np.float32)
    series = np.concatenate([8 + 0.4 * rng.gumbel(size=calm_steps), 8 * growth[growth < 1e6]])
    overflow = int(np.argmax(series > 65504))
    series = series[: overflow + 1].astype(np.float32)[:, None]
    head = np.minimum(series / 65504, 1.0)
    cfg = Config()
    _, risk, _ = _scan(series, cfg, head=head)
    first = int(np.argmax(risk >= cfg.trigger_risk))
    assert risk[first] >= 1.0 and calm_steps <= first < overflow
    # The headroom line alone is a floor for the lead...
    assert first <= int(np.argmax(head[:, 0] >= cfg.headroom_limit))
    if rate >= 1.35:
        # ... and for fast growth z + d2 fire as soon as the value is within diff_headroom of
        # the limit (eight doublings): a lead of log(256) / log(rate) steps, not one or two.
        gate = int(np.argmax(head[:, 0] >= cfg.diff_headroom))
        assert first <= gate
        assert overflow - first >= math.floor(math.log(1 / (2 * cfg.diff_headroom), rate))
