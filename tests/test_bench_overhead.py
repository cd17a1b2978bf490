"""benchmarks/overhead.py: the compile record over repeated runs (no compile here)."""

import numpy as np
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


def test_compile_table_reports_both_programs_sizes_and_their_ratio(bench):
    size = lambda k, f, b: dict(  # noqa: E731
        kernels=k,
        fused_instructions=f,
        distinct_kernels=k // 10,
        distinct_fused_instructions=f // 5,
        flops=1.0,
        bytes_accessed=b,
    )
    run = lambda t, **sz: {"lower_s": 1.0, "compile_s": t, "rss_gb": 0.5, **sz}  # noqa: E731
    plain = bench._median_run([run(2.0, **size(100, 1000, 1e9))] * 3)
    n2s = bench._median_run([run(3.0, **size(130, 1500, 1.1e9))] * 3)
    assert plain["kernels"] == 100 and n2s["bytes_accessed"] == 1.1e9
    table = bench._compile_table(
        dict(
            command="c", backend="cpu", dtype="float32", scan_layers=False, repeats=3,
            layers=4, d_model=256, seq=128, batch=8,
            arms={"plain": plain, "nan2safe": n2s}, ratio=1.5,
        )
    )  # fmt: skip
    assert "kernels" in table[3] and "fused instrs" in table[3]
    assert table[5].split()[4:9] == ["130", "(13)", "1500", "(300)", "1.100"]
    assert "compile ratio nan2safe / plain: 1.50x (target <= 1.3)" in table
    assert table[-1].startswith(
        "program size nan2safe / plain (the same on every run): kernels 1.30x, "
        "fused instructions 1.50x, distinct kernels 1.30x, distinct fused instructions 1.50x, "
        "bytes accessed 1.10x"
    )


def test_timing_table_gives_the_paired_ratio_its_interval_and_verdict(bench, benchmark_module):
    measure = benchmark_module("measure")
    plain = [0.30, 0.36, 0.31, 0.40, 0.30]
    n2s = [p * r for p, r in zip(plain, [1.01, 1.02, 1.00, 1.03, 1.02], strict=True)]
    rec = dict(
        backend="cpu", devices=1, dtype="float32", batch=8, layers=4, d_model=256, seq=128,
        times_s={"plain": plain, "nan2safe": n2s},
        median_s={"plain": 0.31, "nan2safe": sorted(n2s)[2]},
        ratio=sorted(n2s)[2] / 0.31,
    )  # fmt: skip
    lines = bench._timing_table(rec)
    expected = measure.ratio_text(*measure.paired_ratio(n2s, plain), target=1.03)
    assert expected.startswith("1.020x (95% CI 1.000-1.030): met at <= 1.03")
    assert f"ratio nan2safe / plain (median of the rounds' ratios): {expected}" in lines


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


