"""Tests for nan2safe_jax.kernels: every kernel against its jnp reference and against exact
(``math.fsum`` / float64 NumPy) results, on adversarial data.

Pallas runs in interpret mode on CPU; ``NAN2SAFE_KERNEL_INTERPRET=0`` (benchmarks/gpu_check.sh)
runs the same tests with compiled kernels on a GPU.
"""

from __future__ import annotations

import math
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tiny_models import jit_llvm_default

from nan2safe_jax import kernels, ops
from nan2safe_jax.kernels import _common
from nan2safe_jax.kernels.norms import reference as norms_ref
from nan2safe_jax.kernels.softmax import reference as softmax_ref

IMPLS = ["pallas", "reference"]
DTYPES = [jnp.float16, jnp.bfloat16, jnp.float32]
# dtype x implementation: the kernel in every dtype; the reference's half dtypes are slow-marked
DTYPE_IMPLS = [pytest.param(d, "pallas", id=f"pallas-{jnp.dtype(d).name}") for d in DTYPES] + [
    pytest.param(
        d,
        "reference",
        id=f"reference-{jnp.dtype(d).name}",
        marks=() if d == jnp.float32 else pytest.mark.slow,
    )
    for d in DTYPES
]
# Output tolerance (max abs error of a value of magnitude ~1) for ops that store in x.dtype:
# a couple of ulps of the dtype (eps: f16 9.8e-4, bf16 7.8e-3, f32 1.2e-7).
OUT_TOL = {jnp.float16: 2e-3, jnp.bfloat16: 1.6e-2, jnp.float32: 1e-6}
F32_ULP_TOL = 4  # sums are f32 whatever the input: a few f32 ulps of the exact sum


def f32_ulps(value: float, exact: float) -> float:
    return abs(value - exact) / float(np.spacing(np.float32(abs(exact))))


def adversarial_cancellation(n: int, seed: int = 0) -> np.ndarray:
    """n float32 values: +1e8 and -1e8 (a quarter each, cancelling exactly) and small terms
    in [0, 1), randomly interleaved, so every summation order meets heavy cancellation."""
    rng = np.random.default_rng(seed)
    k = n // 4
    x = np.concatenate([np.full(k, 1e8), np.full(k, -1e8), rng.uniform(0, 1, n - 2 * k)])
    return x.astype(np.float32)[rng.permutation(n)]


def has_pallas_call(fn, *args) -> bool:
    return "pallas_call" in str(jax.make_jaxpr(fn)(*args))


# ---------------------------------------------------------------------------------------------
# public surface


def test_public_names():
    for name in kernels.__all__:
        assert callable(getattr(kernels, name))
    assert set(kernels.__all__) == {
        "safe_sum",
        "safe_mean",
        "safe_softmax",
        "safe_layer_norm",
        "safe_rms_norm",
    }


def test_dispatch():
    x = jnp.ones((4, 8), jnp.float32)
    assert has_pallas_call(lambda x: kernels.safe_sum(x, implementation="pallas"), x)
    assert not has_pallas_call(lambda x: kernels.safe_sum(x, implementation="reference"), x)
    if jax.default_backend() == "cpu":  # None on CPU: the jnp reference (Pallas only interprets)
        assert not has_pallas_call(lambda x: kernels.safe_softmax(x), x)
    with pytest.raises(ValueError, match="implementation must be one of"):
        kernels.safe_sum(x, implementation="triton")
    with pytest.raises(TypeError, match="floating dtype"):
        kernels.safe_softmax(jnp.ones(3, jnp.int32))
    with pytest.raises(ValueError, match="scale must have shape"):
        kernels.safe_layer_norm(x, jnp.ones(7), None)
    with pytest.raises(ValueError, match="zero elements"):
        kernels.safe_mean(jnp.ones((0, 3)), axis=0)


# ---------------------------------------------------------------------------------------------
# safe_sum / safe_mean


