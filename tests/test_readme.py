"""benchmarks/readme.py: the README's result tables are what the committed JSON gives."""

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _readme_module():
    spec = importlib.util.spec_from_file_location("bench_readme", ROOT / "benchmarks/readme.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_readme_tables_match_the_committed_json():
    mod = _readme_module()
    text = (ROOT / "README.md").read_text()
    assert text.count("<!-- results:") == len(mod.TABLES)
    assert mod.render(text) == text, "README out of date: run python benchmarks/readme.py"


def test_render_replaces_a_stale_block_and_names_the_command():
    mod = _readme_module()
    stale = "intro\n<!-- results:ops -->\nold numbers\n<!-- /results:ops -->\nafter\n"
    out = mod.render(stale)
    assert "old numbers" not in out and out.startswith("intro\n") and out.endswith("after\n")
    assert "`python benchmarks/ops.py " in out and "--json docs/ops.json" in out
    with pytest.raises(ValueError, match="nosuch"):
        mod.render("<!-- results:nosuch -->\n<!-- /results:nosuch -->")