def _compile_run(t, k):
    """A compile child's record: ``t`` seconds, ``k`` kernels (sizes derived from ``k``)."""
    size = dict(kernels=k, fused_instructions=10 * k, flops=1.0, bytes_accessed=1e9)
    size |= dict(distinct_kernels=k // 4, distinct_fused_instructions=k)
    return {"lower_s": 1.0, "compile_s": t, "rss_gb": 0.5, **size}


def test_compile_ablation_splits_the_added_compile_into_machinery_sites_and_probes(bench):
    arms = {
        "plain": _compile_run(2.0, 100),
        "nan2safe": _compile_run(4.5, 180),
        "guard": _compile_run(3.0, 140),
        "noprobe": _compile_run(3.5, 148),
    }
    split = bench.compile_split(arms)
    assert split == {
        "machinery": {"compile_s": 1.0, "kernels": 40, "distinct_kernels": 10},
        "sites": {"compile_s": 0.5, "kernels": 8, "distinct_kernels": 2},
        "probes": {"compile_s": 1.0, "kernels": 32, "distinct_kernels": 8},
    }
    # the three steps add up to nan2safe - plain
    assert sum(d["compile_s"] for d in split.values()) == pytest.approx(4.5 - 2.0)
    assert bench.compile_split({k: v for k, v in arms.items() if k != "guard"}) is None
    assert bench.compile_split({**arms, "noprobe": {"error": "killed", "rss_gb": 9.0}}) is None
    rec = dict(
        command="c", backend="cpu", dtype="float32", scan_layers=False, repeats=1,
        layers=4, d_model=256, seq=128, batch=8, arms=arms, ratio=2.25, split=split,
    )  # fmt: skip
    table = bench._compile_table(rec)
    assert table[-1] == (
        "compile added by: machinery (guard - plain) +1.0 s, +40 kernels (+10 distinct); "
        "sites (noprobe - guard) +0.5 s, +8 kernels (+2 distinct); "
        "probes (nan2safe - noprobe) +1.0 s, +32 kernels (+8 distinct)"
    )
    scanned = {**rec, "scan_layers": True}
    assert (
        "; sites and the layer scan (noprobe - guard) +0.5 s" in bench._compile_table(scanned)[-1]
    )


def test_scanned_compile_is_split_and_rated_against_the_scanned_plain_step(bench):
    """With ``--scan-layers`` the guard arm's model is scanned, so the machinery is ``guard -
    plain_scan``, and the like-for-like ratio is against ``plain_scan``."""

    arms = {
        "plain": _compile_run(2.0, 100),
        "plain_scan": _compile_run(2.5, 60),
        "nan2safe": _compile_run(4.0, 120),
        "guard": _compile_run(3.0, 100),
        "noprobe": _compile_run(3.5, 108),
    }
    split = bench.compile_split(arms, scan=True)
    assert split["machinery"] == {"compile_s": 0.5, "kernels": 40, "distinct_kernels": 10}
    assert sum(d["compile_s"] for d in split.values()) == pytest.approx(4.0 - 2.5)
    assert (
        bench.compile_split({k: v for k, v in arms.items() if k != "plain_scan"}, scan=True) is None
    )
    rec = dict(
        command="c", backend="cpu", dtype="float32", scan_layers=True, repeats=1,
        layers=4, d_model=256, seq=128, batch=8, arms=arms, ratio=2.0, ratio_scan=1.6,
        split=split,
    )  # fmt: skip
    table = bench._compile_table(rec)
    assert (
        "compile ratio nan2safe / plain: 2.00x (target <= 1.3) (plain: a Python loop of layers)"
        in table
    )
    assert "compile ratio nan2safe / plain_scan (both scanned): 1.60x (target <= 1.3)" in table
    assert table[-1].startswith("compile added by: machinery (guard - plain_scan) +0.5 s")
    assert "sites (noprobe - guard) +0.5 s" in table[-1]


def test_the_scanned_plain_model_computes_what_the_unrolled_one_does(bench):
    """``plain_scan`` is the plain model, only laid out for ``nnx.scan``: with the same
    parameters (layer i of the stack in block i) it gives the same logits."""
    import argparse
    import dataclasses

    import jax
    import numpy as np
    from flax import nnx

    from examples.transformer import make_batch

    size = dict(layers=2, d_model=32, heads=2, seq=8, dtype="float32", scan_layers=True)
    cfg = bench._model_cfg(argparse.Namespace(**size))
    scanned = bench.PlainTransformer(cfg, rngs=nnx.Rngs(0))
    unrolled = bench.PlainTransformer(dataclasses.replace(cfg, scan_layers=False), rngs=nnx.Rngs(1))
    batch = make_batch(jax.random.key(0), cfg, 2)
    forward = nnx.jit(lambda m, b: m(b["tokens"], b["mask"]))
    before = forward(unrolled, batch)  # its own parameters
    stacked = nnx.state(scanned.blocks, nnx.Param)
    for i, block in enumerate(unrolled.blocks):
        nnx.update(block, jax.tree.map(lambda a, i=i: a[i], stacked))
    for name in ("embed", "pos", "norm", "head"):
        nnx.update(getattr(unrolled, name), nnx.state(getattr(scanned, name), nnx.Param))
    a, b = forward(scanned, batch), forward(unrolled, batch)
    assert a.shape == (2, 8, cfg.vocab)
    assert not np.allclose(np.asarray(a), np.asarray(before), rtol=1e-3, atol=1e-3)
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)


def test_restart_record_pairs_each_first_compile_with_the_restart_after_it(bench):
    child = lambda lower, comp: {"lower_s": lower, "compile_s": comp, "rss_gb": 0.5}  # noqa: E731
    killed = {"error": "killed: RSS 5.1 GB, 3 s", "rss_gb": 5.1}
    plain = bench.restart_arm([(child(1.0, 3.0), child(1.0, 0.4))] * 3)
    n2s = bench.restart_arm(
        [
            (child(2.0, 5.0), child(2.0, 0.8)),
            (child(2.0, 6.0), killed),  # the repeat fails as a whole
            (child(2.0, 4.0), child(2.0, 1.0)),
        ]
    )
    assert (n2s["compile_s"], n2s["restart_compile_s"]) == (4.5, 0.9)
    assert n2s["restart_compile_s_runs"] == [0.8, 1.0] and n2s["failed_runs"] == [killed["error"]]
    table = bench._restart_table(
        dict(
            command="python benchmarks/overhead.py --compile --restart", backend="cpu",
            dtype="float32", scan_layers=False, repeats=3, layers=4, d_model=256, seq=128,
            batch=8, arms={"plain": plain, "nan2safe": n2s},
        )
    )  # fmt: skip
    assert table[4].split() == ["plain", "1.0", "3.0", "0.40", "1.4"]
    assert table[5].split() == ["nan2safe", "2.0", "4.5", "0.90", "2.9"]
    assert table[-2] == (
        "restart compile nan2safe / plain: 2.25x; nan2safe's restart compile / plain's first "
        "compile: 0.30x"
    )
    assert table[-1].endswith("nan2safe / plain: 2.07x (both with the cache); against plain "
                              "without one: 0.72x")  # fmt: skip
    assert bench.restart_arm([(killed, child(1.0, 1.0))])["error"] == killed["error"]


