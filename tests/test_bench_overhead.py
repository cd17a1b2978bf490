"""benchmarks/overhead.py: the compile record over repeated runs (no compile here)."""

import pytest


@pytest.fixture(scope="module")
def bench(benchmark_module):
    return benchmark_module("overhead")


def test_repeated_compile_runs_report_medians_and_keep_every_run(bench):
    runs = [
        {"lower_s": 1.0, "compile_s": 9.0, "rss_gb": 0.5},
        {"error": "killed: RSS 5.1 GB, 3 s", "rss_gb": 5.1},
        {"lower_s": 3.0, "compile_s": 5.0, "rss_gb": 0.7},
        {"lower_s": 2.0, "compile_s": 7.0, "rss_gb": 0.6},
    ]
    rec = bench._median_run(runs)
    assert (rec["lower_s"], rec["compile_s"]) == (2.0, 7.0)
    assert rec["compile_s_runs"] == [9.0, 5.0, 7.0] and rec["rss_gb"] == 5.1
    assert rec["failed_runs"] == ["killed: RSS 5.1 GB, 3 s"]
    assert bench._median_run(runs[1:2]) == runs[1]  # no run finished: the error stands
    table = bench._compile_table(
        dict(
            command="python benchmarks/overhead.py --compile --repeats 4",
            backend="cpu",
            dtype="float32",
            scan_layers=False,
            repeats=4,
            layers=4,
            d_model=256,
            seq=128,
            batch=8,
            arms={"plain": rec},
            ratio=None,
        )
    )
    assert "median of 4 runs per arm" in table[1]
    assert table[-1].endswith("compile runs 9.0 5.0 7.0")


@pytest.mark.parametrize("scan_layers", [False, True])
def test_the_timed_model_has_no_knobs_and_computes_what_the_knobbed_one_does(bench, scan_layers):
    """The nan2safe arm's model is built without the fault-injection knobs (the plain twin has
    none); at knob 1.0 the knobbed model computes the same logits, bit for bit."""
    import argparse
    import dataclasses

    import jax
    from flax import nnx
    from tiny_models import set_fast_only

    from examples.transformer import Knob, Transformer, make_batch, set_knob

    size = dict(layers=1, d_model=32, heads=2, seq=8, dtype="float32", scan_layers=scan_layers)
    cfg = bench._model_cfg(argparse.Namespace(**size))
    assert cfg.knobs is False
    bare = Transformer(cfg, rngs=nnx.Rngs(0))
    knobbed = Transformer(dataclasses.replace(cfg, knobs=True), rngs=nnx.Rngs(0))
    assert not jax.tree.leaves(nnx.state(bare, Knob))
    assert jax.tree.leaves(nnx.state(knobbed, Knob))
    with pytest.raises(ValueError, match="no Knob named"):
        set_knob(bare, "qk_gain", 2.0)
    batch = make_batch(jax.random.key(0), cfg, 2)
    # FAST known at trace time, as the timed FAST-only program runs the sites (and a compile of
    # a fraction of the general forward's)
    for m in (bare, knobbed):
        set_fast_only(m)
    forward = nnx.jit(lambda m, batch: m(**batch))
    same = jax.tree.map(
        lambda a, b: bool((a == b).all()), forward(bare, batch), forward(knobbed, batch)
    )
    assert jax.tree.leaves(same) == [True]
