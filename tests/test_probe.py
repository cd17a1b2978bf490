"""probe: the named layout of the probe vector and its producers agree."""

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nan2safe_jax import probe
from nan2safe_jax.replay import locate


def test_named_indices_follow_stats():
    names = ("MAX_ABS", "MEAN", "VAR", "NONFINITE", "HEADROOM")
    assert [getattr(probe, n) for n in names] == [probe.STATS.index(n.lower()) for n in names]
    assert probe.ProbeStats._fields == probe.STATS


def test_probe_stats_view_reads_the_named_fields():
    x = jnp.asarray([1.0, -3.0, jnp.nan, 2.0], jnp.float16)
    s = probe.stats(x)
    v = probe.ProbeStats.of(s)
    assert float(v.max_abs) == 3.0 and float(v.nonfinite) == 1.0
    assert float(v.mean) == float(s[probe.MEAN]) == 0.0
    np.testing.assert_allclose(float(v.headroom), 3.0 / 65504.0, rtol=1e-6)
    stacked = probe.ProbeStats.of(jnp.stack([s, 2 * s]))
    np.testing.assert_array_equal(stacked.max_abs, [3.0, 6.0])


def test_producers_share_the_layout():
    y = jnp.asarray([[0.5, -4.0], [1.0, 2.0]], jnp.float32)
    full, cheap, sampled = probe.stats(y), probe.cheap_stats(y), probe.sampled_stats(y, 2)
    assert full.shape == cheap.shape == sampled.shape == (probe.NUM_STATS,)
    assert float(full[probe.MAX_ABS]) == float(cheap[probe.MAX_ABS]) == 4.0
    assert float(cheap[probe.NONFINITE]) == 0.0
    assert float(sampled[probe.MAX_ABS]) == 4.0  # row 0 is the sampled row
    bad = probe.cheap_stats(y.at[1, 1].set(jnp.inf))
    assert float(bad[probe.NONFINITE]) == 1.0 and float(bad[probe.HEADROOM]) == 1.0
    for f in (probe.stats, probe.cheap_stats):  # a -inf mask fill is neither, to either
        masked = f(y.at[1, 1].set(-jnp.inf))
        assert float(masked[probe.NONFINITE]) == 0.0 and float(masked[probe.MAX_ABS]) == 4.0
    sc = probe.scalar_stats(jnp.float32(-2.5), jnp.float32(0.0), False)
    assert float(sc[probe.MAX_ABS]) == 2.5 and float(sc[probe.MEAN]) == -2.5
    np.testing.assert_array_equal(probe.zeros(), np.zeros(probe.NUM_STATS))


def _reference_stats(x: np.ndarray, dtype) -> np.ndarray:
    """``stats`` in NumPy, in float64: the finite values' moments, NaN and +inf counted."""
    xf = np.asarray(x, np.float64).ravel()
    fin = xf[np.isfinite(xf)]
    mean = fin.mean() if fin.size else 0.0
    max_abs = np.abs(fin).max() if fin.size else 0.0
    bad = np.isnan(xf).sum() + (xf == np.inf).sum()
    head = 1.0 if (xf == np.inf).any() else max_abs / float(jnp.finfo(dtype).max)
    return np.array([max_abs, mean, fin.var() if fin.size else 0.0, bad, head])


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16, jnp.bfloat16])
@pytest.mark.parametrize("seed", range(3))
def test_stats_matches_the_numpy_reference(dtype, seed):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(6, 33)) * 10.0 ** rng.integers(-2, 3)
    if seed:  # seed 0: all finite, so the headroom is max_abs / finfo(dtype).max
        x.ravel()[rng.choice(x.size, 5, replace=False)] = [np.nan, np.inf, -np.inf, np.nan, 0.0]
    x = jnp.asarray(x, dtype)
    got = np.asarray(jax.jit(probe.stats)(x), np.float64)
    want = _reference_stats(np.asarray(x.astype(jnp.float32)), dtype)
    # atol: an f32 headroom of ~1e-37 may be flushed to 0 (XLA divides by a reciprocal)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-30)


