"""The fault zoo (benchmarks/zoo.py): the arms' layer sets and the stock-flax faults, and the
data-NaN scenario in `make test`; ln_const and the full sweep are slow."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from nan2safe_jax.site import SiteGear


@pytest.fixture(scope="module")
def zoo(benchmark_module):
    return benchmark_module("zoo")


def test_scenarios_are_complete(zoo):
    assert len(zoo.SCENARIOS) >= 8
    for sc in zoo.SCENARIOS.values():
        assert sc.model in zoo.MODELS and sc.mechanism
        faulty, clean = sc.batches(20, True), sc.batches(20, False)
        assert len(faulty) == len(clean) == 20


def _has_sites(model) -> bool:
    return any(isinstance(v, SiteGear) for _, v in nnx.iter_graph(model))


def test_plain_arm_is_stock_flax_and_nan2safe_swaps_in_sites(zoo):
    """plain/recipe run the model on flax.nnx layers (no site); nan2safe on nan2safe.nn sites,
    with the same parameters from the same seed."""
    assert zoo._layers("plain") == zoo._layers("recipe") == "flax"
    for key, build in zoo.MODELS.items():
        stock, ours = build("flax"), build(zoo._layers("nan2safe"))
        assert not _has_sites(stock) and _has_sites(ours), key
        p1 = nnx.to_pure_dict(nnx.state(stock, nnx.Param))
        p2 = nnx.to_pure_dict(nnx.state(ours, nnx.Param))
        same = jax.tree_util.tree_map(lambda a, b: bool(np.array_equal(a, b)), p1, p2)
        assert jax.tree_util.tree_all(same), key


def test_masked_row_is_a_fault_of_the_users_attention_not_of_flax(zoo):
    """A left-padded batch (fully masked rows): NaN logits in the model's hand-written -inf
    attention on stock flax layers; finite through flax's own attention (dtype-minimum fill)."""
    batch = zoo.lm_batches(1, left_padded=(0,))[0]
    assert not bool(jnp.all(batch["mask"][:, 0]))  # some row starts with padding
    user = zoo.MODELS["lm_user_attn"]("flax")
    stock = zoo.MODELS["lm"]("flax")
    assert not np.all(np.isfinite(np.asarray(user(batch["tokens"], batch["mask"]))))
    assert np.all(np.isfinite(np.asarray(stock(batch["tokens"], batch["mask"]))))


@pytest.mark.slow  # a full Trainer run with a cold tier-2 locate; test_trainer covers the loop fast
def test_ln_const_rows_nan2safe_survives_and_names_the_norm(zoo, tmp_path):
    """LayerNorm eps=0 on constant fp16 rows: plain dies, nan2safe locates the norm's rsqrt."""
    recs = zoo.run_scenario(
        "ln_const_rows", steps=60, arms=("plain", "nan2safe"), reference=False, workdir=tmp_path
    )
    by_arm = {r["arm"]: r for r in recs}
    plain, n2s = by_arm["plain"], by_arm["nan2safe"]
    assert not plain["survived"] and plain["died_at"] is not None
    assert n2s["survived"], n2s
    assert n2s["culprit_correct"] is True, n2s["culprit"]
    assert n2s["culprit"].startswith("norm:")
    assert n2s["steps_lost"] <= 4


def test_data_nan_is_polluted_input(zoo, tmp_path):
    """A NaN in one batch: nan2safe calls it polluted input (no op blamed) and survives."""
    recs = zoo.run_scenario(
        "data_nan", steps=50, arms=("plain", "nan2safe"), reference=False, workdir=tmp_path
    )
    by_arm = {r["arm"]: r for r in recs}
    assert not by_arm["plain"]["survived"]
    n2s = by_arm["nan2safe"]
    assert n2s["survived"] and n2s["polluted_input_reported"]
    assert n2s["culprit"] == "polluted_input" and n2s["culprit_correct"] is None


@pytest.mark.slow
def test_quick_sweep(zoo, tmp_path):
    """The whole --quick sweep: nan2safe survives what kills plain, culprits right."""
    out = tmp_path / "zoo.json"
    assert zoo.main(["--quick", "--json", str(out)]) == 0
    recs = json.loads(out.read_text())
    assert {r["scenario"] for r in recs} == set(zoo.SCENARIOS)
    for name in zoo.SCENARIOS:
        by_arm = {r["arm"]: r for r in recs if r["scenario"] == name}
        n2s = by_arm["nan2safe"]
        if not by_arm["plain"]["survived"]:
            assert n2s["survived"], name
        assert n2s["culprit_correct"] in (True, None), (name, n2s["culprit"])
