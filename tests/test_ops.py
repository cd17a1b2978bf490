"""Tests for nan2safe_jax.ops: agreement on benign inputs, faults on adversarial ones, gears.

Every op is jitted once per dtype with the gear as a traced argument (module-scoped cache), so
the gear parameterisation reuses one executable: that is also the "no recompile" property.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from nan2safe_jax import ops, probe
from nan2safe_jax.gear import Gear

F32, BF16, F16 = jnp.float32, jnp.bfloat16, jnp.float16
DTYPES = [F32, BF16, F16]
GEARS = [0, 1, 2]
# forward tolerance vs a float64 reference, by dtype (FAST computes in the dtype itself)
TOL = {F32: 2e-5, BF16: 3e-2, F16: 4e-3}


def _ids(dt):
    return jnp.dtype(dt).name


def _np(x):
    return np.asarray(jnp.asarray(x, jnp.float32), np.float64)


def _finite(tree) -> bool:
    return all(
        bool(jnp.all(jnp.isfinite(jnp.asarray(t, jnp.float32)))) for t in jax.tree.leaves(tree)
    )


def _close(actual, desired, dt, scale=1.0):
    tol = TOL[dt] * scale
    np.testing.assert_allclose(_np(actual), np.asarray(desired, np.float64), rtol=tol, atol=tol)


@functools.cache
def _jit(name, **static):
    """One jitted function per (op, static args); the gear is a traced int32 argument."""
    fn = getattr(ops, name)
    return jax.jit(lambda *args, gear, **kw: fn(*args, gear=gear, **static, **kw))


def _run(name, *args, gear, **static):
    return _jit(name, **static)(*args, gear=jnp.int32(gear))


def _rng(seed=0):
    return np.random.default_rng(seed)


# ---------------------------------------------------------------------------------------------
# float64 NumPy references


def ref_softmax(x, where=None):
    x = np.where(where, x, -np.inf) if where is not None else x
    m = np.max(x, -1, keepdims=True)
    e = np.exp(x - m)
    return e / e.sum(-1, keepdims=True)


def ref_logsumexp(x):
    m = x.max(-1, keepdims=True)
    return (m + np.log(np.exp(x - m).sum(-1, keepdims=True)))[..., 0]


def ref_attention(q, k, v, mask=None, causal=False, scale=None):
    d = q.shape[-1]
    scale = 1 / np.sqrt(d) if scale is None else scale
    logits = np.einsum("bqhd,bkhd->bhqk", q, k) * scale
    m = np.ones(logits.shape, bool)
    if mask is not None:
        m = m & mask
    if causal:
        m = m & np.tril(np.ones(logits.shape[-2:], bool))
    p = ref_softmax(logits, m)
    return np.einsum("bhqk,bkhd->bqhd", p, v)


def ref_layer_norm(x, scale, bias, eps):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * scale + bias


def ref_rms_norm(x, scale, eps):
    return x / np.sqrt((x**2).mean(-1, keepdims=True) + eps) * scale


def ref_cross_entropy(logits, labels, mask=None):
    m = logits.max(-1, keepdims=True)
    logp = logits - m - np.log(np.exp(logits - m).sum(-1, keepdims=True))
    nll = -np.take_along_axis(logp, labels[..., None], -1)[..., 0]
    if mask is None:
        return nll.mean()
    return (nll * mask).sum() / mask.sum()


def ref_router_probs(x, kernel):
    return ref_softmax(x @ kernel)


# ---------------------------------------------------------------------------------------------
# benign inputs: every gear agrees with the float64 reference


@pytest.mark.parametrize("gear", GEARS)
@pytest.mark.parametrize("dt", DTYPES, ids=_ids)
def test_softmax_agrees(dt, gear):
    r = _rng(1)
    x = jnp.asarray(r.normal(size=(3, 8)) * 3, dt)
    where = jnp.asarray(r.random((3, 8)) > 0.3).at[:, 0].set(True)
    y = _jit("softmax")(x, gear=jnp.int32(gear), where=where)
    assert y.dtype == dt
    _close(y, ref_softmax(_np(x), np.asarray(where)), dt)
    assert float(jnp.max(jnp.where(where, 0.0, jnp.abs(y.astype(F32))))) == 0.0


@pytest.mark.parametrize("gear", GEARS)
@pytest.mark.parametrize("dt", DTYPES, ids=_ids)
def test_logsumexp_agrees(dt, gear):
    x = jnp.asarray(_rng(2).normal(size=(3, 8)) * 3, dt)
    y = _run("logsumexp", x, gear=gear)
    assert y.dtype == dt and y.shape == (3,)
    _close(y, ref_logsumexp(_np(x)), dt, scale=4)


@pytest.mark.parametrize("gear", GEARS)
@pytest.mark.parametrize("dt", DTYPES, ids=_ids)
def test_attention_agrees(dt, gear):
    r = _rng(3)
    q, k, v = (jnp.asarray(r.normal(size=(2, 5, 2, 4)), dt) for _ in range(3))
    mask = jnp.asarray(r.random((2, 1, 5, 5)) > 0.3).at[..., 0].set(True)
    y = _run("attention", q, k, v, mask, causal=True, gear=gear)
    assert y.dtype == dt and y.shape == q.shape
    want = ref_attention(_np(q), _np(k), _np(v), np.asarray(mask), causal=True)
    _close(y, want, dt, scale=2)


@pytest.mark.parametrize("gear", GEARS)
@pytest.mark.parametrize("dt", DTYPES, ids=_ids)
def test_layer_norm_agrees(dt, gear):
    r = _rng(4)
    x = jnp.asarray(r.normal(size=(4, 16)) * 2 + 1, dt)
    scale, bias = jnp.asarray(r.normal(size=16), F32), jnp.asarray(r.normal(size=16), F32)
    y = _run("layer_norm", x, scale, bias, gear=gear, eps=1e-5)
    assert y.dtype == dt
    _close(y, ref_layer_norm(_np(x), _np(scale), _np(bias), 1e-5), dt, scale=3)


@pytest.mark.parametrize("gear", GEARS)
@pytest.mark.parametrize("dt", DTYPES, ids=_ids)
def test_rms_norm_agrees(dt, gear):
    r = _rng(5)
    x = jnp.asarray(r.normal(size=(4, 16)) * 2, dt)
    scale = jnp.asarray(r.normal(size=16), F32)
    y = _run("rms_norm", x, scale, gear=gear, eps=1e-5)
    assert y.dtype == dt
    _close(y, ref_rms_norm(_np(x), _np(scale), 1e-5), dt, scale=3)


@pytest.mark.parametrize("gear", GEARS)
@pytest.mark.parametrize("dt", DTYPES, ids=_ids)
def test_linear_agrees(dt, gear):
    r = _rng(6)
    x = jnp.asarray(r.normal(size=(2, 3, 8)), dt)
    w, b = jnp.asarray(r.normal(size=(8, 5)) / 3, F32), jnp.asarray(r.normal(size=5), F32)
    y = _run("linear", x, w, b, gear=gear)
    assert y.dtype == dt and y.shape == (2, 3, 5)
    _close(y, _np(x) @ _np(w.astype(dt)) + _np(b), dt, scale=4)


@pytest.mark.parametrize("gear", GEARS)
@pytest.mark.parametrize("dt", DTYPES, ids=_ids)
def test_cross_entropy_agrees(dt, gear):
    r = _rng(7)
    logits = jnp.asarray(r.normal(size=(3, 4, 10)) * 2, dt)
    labels = jnp.asarray(r.integers(0, 10, size=(3, 4)), jnp.int32)
    mask = jnp.asarray(r.random((3, 4)) > 0.3).at[0, 0].set(True)
    y = _run("cross_entropy", logits, labels, gear=gear, mask=None)
    ym = _jit("cross_entropy")(logits, labels, gear=jnp.int32(gear), mask=mask)
    assert y.dtype == F32 and y.shape == ()
    _close(y, ref_cross_entropy(_np(logits), np.asarray(labels)), dt, scale=2)
    _close(ym, ref_cross_entropy(_np(logits), np.asarray(labels), np.asarray(mask)), dt, scale=2)


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("dt", DTYPES, ids=_ids)
def test_cross_entropy_fast_is_optax_bit_for_bit(dt, masked):
    # FAST is the loss a flax user writes (examples/transformer.py's OptaxCrossEntropy)
    r = _rng(17)
    logits = jnp.asarray(r.normal(size=(3, 4, 50)) * 3, dt)
    labels = jnp.asarray(r.integers(0, 50, size=(3, 4)), jnp.int32)
    mask = jnp.asarray(r.random((3, 4)) > 0.3).at[0, 0].set(True) if masked else None

    def stock(x):
        nll = optax.softmax_cross_entropy_with_integer_labels(x, labels).astype(F32)
        if mask is None:
            return jnp.mean(nll)
        return jnp.sum(jnp.where(mask, nll, 0.0)) / jnp.sum(mask, dtype=F32)

    ours = jax.jit(jax.value_and_grad(lambda x: ops.cross_entropy(x, labels, gear=0, mask=mask)))
    (y, g), (y_ref, g_ref) = ours(logits), jax.jit(jax.value_and_grad(stock))(logits)
    assert y.dtype == F32
    np.testing.assert_array_equal(_np(y), _np(y_ref))
    np.testing.assert_array_equal(_np(g), _np(g_ref))


@pytest.mark.parametrize("gear", GEARS)
@pytest.mark.parametrize("dt", DTYPES, ids=_ids)
def test_cross_entropy_of_huge_logits_is_exact_in_every_gear(dt, gear):
    # a target at -2e5 below the top logit: its probability underflows, its loss does not
    big = 1e4 if dt == F16 else 1e5  # ±1e5 is not representable in fp16 (max 65504)
    logits = jnp.asarray([[big, -big, 0.0, 1.0], [-big, big, 2.0, 0.0]], dt)
    labels = jnp.asarray([1, 0], jnp.int32)
    loss, g = jax.jit(jax.value_and_grad(lambda x: ops.cross_entropy(x, labels, gear=gear)))(logits)
    want = 2e4 if dt == F16 else (2e5 if dt == F32 else 2 * float(jnp.asarray(1e5, BF16)))
    np.testing.assert_allclose(float(loss), want, rtol=1e-6)  # the exact loss, not a clamp
    assert bool(jnp.all(jnp.isfinite(g.astype(F32))))


@pytest.mark.parametrize("gear", GEARS)
def test_cross_entropy_padding_with_zero_probability_has_finite_gradients(gear):
    # a padding target whose fp16 probability underflows to exactly 0 (training pushes an
    # uncounted token down): masked out, so neither its loss nor its gradient may be non-finite
    logits = jnp.zeros((2, 3, 4), jnp.float16).at[1, 2, 0].set(-60000.0)
    labels = jnp.zeros((2, 3), jnp.int32)
    mask = jnp.ones((2, 3), bool).at[1, 2].set(False)
    loss, g = jax.value_and_grad(lambda x: ops.cross_entropy(x, labels, gear=gear, mask=mask))(
        logits
    )
    assert bool(jnp.isfinite(loss)) and bool(jnp.all(jnp.isfinite(g.astype(F32))))
    assert bool(jnp.all(g[1, 2] == 0))


@pytest.mark.parametrize("masked", [False, True])
def test_safe_cross_entropy_of_many_minus_inf_targets_stays_finite(masked):
    """Each -inf target logit is clamped; the clamp leaves room for all of them in the sum."""
    logits = jnp.zeros((2, 3, 4), F32).at[..., 0].set(-jnp.inf)
    labels = jnp.zeros((2, 3), jnp.int32)
    mask = jnp.ones((2, 3), bool).at[1, 2].set(False) if masked else None
    loss, g = jax.value_and_grad(lambda x: ops.cross_entropy(x, labels, gear=2, mask=mask))(logits)
    assert bool(jnp.isfinite(loss)) and float(loss) > 1e36, float(loss)
    assert bool(jnp.all(jnp.isfinite(g)))


_ce_traced_gear = jax.jit(lambda x, labels, g: ops.cross_entropy(x, labels, gear=g))


_BAD_LOGITS = {
    "nan_other_class": lambda x, lab: x.at[0, 2].set(jnp.nan),
    "nan_target": lambda x, lab: x.at[0, 0].set(jnp.nan),
    "inf_target": lambda x, lab: x.at[0, 0].set(jnp.inf),
    "inf_other_class": lambda x, lab: x.at[0, 2].set(jnp.inf),
    "label_out_of_range": lambda x, lab: x,
}


@pytest.mark.parametrize("gear", GEARS)
@pytest.mark.parametrize("case", list(_BAD_LOGITS))
def test_cross_entropy_never_hides_a_nonfinite_logit_or_a_bad_label(case, gear):
    """A NaN or +inf logit, or a label past the classes (its NaN fill), gives a non-finite loss
    in every gear: SAFE propagates what it did not create (only a -inf target is clamped)."""
    x = jnp.asarray(_rng(3).normal(size=(2, 3)), F32)
    labels = jnp.asarray([3 if case == "label_out_of_range" else 0, 1], jnp.int32)
    x = _BAD_LOGITS[case](x, labels)
    loss = _ce_traced_gear(x, labels, jnp.int32(gear))  # one compile for every case
    assert not bool(jnp.isfinite(loss)), float(loss)
    # the clean row alone is unaffected
    clean = ops.cross_entropy(x[1:], labels[1:], gear=gear)
    ref = optax.softmax_cross_entropy_with_integer_labels(x[1:], labels[1:]).mean()
    np.testing.assert_allclose(float(clean), float(ref), rtol=1e-6)


@pytest.mark.parametrize("gear", GEARS)
@pytest.mark.parametrize("dt", DTYPES, ids=_ids)
def test_router_agrees(dt, gear):
    r = _rng(8)
    x = jnp.asarray(r.normal(size=(2, 5, 8)), dt)
    kernel = jnp.asarray(r.normal(size=(8, 6)), dt)
    out = _run("router", x, kernel, top_k=2, gear=gear)
    assert out.gates.dtype == dt and out.probs.dtype == dt and out.indices.dtype == jnp.int32
    probs = ref_router_probs(_np(x), _np(kernel))
    _close(out.probs, probs, dt, scale=2)
    # the chosen experts carry the top-2 reference probabilities (robust to near-ties) ...
    chosen = np.take_along_axis(probs, np.asarray(out.indices), -1)
    best = -np.sort(-probs, -1)[..., :2]
    np.testing.assert_allclose(chosen, best, atol=TOL[dt] * 4)
    # ... and the gates are those probabilities renormalised
    _close(out.gates, chosen / chosen.sum(-1, keepdims=True), dt, scale=2)


# gradients on benign inputs: every gear's gradient matches the float64-derived FAST f32 one
GRAD_CASES = {
    "softmax": lambda x, g: jnp.sum(ops.softmax(x, gear=g) * jnp.arange(8.0)),
    "logsumexp": lambda x, g: jnp.sum(ops.logsumexp(x, gear=g) * jnp.arange(1.0, 4.0)),
    "attention": lambda x, g: jnp.sum(
        ops.attention(x[None, :, None, :4], x[None, :, None, 4:], x[None, :, None, 2:6], gear=g)
        * jnp.arange(4.0)
    ),
    "layer_norm": lambda x, g: jnp.sum(
        ops.layer_norm(x, jnp.arange(8.0), jnp.ones(8), 1e-5, gear=g) ** 2 * jnp.arange(8.0)
    ),
    "rms_norm": lambda x, g: jnp.sum(ops.rms_norm(x, jnp.arange(8.0), 1e-5, gear=g) ** 3),
    "linear": lambda x, g: jnp.sum(ops.linear(x, jnp.eye(8)[:, :5] + 0.1, None, gear=g) ** 2),
    "cross_entropy": lambda x, g: ops.cross_entropy(x, jnp.array([1, 2, 7]), gear=g),
    "router": lambda x, g: jnp.sum(
        ops.router(x, jnp.eye(8)[:, :4] * 2 + 0.1, 2, gear=g).gates * jnp.array([1.0, 3.0])
    ),
}


@pytest.mark.parametrize("name", sorted(GRAD_CASES))
def test_gradients_agree_across_gears(name):
    x = jnp.asarray(_rng(9).normal(size=(3, 8)), F32)
    grad = jax.jit(jax.grad(GRAD_CASES[name]))
    want = grad(x, jnp.int32(0))
    assert _finite(want)
    for g in (1, 2):
        np.testing.assert_allclose(grad(x, jnp.int32(g)), want, rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# adversarial inputs: the fault is real in FAST, SAFE is finite with finite gradients
#
# Each case: (dtype, make_inputs, f(inputs, gear) -> output, cotangent weights, stable_fixes)
# ``stable_fixes``: overflow faults are already fixed by STABLE (f32 accumulation); degenerate
# cases (0/0) are only defined by SAFE.


def _attention_overflow(dt):
    # fp16 q·k logits past 65504 on flax's explicit path (dropout / sow_weights: logits in the
    # input dtype): |q|,|k| = 200 along 4 dims, q / sqrt(4) -> 100 * 200 * 4 = 80000. The
    # fused path (flax's default, jax.nn.dot_product_attention) accumulates in f32: no fault.
    r = _rng(10)
    q = jnp.asarray(np.sign(r.normal(size=(1, 3, 1, 4))) * 200, dt)
    k = jnp.asarray(np.sign(r.normal(size=(1, 3, 1, 4))) * 200, dt)
    v = jnp.asarray(r.normal(size=(1, 3, 1, 4)), dt)
    return (q, k, v), lambda a, g: ops.attention(*a, gear=g, explicit=True)


def _attention_masked_row(dt):
    r = _rng(11)
    q, k, v = (jnp.asarray(r.normal(size=(1, 3, 2, 4)), dt) for _ in range(3))
    mask = jnp.ones((1, 1, 3, 3), bool).at[:, :, 1, :].set(False)  # query 1 sees nothing

    def f(a, g):
        return ops.attention(*a, mask=mask, gear=g)

    return (q, k, v), f


def _softmax_masked_row(dt):
    x = jnp.asarray(_rng(12).normal(size=(3, 6)), dt)
    where = jnp.ones((3, 6), bool).at[2].set(False)
    return (x,), lambda a, g: ops.softmax(a[0], where=where, gear=g)


def _logsumexp_fp16_sum(dt):
    # 70000 equal terms: the fp16 sum passes 65504 (FAST: log(inf) = inf)
    return (jnp.zeros((70000,), dt),), lambda a, g: ops.logsumexp(a[0], gear=g)


def _logsumexp_masked_row(dt):
    x = jnp.asarray(_rng(13).normal(size=(2, 5)), dt)
    where = jnp.ones((2, 5), bool).at[1].set(False)
    return (x,), lambda a, g: ops.logsumexp(a[0], where=where, gear=g)


def _layer_norm_constant_row(dt):
    x = jnp.asarray(_rng(14).normal(size=(3, 16)), dt).at[1].set(3.0)
    s, b = jnp.linspace(0.5, 1.5, 16), jnp.linspace(-1, 1, 16)
    return (x,), lambda a, g: ops.layer_norm(a[0], s, b, 0.0, gear=g)


def _rms_norm_zero_row(dt):
    x = jnp.asarray(_rng(15).normal(size=(3, 16)), dt).at[1].set(0.0)
    s = jnp.linspace(0.5, 1.5, 16)
    return (x,), lambda a, g: ops.rms_norm(a[0], s, 0.0, gear=g)


def _cross_entropy_fp16_large_vocab(dt):
    # 70,000 equal fp16 logits (a large vocabulary near a uniform prediction): the logsumexp's
    # sum of exp(0) passes 65504 -> inf
    logits = jnp.zeros((2, 70_000), dt).at[1, 5].set(1.0)
    labels = jnp.asarray([1, 5], jnp.int32)
    return (logits,), lambda a, g: ops.cross_entropy(a[0], labels, gear=g)


def _cross_entropy_empty_mask(dt):
    logits = jnp.asarray(_rng(16).normal(size=(2, 3, 5)), dt)
    labels = jnp.zeros((2, 3), jnp.int32)
    mask = jnp.zeros((2, 3), bool)
    return (logits,), lambda a, g: ops.cross_entropy(a[0], labels, gear=g, mask=mask)


def _router_overflow(dt):
    # fp16 scores past 65504 through the two softmaxes: x·w = 8 * 100 * 100 = 80000
    x = jnp.full((3, 8), 100.0, dt).at[:, 0].set(90.0)
    kernel = jnp.full((8, 4), 100.0, dt).at[0].set(jnp.asarray([100.0, 90.0, 80.0, 70.0], dt))
    return (x,), lambda a, g: ops.router(a[0], kernel, 2, gear=g).gates


def _linear_overflow(dt):
    x = jnp.full((2, 4), 200.0, dt)
    w = jnp.full((4, 3), 100.0, F32)
    return (x,), lambda a, g: ops.linear(a[0], w, None, gear=g)


def _rows_equal(row, value):
    """A check on SAFE's output: ``out[row] == value`` (the documented degenerate value)."""

    def check(out, dt):
        want = np.broadcast_to(_np(jnp.asarray(value, dt)), out[row].shape)
        np.testing.assert_allclose(_np(out[row]), want, atol=1e-6)

    return check


