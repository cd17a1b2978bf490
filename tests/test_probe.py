"""probe: the named layout of the probe vector and its producers agree."""

import jax.numpy as jnp
import numpy as np

from nan2safe_jax import probe


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
    sc = probe.scalar_stats(jnp.float32(-2.5), jnp.float32(0.0), False)
    assert float(sc[probe.MAX_ABS]) == 2.5 and float(sc[probe.MEAN]) == -2.5
    np.testing.assert_array_equal(probe.zeros(), np.zeros(probe.NUM_STATS))