def test_stats_is_one_reduction_without_gradient():
    """One variadic reduction (one fusion for XLA, not one per statistic), and monitoring only:
    no gradient flows through it."""
    jaxpr = jax.make_jaxpr(probe.stats)(jnp.ones((4, 8)))
    reductions = [e for e in jaxpr.eqns if e.primitive.name.startswith("reduce")]
    assert [e.primitive.name for e in reductions] == ["reduce"]
    g = jax.grad(lambda x: probe.stats(x)[probe.MAX_ABS] + probe.stats(x)[probe.MEAN])(jnp.ones(3))
    np.testing.assert_array_equal(g, np.zeros(3))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16, jnp.bfloat16])
@pytest.mark.parametrize("shape", [(6, 33), (4, 3, 5), (7,), ()])
def test_partitioned_stats_are_plain_reductions_with_the_same_values(dtype, shape):
    """For a sharded step: a sum and a max XLA can all-reduce, no variadic reduction (which
    the SPMD partitioner can only gather), and the statistics of the one-reduction form."""
    rng = np.random.default_rng(len(shape))
    x = rng.normal(size=shape) * 30.0
    if x.size > 4:
        x.ravel()[[1, 2, 3]] = [np.nan, np.inf, -np.inf]
    x = jnp.asarray(x, dtype)
    with probe.partitioned():  # fresh functions: a jit's trace cache does not key on it
        got = np.asarray(jax.jit(lambda v: probe.stats(v))(x), np.float64)
        jaxpr = jax.make_jaxpr(lambda v: probe.stats(v))(x)
    names = [e.primitive.name for e in jaxpr.eqns if e.primitive.name.startswith("reduce")]
    assert names == (["reduce_sum", "reduce_max"] if shape else ["reduce"])
    want = _reference_stats(np.asarray(x.astype(jnp.float32)), dtype)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-30)
    np.testing.assert_allclose(got, np.asarray(probe.stats(x), np.float64), rtol=1e-5, atol=1e-30)


def test_named_values_is_a_mapping_and_one_array_through_jit():
    """``metrics["probe_risk"]``: name -> value, one output array (not one per name), a pytree
    that jit returns and ``jax.device_get`` brings to the host whole."""
    names = ("a", "b", "c")
    nv = jax.jit(lambda v: probe.NamedValues(names, v * 2.0))(jnp.arange(3.0))
    assert isinstance(nv, probe.NamedValues) and list(nv) == list(names) and len(nv) == 3
    assert float(nv["b"]) == 2.0 and dict(nv.items()).keys() == {"a", "b", "c"}
    assert len(jax.tree_util.tree_leaves(nv)) == 1
    host = jax.device_get({"probe_risk": nv})["probe_risk"]
    assert isinstance(host.values, np.ndarray) and {k: float(v) for k, v in host.items()} == {
        "a": 0.0,
        "b": 2.0,
        "c": 4.0,
    }
    with pytest.raises(KeyError):
        nv["d"]
    assert "b" in nv and "d" not in nv


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("partitioned", [False, True], ids=["one_device", "partitioned"])
def test_stats_of_huge_finite_values_are_finite_and_make_no_inf(dtype, partitioned):
    """Attention logits of ~4e18: their f32 sum of squares overflowed, so the probe's variance
    was inf and tier 2 named the probe's own reduction as the culprit of a later fault
    (newuser42). The squares now run scaled by 2**-16 (exact), and no equation of ``stats``
    makes an inf from finite values below ~1.2e24; past it the variance saturates."""
    rng = np.random.default_rng(0)
    for scale, exact in ((4e18, True), (1e23, False), (1e30, False)):
        x = jnp.asarray(rng.normal(size=(64, 65)) * scale, dtype)
        with probe.partitioned() if partitioned else contextlib.nullcontext():
            fn = lambda v: probe.stats(v)  # noqa: E731 - fresh: a jit's trace cache ignores the mode
            got = np.asarray(jax.jit(fn)(x), np.float64)
            jaxpr = jax.make_jaxpr(fn)(x)
        assert np.isfinite(got).all(), got
        want = _reference_stats(np.asarray(x.astype(jnp.float32)), dtype)
        if exact:
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-18)  # (f32 headroom: FTZ)
            # every intermediate of the statistics is finite (what the replay would flag)
            found = locate(jaxpr, (x,))
            assert found is None, str(found)
        else:  # the scaled squares' sum passes f32: the variance saturates, the rest holds
            assert got[probe.VAR] == float(jnp.finfo(jnp.float32).max)
            np.testing.assert_allclose(got[probe.MAX_ABS], want[probe.MAX_ABS], rtol=1e-4)


