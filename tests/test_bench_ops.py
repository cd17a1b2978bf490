"""benchmarks/ops.py: one module's variants through the script, as its table and JSON."""

import json

import pytest


@pytest.fixture(scope="module")
def bench(benchmark_module):
    return benchmark_module("ops")


def test_a_run_times_every_variant_in_shuffled_chunks_and_records_the_rounds(bench, tmp_path):
    out = tmp_path / "ops.json"
    result = bench.main(
        ["--only", "Embed", "--rounds", "2", "--chunks", "2", "--iters", "2", "--json", str(out)]
    )
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    (row,) = result["rows"]
    assert row["module"] == "Embed" and result["chunks"] == 2
    assert {len(v) for v in row["rounds_us"].values()} == {2}
    for g in ("fast", "stable", "safe", "fast_noprobe", "fast_only"):
        assert row[f"{g}_ratio"] == pytest.approx(row[f"{g}_us"] / row["flax_us"])
    table = bench.table(result)
    assert "median of 2 interleaved rounds (fastest of 2 shuffled chunks each)" in table
    assert "Embed" in table.splitlines()[-1]


def test_a_site_runs_as_the_train_step_runs_it(bench):
    """No site variable goes in or out of the jit (the step rebuilds them from its template);
    the probes of the default set come out, as the step's metrics."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from nan2safe_jax import nn, probe
    from nan2safe_jax.ops import dispatch
    from nan2safe_jax.site import SITE_VARIABLES

    module = nn.Router(8, 4, 2, rngs=nnx.Rngs(0))
    kinds = bench._kinds("fastonly")
    fn, params, rest = bench._step_fn(
        module, bench._modules(jnp.float32)["Router"][3], True, True, kinds
    )
    assert not jax.tree_util.tree_leaves(nnx.filter_state(rest, SITE_VARIABLES))
    assert "logit_scale" in rest  # a knob stays: the step carries it
    x = jnp.ones((2, 3, 8))
    with probe.probe_set(kinds):
        loss, (probes, kept) = fn(params, rest, x, dispatch.fast_only_gear())
    assert set(probes) == {"probe_logits"} and probes["probe_logits"].shape == (probe.NUM_STATS,)
    assert float(probes["probe_logits"][probe.MAX_ABS]) > 0
    assert jax.tree_util.tree_structure(kept) == jax.tree_util.tree_structure(rest)
    assert bench._kinds("noprobe") == bench._kinds("flax") == ()
