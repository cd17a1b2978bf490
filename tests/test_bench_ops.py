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