def test_stats_of_a_huge_scalar_or_constant_keep_their_mean_and_zero_variance():
    """review25: a clipped sum read a 1e30 loss's mean as 7.9e28, and a constant tensor of
    huge values the variance of f32's max; the mean is exact, a scalar's variance 0, and a
    constant's 0 while its squares fit."""
    one = np.asarray(probe.stats(jnp.float32(1e30)), np.float64)
    assert one[probe.MEAN] == float(np.float32(1e30)) and one[probe.VAR] == 0.0
    const = np.asarray(jax.jit(probe.stats)(jnp.full((100,), 3e20, jnp.float32)), np.float64)
    assert const[probe.MEAN] == pytest.approx(3e20, rel=1e-5)
    assert const[probe.VAR] <= 1e-5 * 3e20**2  # (f32 rounding of E[x^2] - E[x]^2)


@pytest.mark.parametrize("partitioned", [False, True])
def test_stats_of_rows_are_each_rows_stats(partitioned):
    """``stats_of_rows`` (a norm's two per-row probes in one reduction) gives what ``stats``
    gives each array, limits included: NaN, +inf and -inf, a bf16 row, an f32 one."""
    rng = np.random.default_rng(4)
    a = jnp.asarray(rng.normal(size=(5, 7)) * 30.0, jnp.float32).at[0, 1].set(jnp.nan)
    b = jnp.asarray(rng.normal(size=(5, 7)) * 1e3, jnp.bfloat16).at[2, 2].set(jnp.inf)
    b = b.at[3, 3].set(-jnp.inf)
    with probe.partitioned(partitioned):
        rows = jax.jit(lambda a, b: probe.stats_of_rows([a, b], [None, 2.0**64]))(a, b)
        want = jax.jit(lambda a, b: [probe.stats(a), probe.stats(b, 2.0**64)])(a, b)
    for got, ref in zip(rows, want, strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-6, atol=1e-30)


def test_the_mean_of_values_whose_sum_passes_f32_stays_finite():
    """review29: 100 values of 1e37 sum past f32's max, and the mean read inf (a metrics row
    with an inf in it, for finite values); the sum of ``x * 2**-16`` keeps it exact."""
    for sign in (1.0, -1.0):
        x = jnp.full((100,), sign * 1e37, jnp.float32).at[0].set(-sign * 3e38)
        got = np.asarray(jax.jit(probe.stats)(x), np.float64)
        want = np.float64(np.asarray(x, np.float64).mean())
        assert np.all(np.isfinite(got)), got
        np.testing.assert_allclose(got[probe.MEAN], want, rtol=1e-5)
    # past ~74000 values of 3e38 the scaled sum too passes f32: the mean saturates at the max
    got = np.asarray(jax.jit(probe.stats)(jnp.full((200_000,), 3e38, jnp.float32)), np.float64)
    assert got[probe.MEAN] == float(jnp.finfo(jnp.float32).max), got


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_headroom_under_jit_is_the_eager_fraction_of_the_dtypes_max(dtype):
    """``max_abs / finfo.max``: XLA turned the division into a multiply by ``1 / 3.4e38``,
    subnormal and flushed to 0 on the CPU, so a jitted f32 or bf16 probe read headroom 0 even
    at 2e38 (the detector's headroom limit never fired there)."""
    big = float(jnp.finfo(dtype).max)
    y = jnp.asarray([0.6 * big, -1.0], dtype)
    want = float(np.asarray(y, np.float64).max()) / big
    for f in (probe.stats, probe.cheap_stats):
        got = float(jax.jit(f)(y)[probe.HEADROOM])
        np.testing.assert_allclose(got, want, rtol=1e-6)