@pytest.mark.parametrize("impl", IMPLS)
def test_sum_1m_cancellation_beats_naive(impl):
    """1M elements, alternating-sign 1e8 with small terms: compensated f32 within a few ulps
    of math.fsum, naive f32 (sequential and XLA's jnp.sum) off by orders of magnitude. This is
    also the check that no compiler folded the compensation terms away."""
    x = adversarial_cancellation(1 << 20)
    exact = math.fsum(x.astype(np.float64))
    got, count = kernels.safe_sum(
        jnp.asarray(x).reshape(8, -1), implementation=impl, with_count=True
    )
    naive_seq = float(np.cumsum(x, dtype=np.float32)[-1])
    naive_xla = float(jnp.sum(jnp.asarray(x)))
    print(
        f"\n[{impl}] exact={exact:.4f} compensated={float(got):.4f} "
        f"({f32_ulps(float(got), exact):.2f} ulp) naive_seq={naive_seq:.1f} "
        f"({f32_ulps(naive_seq, exact):.3g} ulp) naive_jnp={naive_xla:.1f} "
        f"({f32_ulps(naive_xla, exact):.3g} ulp)"
    )
    assert got.dtype == jnp.float32 and int(count) == 0
    assert f32_ulps(float(got), exact) <= F32_ULP_TOL
    assert f32_ulps(naive_seq, exact) > 1000
    assert f32_ulps(naive_xla, exact) > 1000


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("impl", IMPLS)
def test_sum_rows_vs_fsum(dtype, impl):
    rng = np.random.default_rng(1)
    x = rng.normal(size=(6, 3000)) * np.where(rng.uniform(size=(6, 3000)) < 0.1, 1e3, 1.0)
    x = np.asarray(jnp.asarray(x, dtype).astype(jnp.float32))  # the exact values in dtype
    got = kernels.safe_sum(jnp.asarray(x, dtype), axis=1, implementation=impl)
    ref = kernels.safe_sum(jnp.asarray(x, dtype), axis=1, implementation="reference")
    assert got.dtype == jnp.float32
    for r in range(x.shape[0]):
        exact = math.fsum(x[r].astype(np.float64))
        assert f32_ulps(float(got[r]), exact) <= F32_ULP_TOL, (r, float(got[r]), exact)
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=4e-7, atol=0)


@pytest.mark.parametrize("impl", IMPLS)
def test_sum_fp16_near_max(impl):
    """Values near fp16 max: a naive fp16 sum overflows, the f32 accumulation does not."""
    rng = np.random.default_rng(2)
    x = rng.uniform(60000, 65504, size=(8, 8192)).astype(np.float16)
    got, count = kernels.safe_sum(jnp.asarray(x), implementation=impl, with_count=True)
    exact = math.fsum(x.astype(np.float64).ravel())
    with np.errstate(over="ignore"):
        naive = np.cumsum(x.ravel(), dtype=np.float16)[-1]
    assert np.isinf(naive)
    assert int(count) == 0 and np.isfinite(float(got))
    assert f32_ulps(float(got), exact) <= F32_ULP_TOL


AXES = [None, 0, -1, (0, 2), (2, 0, 1)]