def test_timing_table_says_how_the_rounds_were_taken(bench):
    rec = dict(
        backend="cpu", devices=1, dtype="float32", batch=8, layers=4, d_model=256, seq=128,
        times_s={"plain": [0.3, 0.31]}, median_s={"plain": 0.305}, ratio=None,
        rounds=2, steps_per_round=4,
    )  # fmt: skip
    assert "2 rounds of 4 steps" in bench._timing_table(rec)
    rec["chunks"] = 3
    assert "2 rounds of 4 steps, each arm's fastest of 3 shuffled chunks per round" in (
        bench._timing_table(rec)
    )


@pytest.mark.parametrize("arm", ["plain", "nan2safe"])
def test_donate_makes_each_arm_step_in_place(bench, arm):
    """``--donate``: each arm's step donates the state it is given (its buffers are gone after
    the step), and the run goes on from the state the step returned."""
    import argparse

    import jax
    import optax

    from examples.transformer import make_batch

    size = dict(layers=1, d_model=32, heads=2, seq=8, dtype="float32", scan_layers=False)
    cfg = bench._model_cfg(argparse.Namespace(**size))
    batch = make_batch(jax.random.key(0), cfg, 2)
    kept = {}
    for donate in (False, True):
        run = bench.make_arm(arm, cfg, optax.sgd(1e-2), donate=donate)
        leaf = jax.tree_util.tree_leaves(run.carry)[0]
        losses = [float(run(batch)) for _ in range(2)]
        kept[donate] = (leaf.is_deleted(), losses)
    assert kept[False][0] is False and kept[True][0] is True
    # the same steps either way (two programs: XLA may round the second loss an ulp or two
    # apart, as it did on this VM on 2026-12-07 for the nan2safe arm, at the code before too)
    np.testing.assert_allclose(kept[False][1], kept[True][1], rtol=1e-6)


def test_phases_of_each_run_give_the_arm_their_medians_and_a_table_line(bench):
    split = lambda s, n: {"hlo_passes_s": s, "emit_s": 2 * s, "llvm_s": 3 * s, "llvm_modules": n}  # noqa: E731
    runs = [
        {"lower_s": 1.0, "compile_s": t, "rss_gb": 0.5, "phases": split(t / 10, n)}
        for t, n in ((2.0, 168), (1.0, 168), (3.0, 168))
    ]
    rec = bench._median_run(runs)
    assert rec["phases"] == split(0.2, 168)
    assert (
        bench._median_run([{k: v for k, v in runs[0].items() if k != "phases"}]).get("phases")
        is None
    )
    lines = bench._phase_lines({"plain": rec, "guard": {"error": "killed", "rss_gb": 9.0}})
    assert lines[1] == "  plain      0.20 / 0.40 / 0.60, 168 modules" and len(lines) == 2
    assert bench._phase_lines({"plain": {"compile_s": 1.0}}) == []


def test_host_times_time_each_call_to_its_return_interleaved(bench):
    """A call's host share: a step that returns at once and one that works 20 ms on the host
    before it returns; each arm called ``calls`` times, arms alternating."""
    import time

    import jax.numpy as jnp

    order = []

    def arm(name, host_s):
        def run(batch):
            order.append(name)
            time.sleep(host_s)
            return jnp.asarray(batch)

        return run

    arms = {"plain": arm("plain", 0.0), "slow": arm("slow", 0.02)}
    got = bench.host_times(arms, [1.0, 2.0], calls=3)
    assert [len(v) for v in got.values()] == [3, 3]
    assert min(got["slow"]) >= 0.02 > max(got["plain"])
    assert order == ["plain", "plain", "slow", "slow"] * 3  # the wait, then the timed call
    rec = {"host_median_s": {"plain": 0.004, "slow": 0.008}, "host_calls": 3}
    assert bench._host_lines(rec) == [
        "host time per step call (median of 3, the step before it done): "
        "plain 4.00 ms (1.00x), slow 8.00 ms (2.00x)"
    ]
    assert bench._host_lines({}) == []