def _value(value, rtol):
    def check(out, dt):
        np.testing.assert_allclose(_np(out), value, rtol=rtol)

    return check


ADVERSARIAL = [
    # (id, builder, dtypes where the fault exists, STABLE fixes it, check of SAFE's value)
    ("attention-fp16-logits", _attention_overflow, [F16], True, None),
    ("softmax-masked-row", _softmax_masked_row, DTYPES, False, _rows_equal(2, 0.0)),
    ("logsumexp-fp16-sum", _logsumexp_fp16_sum, [F16], True, _value(np.log(70000.0), 2e-3)),
    ("logsumexp-masked-row", _logsumexp_masked_row, DTYPES, False, None),
    (
        "layer_norm-constant-row-eps0",
        _layer_norm_constant_row,
        DTYPES,
        False,
        _rows_equal(1, np.linspace(-1, 1, 16)),  # the normalised row is 0, so y = bias
    ),
    ("rms_norm-zero-row-eps0", _rms_norm_zero_row, DTYPES, False, _rows_equal(1, 0.0)),
    (
        "cross_entropy-fp16-vocab-70000",
        _cross_entropy_fp16_large_vocab,
        [F16],
        True,
        _value((np.log(70_000.0) + np.log(69_999.0 + np.e) - 1.0) / 2, 1e-5),
    ),
    ("cross_entropy-empty-mask", _cross_entropy_empty_mask, DTYPES, False, _value(0.0, 0)),
    # scores 79000 vs 78100: the gap of 900 makes the top-1 gate exactly 1
    ("router-fp16-scores", _router_overflow, [F16], True, _rows_equal(slice(None), [1.0, 0.0])),
    # STABLE accumulates in f32 and saturates the cast back to fp16 (every gear returns fp16)
    ("linear-fp16-output", _linear_overflow, [F16], True, _rows_equal(0, 65504.0)),
]
ADV_PARAMS = [
    pytest.param(build, dt, fixes, check, id=f"{name}-{_ids(dt)}")
    for name, build, dts, fixes, check in ADVERSARIAL
    for dt in dts
]