@pytest.mark.parametrize("impl", IMPLS)
def test_sum_mean_axes(impl):
    rng = np.random.default_rng(3)
    x = rng.normal(size=(3, 5, 7)).astype(np.float32)
    # one jit for all axes: one compile instead of ten
    sums, means = jax.jit(
        lambda x: (
            [kernels.safe_sum(x, a, implementation=impl) for a in AXES],
            [kernels.safe_mean(x, a, implementation=impl) for a in AXES],
        )
    )(x)
    for axis, got, mean in zip(AXES, sums, means, strict=True):
        exp = np.sum(x.astype(np.float64), axis=axis)
        assert got.shape == np.shape(exp)
        np.testing.assert_allclose(np.asarray(got), exp, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(np.asarray(mean), np.mean(x.astype(np.float64), axis), rtol=1e-6)


@pytest.mark.parametrize("impl", IMPLS)
def test_sum_nonfinite_semantics(impl):
    x = jnp.array(
        [[1.0, jnp.inf, 2.0, 0.0], [1.0, jnp.inf, -jnp.inf, 0.0], [1.0, jnp.nan, 2.0, 3.0]]
    )
    got, count = kernels.safe_sum(x, axis=1, implementation=impl, with_count=True)
    assert np.asarray(got)[0] == np.inf
    assert np.isnan(np.asarray(got)[1:]).all()
    assert int(count) == 4
    # -inf row (the "row of -inf" case): -inf, every entry counted
    got, count = kernels.safe_sum(jnp.full((1, 4096), -jnp.inf), implementation=impl, with_count=1)
    assert float(got) == -np.inf and int(count) == 4096


@pytest.mark.parametrize("impl", IMPLS)
def test_sum_grad_jit_vmap(impl):
    x = jnp.arange(24.0, dtype=jnp.float32).reshape(2, 3, 4)
    g = jax.grad(lambda x: kernels.safe_mean(x, (0, 2), implementation=impl).sum())(x)
    np.testing.assert_allclose(np.asarray(g), np.full(x.shape, 1 / 8))
    g16 = jax.grad(lambda x: kernels.safe_sum(x, implementation=impl))(x.astype(jnp.float16))
    assert g16.dtype == jnp.float16 and float(g16.min()) == 1.0
    f = jax.jit(jax.vmap(lambda r: kernels.safe_sum(r, implementation=impl, with_count=True)))
    s, c = f(x)
    np.testing.assert_allclose(np.asarray(s), np.asarray(x).sum(axis=(1, 2)))
    assert c.shape == (2,)


def test_sum_f64_accumulation_under_x64():
    x = adversarial_cancellation(1 << 16, seed=4)
    exact = math.fsum(x.astype(np.float64))
    with jax.enable_x64(True):
        for impl in IMPLS:
            got = kernels.safe_sum(jnp.asarray(x), implementation=impl)
            assert got.dtype == jnp.float64
            assert abs(float(got) - exact) <= 1e-6 * abs(exact)


# ---------------------------------------------------------------------------------------------
# safe_softmax


def softmax64(x: np.ndarray, mask: np.ndarray | None = None) -> np.ndarray:
    x = x.astype(np.float64)
    valid = np.ones(x.shape, bool) if mask is None else mask
    m = np.max(np.where(valid, x, -np.inf), axis=-1, keepdims=True)
    e = np.where(valid, np.exp(x - np.where(np.isfinite(m), m, 0)), 0)
    d = e.sum(-1, keepdims=True)
    return np.where(d > 0, e / np.where(d > 0, d, 1), 0)


@pytest.mark.parametrize("dtype, impl", DTYPE_IMPLS)
def test_softmax_vs_f64(dtype, impl):
    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.normal(size=(4, 9, 300)) * 8, dtype)
    mask = rng.uniform(size=(9, 300)) > 0.4
    xf = np.asarray(x.astype(jnp.float32))
    configs = [(-1, None), (-1, mask), (1, None)]

    def run(x, implementation):
        return [
            kernels.safe_softmax(x, axis=a, where=w, implementation=implementation)
            for a, w in configs
        ]

    outs = jax.jit(run, static_argnums=1)(x, impl)
    # kernel vs reference at f32 precision (the half dtypes are checked against f64 only)
    compare = impl == "pallas" and dtype == jnp.float32
    refs = jax.jit(run, static_argnums=1)(x, "reference") if compare else outs
    for (axis, where), got, ref in zip(configs, outs, refs, strict=True):
        assert got.dtype == dtype
        exp = np.moveaxis(
            softmax64(
                np.moveaxis(xf, axis, -1),
                None if where is None else np.broadcast_to(where, xf.shape),
            ),
            -1,
            axis,
        )
        np.testing.assert_allclose(np.asarray(got.astype(jnp.float32)), exp, atol=OUT_TOL[dtype])
        np.testing.assert_allclose(
            np.asarray(got.astype(jnp.float32)), np.asarray(ref.astype(jnp.float32)), atol=1e-6
        )