def _with_grad(f, gear):
    def loss(a):
        y = f(a, gear).astype(F32)
        w = jnp.cos(jnp.arange(y.size, dtype=F32)).reshape(y.shape)  # a generic cotangent
        return jnp.sum(y * w)

    return jax.jit(lambda a: (f(a, gear), jax.grad(loss)(a)))


@pytest.mark.parametrize("build, dt, stable_fixes, check", ADV_PARAMS)
def test_adversarial(build, dt, stable_fixes, check):
    args, f = build(dt)
    fast = jax.jit(lambda a: f(a, 0))(args)
    assert not _finite(fast), "the fault must be real: FAST gives inf/NaN"
    if stable_fixes:  # overflow: f32 accumulation already fixes it
        assert _finite(_with_grad(f, 1)(args))
    safe, safe_grad = _with_grad(f, 2)(args)
    assert safe.dtype == fast.dtype
    assert _finite(safe), "SAFE output must be finite"
    assert _finite(safe_grad), "SAFE gradient must be finite"
    if check is not None:
        check(safe, dt)


@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("explicit", [False, True])
def test_attention_masked_row_is_flax(dt, explicit):
    """A fully-masked query row: finite at FAST (flax fills with a large finite negative, so the
    row averages the values uniformly), zeros in SAFE (defined: nothing to attend to)."""
    (q, k, v), _ = _attention_masked_row(dt)
    mask = jnp.ones((1, 1, 3, 3), bool).at[:, :, 1, :].set(False)
    f = jax.jit(lambda g: ops.attention(q, k, v, mask=mask, gear=g, explicit=explicit))
    fast, safe = f(jnp.int32(0)), f(jnp.int32(2))
    assert _finite(fast) and _finite(safe)
    np.testing.assert_allclose(_np(fast[0, 1]), _np(v[0]).mean(0), rtol=TOL[dt] * 4, atol=TOL[dt])
    assert float(jnp.max(jnp.abs(safe[0, 1]))) == 0.0


def test_stable_saturates_fp16_output():
    """Every gear returns the site's dtype (one type for lax.switch): STABLE computes in f32
    and saturates the fp16 output at 65504 instead of overflowing to inf."""
    x, w = jnp.full((2, 4), 200.0, F16), jnp.full((4, 3), 100.0, F16)
    f = jax.jit(lambda g: ops.linear(x, w, None, gear=g))
    fast, stable = f(jnp.int32(0)), f(jnp.int32(1))
    assert fast.dtype == stable.dtype == F16
    assert not _finite(fast) and float(stable[0, 0]) == 65504.0
    xb = jnp.full((2, 4), 200.0, BF16)
    assert jax.jit(lambda g: ops.linear(xb, w, None, gear=g))(jnp.int32(1)).dtype == BF16


@pytest.mark.parametrize("bias", [False, True])
def test_safe_linear_computes_from_f32_weights_an_fp16_cast_overflows(bias):
    """f32 weights of an fp16 layer, one past 65504, passed as stored: FAST and STABLE cast
    them to fp16 (flax's promotion), so FAST is inf and STABLE saturates; SAFE casts them to
    f32 and computes what the float64 reference does, with finite gradients for the weights.
    Weights already in fp16 give every gear what they gave when cast outside the op."""
    r = _rng(23)
    w = r.normal(size=(4, 3)).astype(np.float32)
    w[0, 1] = 1e5
    b = r.normal(size=(3,)).astype(np.float32) if bias else None
    x = jnp.asarray((r.normal(size=(2, 4)) * 1e-3).astype(np.float16))
    run = jax.jit(lambda g, w, b: ops.linear(x, w, b, gear=g))
    fast, stable, safe = (run(jnp.int32(g), w, b) for g in range(3))
    assert fast.dtype == stable.dtype == safe.dtype == F16
    assert not _finite(fast) and float(jnp.max(jnp.abs(stable))) == 65504.0
    ref = np.asarray(x, np.float64) @ w.astype(np.float64) + (0.0 if b is None else b)
    np.testing.assert_allclose(np.asarray(safe, np.float64), ref, rtol=2e-3, atol=1e-3)
    loss = lambda w, b: jnp.sum(run(jnp.int32(2), w, b).astype(F32))
    grads = jax.grad(loss, (0, 1) if bias else 0)(w, b)
    assert _finite(grads)
    w16 = jnp.asarray(np.clip(w, -6e4, 6e4), F16)
    b16 = None if b is None else jnp.asarray(b, F16)
    for g in range(3):  # the same weights given in fp16: the cast inside the op is a no-op
        np.testing.assert_array_equal(
            run(jnp.int32(g), w16, b16), run(jnp.int32(g), w16.astype(F32), b16)
        )