@pytest.mark.parametrize("impl", IMPLS)
def test_softmax_degenerate_rows(impl):
    x = np.random.default_rng(6).normal(size=(6, 40)).astype(np.float32)
    x[1] = -np.inf  # a row of -inf -> zeros
    x[2, [3, 9]] = np.inf  # +inf entries share the mass
    x[3, 5] = np.nan  # NaN propagates to its row (never created elsewhere)
    x[4, :] = [60000.0, -60000.0] * 20  # near fp16 max: max subtraction keeps exp() <= 1
    mask = np.ones_like(x, bool)
    mask[5] = False  # fully masked -> zeros
    y, count = kernels.safe_softmax(
        jnp.asarray(x), where=mask, implementation=impl, with_count=True
    )
    y = np.asarray(y)
    np.testing.assert_array_equal(y[1], 0)
    np.testing.assert_array_equal(y[5], 0)
    np.testing.assert_allclose(y[2, [3, 9]], 0.5)
    assert y[2].sum() == 1.0
    assert np.isnan(y[3]).all() and np.isfinite(np.delete(y, 3, axis=0)).all()
    np.testing.assert_allclose(y[0], softmax64(x[0]), atol=1e-6)
    np.testing.assert_allclose(y[4, ::2], 0.05, rtol=1e-6)
    assert int(count) == 40 + 2 + 1
    # fp16 near max: a naive fp16 exp-sum overflows, the safe one does not
    y16 = kernels.safe_softmax(jnp.asarray(x[4:5], jnp.float16), implementation=impl)
    assert np.isfinite(np.asarray(y16, np.float32)).all()


@pytest.mark.parametrize("impl", IMPLS)
def test_softmax_grad(impl):
    rng = np.random.default_rng(7)
    x = jnp.asarray(rng.normal(size=(5, 33)), jnp.float32)
    mask = np.ones((5, 33), bool)
    mask[2] = False
    mask[3, ::2] = False
    w = jnp.asarray(rng.normal(size=(5, 33)), jnp.float32)

    def loss(f):
        return lambda x: jnp.sum(f(x) * w)

    g = jax.grad(loss(lambda x: kernels.safe_softmax(x, where=mask, implementation=impl)))(x)
    g_ref = jax.grad(loss(lambda x: jax.nn.softmax(x, where=mask)))(x)
    g = np.asarray(g)
    np.testing.assert_array_equal(g[2], 0)  # fully masked row: zero gradient
    keep = np.array([0, 1, 3, 4])
    np.testing.assert_allclose(g[keep], np.asarray(g_ref)[keep], atol=1e-6)
    # the reference's own autodiff (the documented fallback) is finite too
    xm = x.at[1].set(-jnp.inf)
    g_raw = jax.grad(
        lambda x: jnp.sum(softmax_ref.softmax_rows(x, jnp.asarray(mask), jnp.float32)[0] * w)
    )(xm)
    assert np.isfinite(np.asarray(g_raw)).all()
    np.testing.assert_array_equal(np.asarray(g_raw)[2], 0)


@pytest.mark.parametrize("impl", IMPLS)
def test_softmax_1m_compensated_denominator(impl):
    """8 rows of 131072: the compensated denominator matches float64 NumPy to f32 rounding."""
    rng = np.random.default_rng(8)
    x = (rng.normal(size=(8, 131072)) * 4).astype(np.float32)
    y = np.asarray(kernels.safe_softmax(jnp.asarray(x), implementation=impl))
    np.testing.assert_allclose(y, softmax64(x), rtol=2e-6, atol=1e-12)
    np.testing.assert_allclose(y.astype(np.float64).sum(-1), 1.0, rtol=1e-6)


# ---------------------------------------------------------------------------------------------
# safe_layer_norm / safe_rms_norm


def layer_norm64(x, scale, bias, eps):
    x = x.astype(np.float64)
    m = x.mean(-1, keepdims=True)
    v = ((x - m) ** 2).mean(-1, keepdims=True)
    y = (x - m) / np.sqrt(v + eps)
    return y * (1 if scale is None else scale) + (0 if bias is None else bias)


def rms_norm64(x, scale, eps):
    x = x.astype(np.float64)
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * (1 if scale is None else scale)