def test_safe_attention_beyond_f32_range():
    """Range compression: logits past f32's max still give the exact softmax in SAFE."""
    q = jnp.asarray([[[[1e20, 0.0]], [[-1e20, 0.0]]]], F32)  # [1, 2, 1, 2]
    k = q
    v = jnp.asarray([[[[1.0, 2.0]], [[3.0, 4.0]]]], F32)
    f = jax.jit(lambda q, k, v, g: ops.attention(q, k, v, gear=g, scale=1.0))
    y = f(q, k, v, jnp.int32(2))
    # logits: row 0 = [1e40, -1e40], row 1 = [-1e40, 1e40] -> one-hot on the diagonal
    np.testing.assert_allclose(y[0, :, 0], [[1.0, 2.0], [3.0, 4.0]])
    assert not _finite(f(q, k, v, jnp.int32(1)))


@pytest.mark.parametrize("op", ["attention", "router"])
def test_a_safe_probe_past_the_f32_range_reads_f32s_max_and_makes_no_inf(op):
    """SAFE computes logits past f32's max right; its logits probe, scaled back from the
    compressed form, reads f32's max, not inf: a model probe that reads an inf
    is an incident, which would send a SAFE site that works back to tier 2 on every step. (The
    probe's own sum of squares of such values still saturates through an inf: ``probe.stats``.)
    """
    q = jnp.asarray([[[[1e20, 0.0]], [[-1e20, 0.0]]]], F32)  # logits +-1e40
    if op == "router":
        x, kernel = q[0, :, 0], jnp.asarray([[1e20, -1e20], [0.0, 0.0]], F32)

        def f(x):
            return ops.router(x, kernel, 1, gear=Gear.SAFE, return_stats=True)[1]["logits"]

    else:
        x = q

        def f(q):
            return ops.attention(q, q, q, gear=Gear.SAFE, scale=1.0, return_stats=True)[1]["logits"]

    st = jax.jit(f)(x)
    big = float(jnp.finfo(F32).max)
    assert float(st[probe.MAX_ABS]) == big and float(st[probe.NONFINITE]) == 0.0


@pytest.mark.parametrize("gear", GEARS)
def test_the_input_rms_probe_of_a_row_whose_mean_squares_past_f32_is_finite(gear):
    """A row near 3e19 with a small spread: its two-pass variance is finite and so is the
    norm, but ``mean²`` passes f32's max. The probe reads ``hypot(std, mean)``, the row's
    RMS (against float64), where ``sqrt(var + mean²)`` read inf and made every healthy step an
    incident (newuser45). FAST's one-pass variance (flax's default) squares the inputs
    themselves: inf there is the model's own, and the probe reads it."""
    r = _rng(45)
    x = jnp.asarray(3e19 + r.normal(size=(3, 16)) * 1e17, F32)
    want = np.sqrt(np.mean(np.asarray(x, np.float64) ** 2, -1)).max()
    run = jax.jit(
        lambda x, fast: ops.layer_norm(
            x, None, None, 1e-5, gear=gear, use_fast_variance=fast, return_stats=True
        ),
        static_argnums=1,
    )
    y, st = run(x, False)
    assert _finite(y)
    assert float(st["input_rms"][probe.NONFINITE]) == 0.0
    np.testing.assert_allclose(float(st["input_rms"][probe.MAX_ABS]), want, rtol=1e-5)
    if gear == Gear.FAST:
        assert float(run(x, True)[1]["input_rms"][probe.NONFINITE]) == 3.0  # every row


@pytest.mark.parametrize("dtype", [F32, jnp.bfloat16])
@pytest.mark.parametrize("op", ["attention", "router"])
def test_safe_gradients_past_the_f32_range_are_finite_under_jit(op, dtype):
    """SAFE undoes the range compression one power of two at a time; XLA folded the two into
    one product, inf once the exponents sum past 127, and ``0 * inf`` made the jitted gradient
    NaN where the eager one was finite (newuser28). Both agree now."""
    rng = _rng(4)
    if op == "router":
        kernel = jnp.asarray(rng.normal(size=(5, 4)), F32) * 1e10
        x = (jnp.asarray(rng.normal(size=(3, 5)), F32) * 1e30).astype(dtype)

        def f(x):
            gates = ops.router(x, kernel.astype(dtype), 2, gear=Gear.SAFE).gates
            return jnp.sum(gates.astype(F32) * jnp.asarray([1.0, 2.0]))

    else:
        k = jnp.asarray(rng.normal(size=(1, 4, 2, 4)), F32)
        x = (jnp.asarray(rng.normal(size=(1, 3, 2, 4)), F32) * 1e20).astype(dtype)

        def f(x):
            y = ops.attention(x, (k * 1e20).astype(dtype), k.astype(dtype), gear=Gear.SAFE)
            return jnp.sum(y.astype(F32))

    eager, jitted = jax.grad(f)(x), jax.jit(jax.grad(f))(x)
    assert _finite(eager) and _finite(jitted)
    np.testing.assert_array_equal(np.asarray(eager, F32), np.asarray(jitted, F32))


@pytest.mark.parametrize("traced", [False, True])
@pytest.mark.parametrize("gear", [0, 1, 2])
def test_an_empty_axis_gives_the_empty_result_at_every_gear(gear, traced):
    """``[2, 0]`` in, as ``jax.nn`` and ``flax.nnx`` give: the sampled probe rows, the kernels'
    row layout and SAFE's ``max`` failed on it (``ZeroDivisionError``, ``ValueError``), at
    FAST too when the gear is traced (every branch is)."""
    x = jnp.ones((2, 0), F32)
    g = jnp.int32(gear) if traced else gear
    calls = {
        "softmax": lambda x, g: ops.softmax(x, gear=g),
        "layer_norm": lambda x, g: ops.layer_norm(x, None, None, gear=g),
        "rms_norm": lambda x, g: ops.rms_norm(x, None, gear=g),
    }
    for name, f in calls.items():
        run = jax.jit(f) if traced else f
        assert run(x, g).shape == (2, 0), name
        grad = jax.grad(lambda x, f=f: jnp.sum(f(x, g)))(x)
        assert grad.shape == (2, 0), name
    lse = ops.logsumexp(x, gear=g)
    want = -np.inf if gear < 2 else np.log(np.finfo(np.float32).tiny)  # SAFE's clamped log
    np.testing.assert_allclose(np.asarray(lse), [want, want], rtol=1e-6)