@pytest.mark.parametrize("dtype, impl", DTYPE_IMPLS)
def test_norms_vs_f64(dtype, impl):
    rng = np.random.default_rng(9)
    x = jnp.asarray(rng.normal(size=(3, 10, 384)) * 3 + 2, dtype)
    scale = jnp.asarray(rng.normal(size=384), jnp.float32)
    bias = jnp.asarray(rng.normal(size=384), jnp.float32)
    xf = np.asarray(x.astype(jnp.float32))

    @jax.jit
    def run(x, scale, bias):
        return (
            kernels.safe_layer_norm(x, scale, bias, 1e-6, implementation=impl),
            kernels.safe_layer_norm(x, None, None, 1e-6, implementation=impl),
            kernels.safe_rms_norm(x, scale, 1e-6, implementation=impl),
            kernels.safe_rms_norm(x, None, 1e-6, implementation=impl),
        )

    ln_sb, ln, rms_s, rms = run(x, scale, bias)
    s, b = np.asarray(scale), np.asarray(bias)
    expected = [
        (ln_sb, layer_norm64(xf, s, b, 1e-6)),
        (ln, layer_norm64(xf, None, None, 1e-6)),
        (rms_s, rms_norm64(xf, s, 1e-6)),
        (rms, rms_norm64(xf, None, 1e-6)),
    ]
    for got, exp in expected:
        assert got.dtype == dtype and got.shape == x.shape
        tol = OUT_TOL[dtype] * max(1.0, np.abs(exp).max())
        np.testing.assert_allclose(np.asarray(got.astype(jnp.float32)), exp, atol=tol)


@pytest.mark.parametrize("impl", IMPLS)
def test_norms_degenerate_and_extreme_rows(impl):
    rng = np.random.default_rng(10)
    x = rng.normal(size=(7, 64)).astype(np.float32)
    x[1] = 5.0  # constant row
    x[2] = 0.0  # zero row
    x[3, 7] = -np.inf  # non-finite input: its row is NaN, counted
    x[4] *= 1e37  # near f32 max: x - mean and x**2 would overflow without range compression
    x[5] *= 1e-30  # tiny: x**2 underflows without range compression
    x[6] = 1e8 + np.arange(64, dtype=np.float32) * 8  # large mean, small spread
    bias = rng.normal(size=64).astype(np.float32)
    xb = jnp.asarray(rng.uniform(-1, 1, size=(2, 64)) * 3e38, jnp.bfloat16)  # bf16 near max

    @jax.jit
    def run(x, bias, xb):
        return (
            kernels.safe_layer_norm(x, None, bias, 0.0, implementation=impl, with_count=True),
            kernels.safe_rms_norm(x, None, 0.0, implementation=impl),
            kernels.safe_layer_norm(xb, None, None, 1e-6, implementation=impl),
        )

    (y, count), r, yb = run(x, bias, xb)
    y, r = np.asarray(y), np.asarray(r)
    assert int(count) == 1
    np.testing.assert_array_equal(y[1], bias)  # var + eps == 0 -> normalised value 0
    np.testing.assert_array_equal(y[2], bias)
    np.testing.assert_array_equal(r[2], 0.0)  # all-zero row with eps=0 -> 0
    assert np.isnan(y[3]).all() and np.isnan(r[3]).all()
    rows = np.array([0, 4, 5, 6])
    np.testing.assert_allclose(y[rows], layer_norm64(x[rows], None, bias, 0.0), atol=2e-6)
    np.testing.assert_allclose(r[rows], rms_norm64(x[rows], None, 0.0), atol=2e-6)
    exp = layer_norm64(np.asarray(xb.astype(jnp.float32)), None, None, 1e-6)
    np.testing.assert_allclose(np.asarray(yb.astype(jnp.float32)), exp, atol=2e-2)


@pytest.mark.parametrize("eps", [0.0, 1e-6])
def test_a_constant_row_is_exactly_bias_as_xla_compiles_it_by_default(eps):
    """Narrow constant rows: ``sum(x) / n`` rounds off ``x``, and at XLA's default level the
    residue ``d - mean(d)`` came out of two fusions unequal (~4e-9); times the degenerate row's
    inverse std that was 7e7 (eps 1e-6) or 0.707 (eps 0). The suite's -O0 hides it."""
    x = jnp.full((2, 3), 2.6993079e13, jnp.float32)
    bias = jnp.asarray([0.5, -1.0, 2.0], jnp.float32)
    run = jit_llvm_default(
        lambda x, b: (
            kernels.safe_layer_norm(x, None, b, eps, implementation="reference"),
            ops.layer_norm(x, None, b, eps, gear=2),
        )
    )
    for y in run(x, bias):
        np.testing.assert_array_equal(np.asarray(y), np.broadcast_to(bias, (2, 3)))


def _plain_ln(x, s, b, eps):
    m = x.mean(-1, keepdims=True)
    v = ((x - m) ** 2).mean(-1, keepdims=True)
    return (x - m) * jax.lax.rsqrt(v + eps) * s + b


def _plain_rms(x, s, eps):
    return x * jax.lax.rsqrt((x * x).mean(-1, keepdims=True) + eps) * s


def _check_norm_grads(impl, eps):
    rng = np.random.default_rng(11)
    x = jnp.asarray(rng.normal(size=(4, 48)), jnp.float32).at[1].set(3.0)  # row 1 constant
    xz = x.at[2].set(0.0)  # row 2 all zero (rms norm)
    scale = jnp.asarray(rng.normal(size=48), jnp.float32)
    bias = jnp.asarray(rng.normal(size=48), jnp.float32)
    w = jnp.asarray(rng.normal(size=(4, 48)), jnp.float32)

    def safe_loss(x, xz, s, b):
        ln = kernels.safe_layer_norm(x, s, b, eps, implementation=impl)
        rms = kernels.safe_rms_norm(xz, s, eps, implementation=impl)
        return jnp.sum(ln * w) + jnp.sum(rms * w)

    ok, rr = np.array([0, 2, 3]), np.array([0, 1, 3])  # rows that are regular for plain code

    def plain_loss(x, xz, s, b):
        ln = _plain_ln(x, s, b, eps)[ok]
        rms = _plain_rms(xz, s, eps)[rr]
        return jnp.sum(ln * w[ok]) + jnp.sum(rms * w[rr])

    grads = jax.jit(jax.grad(safe_loss, argnums=(0, 1, 2, 3)))(x, xz, scale, bias)
    assert all(np.isfinite(np.asarray(g)).all() for g in grads)
    gx, gxz, _, gb = (np.asarray(g) for g in grads)
    ex, exz, _, _ = jax.jit(jax.grad(plain_loss, argnums=(0, 1, 2, 3)))(x, xz, scale, bias)
    np.testing.assert_allclose(gx[ok], np.asarray(ex)[ok], atol=1e-4)
    np.testing.assert_allclose(gxz[rr], np.asarray(exz)[rr], atol=1e-4)
    np.testing.assert_allclose(gb, np.asarray(w).sum(0), atol=1e-5)
    if eps == 0:  # degenerate rows (var + eps == 0, mean square + eps == 0): zero gradient
        np.testing.assert_array_equal(gx[1], 0)
        np.testing.assert_array_equal(gxz[2], 0)


@pytest.mark.parametrize("impl", IMPLS)
def test_norms_grad_degenerate_eps0(impl):
    _check_norm_grads(impl, 0.0)
    # the reference's own autodiff (documented fallback) is finite on degenerate rows too
    x = jnp.asarray(np.random.default_rng(14).normal(size=(3, 16)), jnp.float32)
    x = x.at[1].set(2.0).at[2].set(0.0)
    for fn in (norms_ref.layer_norm_stats, norms_ref.rms_norm_stats):
        g = jax.grad(lambda x, fn=fn: jnp.sum(fn(x, 0.0, jnp.float32)[0] * x))(x)
        assert np.isfinite(np.asarray(g)).all()


@pytest.mark.slow
def test_norms_grad_eps_positive():
    _check_norm_grads("pallas", 1e-5)