@pytest.mark.parametrize("gear", [0, 1, 2])
def test_attention_takes_a_value_dim_other_than_the_head_dim(gear):
    """``v: [b, k, kv_heads, v_dim]`` as documented: the fused FAST path reshaped its output to
    the query's head dim and raised at FAST, at f32 STABLE and at every traced gear."""
    rng = _rng(0)
    q = jnp.asarray(rng.normal(size=(1, 2, 1, 4)), F32)
    k = jnp.asarray(rng.normal(size=(1, 3, 1, 4)), F32)
    v = jnp.asarray(rng.normal(size=(1, 3, 1, 2)), F32)
    logits = np.einsum("bqhd,bkhd->bhqk", np.float64(q), np.float64(k)) / 2.0
    p = np.exp(logits - logits.max(-1, keepdims=True))
    want = np.einsum("bhqk,bkhd->bqhd", p / p.sum(-1, keepdims=True), np.float64(v))
    for y in (ops.attention(q, k, v, gear=gear), jax.jit(ops.attention)(q, k, v, gear=gear)):
        np.testing.assert_allclose(np.asarray(y), want, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# the gear as data


def test_switching_gear_never_recompiles(count_compiles):
    x = jnp.asarray(_rng(17).normal(size=(2, 5, 2, 4)), F32)
    f = jax.jit(lambda x, g: ops.attention(x, x, x, causal=True, gear=g))
    gears = [jnp.int32(g) for g in (0, 1, 2, 1, 0)]
    f(x, gears[0]).block_until_ready()
    with count_compiles() as c:
        outs = [f(x, g) for g in gears]
        jax.block_until_ready(outs)
    assert c.count == 0


def test_python_int_gear_dispatches_directly():
    x = jnp.ones((2, 3))
    jaxpr = str(jax.make_jaxpr(lambda x: ops.softmax(x, gear=2))(x))
    assert "cond" not in jaxpr and "custom_vjp" in jaxpr  # only the SAFE path was traced
    jaxpr = str(jax.make_jaxpr(lambda x, g: ops.softmax(x, gear=g))(x, 0))
    assert "cond[" in jaxpr


@pytest.mark.parametrize("name", ["softmax", "layer_norm"])
def test_python_and_traced_gears_agree(name):
    x = jnp.asarray(_rng(18).normal(size=(2, 3, 2, 4)), F32)
    call = {
        "softmax": lambda g: ops.softmax(x, gear=g),
        "layer_norm": lambda g: ops.layer_norm(x, None, None, 1e-6, gear=g),
        "attention": lambda g: ops.attention(x, x, x, gear=g),
    }[name]
    traced = jax.jit(call)
    for g in GEARS:
        direct = jax.jit(functools.partial(call, g))()
        np.testing.assert_allclose(direct, traced(jnp.int32(g)), rtol=1e-6, atol=1e-6)


def test_bad_gears_raise():
    x = jnp.ones((2, 3))
    for concrete in (3, -1, np.int32(5), jnp.int32(5), jnp.int32(-1)):
        with pytest.raises(ValueError, match="gear must be one of"):
            ops.softmax(x, gear=concrete)
    for not_int in (2.0, jnp.float32(1.0), True, np.bool_(False)):
        with pytest.raises(ValueError, match="gear must be an integer"):
            ops.softmax(x, gear=not_int)
    with pytest.raises(ValueError, match="gear must be an integer"):
        jax.make_jaxpr(lambda g: ops.softmax(x, gear=g))(jnp.float32(1.0))
    for good in (np.int64(2), jnp.int32(1), Gear.SAFE):
        ops.softmax(x, gear=good)
    with pytest.raises(ValueError, match="gear must be a scalar"):
        jax.make_jaxpr(lambda g: ops.softmax(x, gear=g))(jnp.zeros((4,), jnp.int32))


@pytest.mark.parametrize("gear", [-1, -5, 0, 3])
def test_a_traced_gear_out_of_range_is_clamped_in_the_backward_too(gear):
    """``lax.switch`` clamps a traced index: -1 runs FAST, 3 SAFE. FAST's saved residuals are
    kept at FAST only (zeros above it, where the backward drops FAST's pullback); a gear of -1
    ran FAST forward but its backward read zeros: gradients of 0, silently (review20)."""
    x = jnp.linspace(0.5, 2.0, 8).reshape(2, 4)
    w = jnp.full((4,), 2.0)

    def f(x, w, g):
        return jnp.sum(ops.layer_norm(x * w, None, None, 1e-6, gear=g) * x)

    clamped = min(max(gear, 0), 2)
    want = jax.grad(f, argnums=(0, 1))(x, w, clamped)  # a concrete gear: that branch alone
    got = jax.jit(jax.grad(f, argnums=(0, 1)))(x, w, jnp.int32(gear))
    # (w's gradient is 0 in exact arithmetic, a LayerNorm ignoring its input's scale: what is
    # left, ~1e-5, is rounding, which moves with how XLA fuses the two programs; x's is ~1)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def _primitives(jaxpr) -> set[str]:
    """Every primitive name in ``jaxpr``, through call-like equations (``custom_vjp_call``)."""
    names = set()
    for e in jaxpr.eqns:
        names.add(e.primitive.name)
        for p in e.params.values():
            inner = getattr(p, "jaxpr", p)
            if hasattr(inner, "eqns"):
                names |= _primitives(inner)
    return names


def test_vmap_behaviour():
    """Unbatched gear under vmap: still a one-branch cond. Batched gear: select over all."""
    x = jnp.ones((4, 3))
    f = lambda x, g: ops.softmax(x, gear=g)
    unbatched = str(jax.make_jaxpr(jax.vmap(f, in_axes=(0, None)))(x, jnp.int32(1)))
    assert "cond[" in unbatched
    batched = jax.make_jaxpr(jax.vmap(f))(x, jnp.zeros(4, jnp.int32))
    names = _primitives(batched.jaxpr)
    assert "cond" not in names and "select_n" in names  # all three computed, then selected
    # the values are still per-element gears' results
    g = jnp.asarray([0, 1, 2, 0], jnp.int32)
    np.testing.assert_allclose(jax.jit(jax.vmap(f))(x, g), jax.nn.softmax(x), rtol=1e-6)


def test_return_stats():
    x = jnp.asarray(_rng(19).normal(size=(2, 4, 2, 4)), F16)

    @jax.jit
    def run(x, g):
        _, st_attn = ops.attention(x, x, x, causal=True, gear=g, return_stats=True)
        _, st_ln = ops.layer_norm(x, None, None, 1e-6, gear=g, return_stats=True)
        c = jnp.ones((2, 8), F32)  # a degenerate row for eps=0
        _, st_deg = ops.layer_norm(c, None, None, 0.0, gear=g, return_stats=True)
        return st_attn, st_ln, st_deg

    for g in GEARS:
        st_attn, st_ln, st_deg = run(x, jnp.int32(g))
        assert set(st_attn) == {"logits", "probs"} and st_attn["logits"].shape == (5,)
        assert float(st_attn["probs"][3]) == 0.0  # no non-finite probabilities
        assert st_ln["inv_std"].dtype == F32 and float(st_ln["inv_std"][0]) > 0
        # the degenerate rows are visible in the FAST/STABLE probe (inf inverse std: 2 rows
        # non-finite); SAFE defines them (inverse std 0, all finite)
        assert float(st_deg["inv_std"][3]) == (0.0 if g == 2 else 2.0)


@pytest.mark.parametrize(
    "dt, norm, masked",
    # every dtype, both norms, with and without a mask; one compile of all three gears each
    [
        (F32, "layer_norm", False),
        (BF16, "rms_norm", True),
        (F16, "layer_norm", True),
        (F16, "rms_norm", False),
    ],
    ids=lambda v: _ids(v) if not isinstance(v, (str, bool)) else str(v),
)
def test_norm_input_rms_probe_matches_the_numpy_reference(dt, norm, masked):
    """Every gear's ``input_rms``: the per-row sqrt(E[x²]) of the (masked) input, in x's dtype;
    in FAST an input that overflowed is counted as non-finite, not averaged in. Its headroom is
    against where the gear's statistics overflow: 2**64 (the f32 square) in FAST and STABLE
    below fp16, the dtype's max in SAFE (range-compressed)."""
    r = _rng(23)
    x = np.asarray(r.normal(size=(3, 16)) * np.array([[1.0], [40.0], [0.01]]) + 0.5, np.float32)
    mask = r.random((3, 16)) > 0.3 if masked else None
    args = (None, None) if norm == "layer_norm" else (None,)

    @jax.jit
    def run(x, g):
        return getattr(ops, norm)(x, *args, 1e-5, gear=g, mask=mask, return_stats=True)[1]

    xd = jnp.asarray(x, dt)
    xs = np.asarray(xd, np.float64)
    sq = np.where(mask, xs**2, 0.0).sum(-1) / mask.sum(-1) if masked else (xs**2).mean(-1)
    want = np.sqrt(sq)
    for g in GEARS:
        st = run(xd, jnp.int32(g))["input_rms"]
        assert st.shape == (5,) and float(st[3]) == 0.0  # nothing non-finite
        eps = float(jnp.finfo(dt).eps)
        np.testing.assert_allclose(float(st[0]), want.max(), rtol=2 * eps)
        limit = float(jnp.finfo(dt).max)
        limit = limit if g == 2 else min(limit, 2.0**64)
        head = want.max() / limit  # f32's max: ~1e-37, may flush to 0 on CPU
        np.testing.assert_allclose(float(st[4]), head, rtol=0.01, atol=1e-30)
    st = run(xd.at[1, 2].set(jnp.inf), jnp.int32(0))["input_rms"]
    assert float(st[3]) == 1.0  # the row that holds the inf


@pytest.mark.parametrize(
    "dt, norm, shape, masked",
    # every dtype and both norms; rows strided (4096 rows of 8 > PROBE_SAMPLE) or not, 1-D
    [
        (F32, "layer_norm", (4, 1024, 8), False),
        (BF16, "rms_norm", (4096, 8), True),
        (F16, "layer_norm", (3, 16), True),
        (F16, "rms_norm", (16,), False),
    ],
    ids=lambda v: _ids(v) if not isinstance(v, (str, bool, tuple)) else str(v),
)
def test_norm_output_probe_is_the_sampled_stats_of_the_output(dt, norm, shape, masked):
    """Every gear's ``output`` statistic is ``probe.sampled_stats`` of what it returns (FAST
    recomputes the sampled rows from the same rows of x; its output then needs no second read),
    and a statistic left out of ``stats`` is not computed."""
    r = _rng(29)
    x = jnp.asarray(r.normal(size=shape) * 3.0 + 0.5, dt)
    mask = jnp.asarray(r.random(shape) > 0.3) if masked else None
    d = shape[-1]
    scale = jnp.asarray(r.normal(size=d), dt)
    args = (scale, jnp.asarray(r.normal(size=d), dt)) if norm == "layer_norm" else (scale,)

    @jax.jit
    def run(x, g):
        return getattr(ops, norm)(x, *args, 1e-5, gear=g, mask=mask, return_stats=True)

    for g in GEARS:
        y, st = run(x, jnp.int32(g))
        want = np.asarray(probe.sampled_stats(y))
        np.testing.assert_allclose(np.asarray(st["output"]), want, rtol=1e-5, atol=1e-30)
    _, st = getattr(ops, norm)(x, *args, 1e-5, mask=mask, return_stats=True, stats=("inv_std",))
    assert set(st) == {"inv_std"}
    with pytest.raises(ValueError, match="stats"):
        getattr(ops, norm)(x, *args, return_stats=True, stats=("logits",))


def test_input_errors():
    x = jnp.ones((2, 3, 2, 4))
    with pytest.raises(ValueError, match="attention"):
        ops.attention(x[0], x, x)
    with pytest.raises(ValueError, match="kernel"):
        ops.linear(jnp.ones((2, 3)), jnp.ones((4, 5)))
    with pytest.raises(ValueError, match="top_k"):
        ops.router(jnp.ones((2, 3)), jnp.ones((3, 4)), 5)
    with pytest.raises(TypeError, match="labels"):
        ops.cross_entropy(jnp.ones((2, 3)), jnp.ones((2,)))