def test_jit_vmap_all_ops():
    rng = np.random.default_rng(12)
    x = jnp.asarray(rng.normal(size=(3, 4, 40)), jnp.float32)

    def run(x, impl):
        return (
            kernels.safe_softmax(x, implementation=impl),
            kernels.safe_layer_norm(x, None, None, implementation=impl),
            kernels.safe_rms_norm(x, jnp.ones(40), implementation=impl),
            kernels.safe_mean(x, -1, implementation=impl),
        )

    expected = jax.jit(run, static_argnums=1)(x, "reference")
    batched = jax.jit(jax.vmap(lambda x: run(x, "pallas")))(x)  # batches the pallas_calls
    for got, exp in zip(batched, expected, strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(exp), atol=1e-6)


# ---------------------------------------------------------------------------------------------
# GPU path, checked from the CPU


def test_auto_falls_back_with_one_warning(monkeypatch):
    """implementation=None on an accelerator whose lowering fails: reference + one warning.
    Simulated on CPU: the backend claims to be a GPU and compiled (non-interpret) Pallas is
    requested, which the CPU cannot lower."""
    if jax.default_backend() != "cpu":
        pytest.skip("simulates a failing GPU lowering on the CPU")
    monkeypatch.setattr(_common, "_default_backend", lambda: "gpu")
    monkeypatch.setenv(_common.INTERPRET_ENV, "0")
    monkeypatch.setattr(_common, "_PROBED", {})
    monkeypatch.setattr(_common, "_WARNED", set())
    x = jnp.asarray(np.random.default_rng(13).normal(size=(4, 64)), jnp.float32)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        y1 = jax.jit(kernels.safe_softmax)(x)
        y2 = kernels.safe_softmax(x * 2)
    msgs = [w for w in rec if "did not lower" in str(w.message)]
    assert len(msgs) == 1
    np.testing.assert_allclose(np.asarray(y1), softmax64(np.asarray(x)), atol=1e-6)
    assert np.isfinite(np.asarray(y2)).all()


@pytest.mark.parametrize("op", ["sum", "softmax", "layer_norm", "rms_norm"])
def test_triton_lowering(op, monkeypatch):
    """The compiled GPU path lowers to Triton IR (cross-lowered for CUDA via jax.export, no
    GPU needed). Compiling that IR to PTX is only checked on a GPU (benchmarks/gpu_check.sh)."""
    from jax import export

    from nan2safe_jax.kernels.norms import pallas as norms_pallas
    from nan2safe_jax.kernels.safe_reduce import pallas as reduce_pallas
    from nan2safe_jax.kernels.softmax import pallas as softmax_pallas

    if _common.gpu_compiler_params() is None:
        pytest.skip("no Pallas Triton backend in this jaxlib")
    monkeypatch.setattr(_common, "_default_backend", lambda: "gpu")
    f32, S = jnp.float32, jax.ShapeDtypeStruct
    fn, args = {
        "sum": (
            lambda x: reduce_pallas.sum_rows(x, acc=f32, interpret=False),
            [S((3, 100000), jnp.bfloat16)],
        ),
        "softmax": (
            lambda x, m: softmax_pallas.softmax_rows(
                x, m, acc=f32, out_dtype=x.dtype, interpret=False
            ),
            [S((50, 1000), jnp.float16), S((50, 1000), jnp.bool_)],
        ),
        "layer_norm": (
            lambda x, s, b: norms_pallas.norm_rows(
                x, s, b, kind="layer", eps=1e-6, acc=f32, out_dtype=x.dtype, interpret=False
            ),
            [S((64, 768), jnp.bfloat16), S((768,), f32), S((768,), f32)],
        ),
        "rms_norm": (
            lambda x: norms_pallas.norm_rows(
                x, None, None, kind="rms", eps=0.0, acc=f32, out_dtype=x.dtype, interpret=False
            ),
            [S((64, 768), f32)],
        ),
    }[op]
    try:
        exported = export.export(
            jax.jit(fn),
            platforms=["cuda"],
            disabled_checks=[export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")],
        )(*args)
    except RuntimeError as err:
        # jax >= 0.11 no longer cross-lowers Pallas Triton kernels without a GPU device.
        if "No supported GPU devices" in str(err):
            pytest.skip(f"this jax cannot cross-lower Triton without a GPU: {err}")
        raise
    assert "__gpu$xla.gpu.triton" in exported.mlir_module()
