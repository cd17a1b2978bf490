"""benchmarks/probe_set.py: candidate names, the rule that picks the default probe set, and the
knob its residual-growth scenario turns. The measurement itself is the benchmark's (minutes)."""

from __future__ import annotations

from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from nan2safe_jax.probe import DEFAULT_PROBES, PROBE_KINDS

_SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "probe_set.py"


@pytest.fixture(scope="module")
def bench(benchmark_module):
    return benchmark_module("probe_set")


def test_candidate_names(bench):
    assert bench.parse_set("none") == ()
    assert bench.parse_set("default") == DEFAULT_PROBES
    assert bench.parse_set("all") == PROBE_KINDS
    assert bench.parse_set("attn_logits+router_logits") == ("attn_logits", "router_logits")
    rest = bench.parse_set("default-norm_inv_std-loss_logits")
    assert set(rest) == set(DEFAULT_PROBES) - {"norm_inv_std", "loss_logits"}
    for bad in ("default-attn_probs", "nope", "attn_logits+nope"):
        with pytest.raises(ValueError, match="--sets"):
            bench.parse_set(bad)


def _det(lead, prevented=True, false_alarm=None):
    return dict(lead=lead, prevented=prevented, false_alarm=false_alarm)


def _rec(fusions, x_plain=1.0, **scenarios):
    return dict(detection=scenarios, cost=dict(fusions=fusions, x_plain=x_plain))


def test_the_cheapest_set_that_detects_as_early_as_all_is_chosen(bench):
    widest = dict(a=_det(10), b=_det(None, prevented=False))
    records = {
        "all": _rec(100, a=widest["a"], b=widest["b"]),
        "late": _rec(10, a=_det(8), b=_det(None, False)),  # loses 2 steps of lead
        "blind": _rec(11, a=_det(None, prevented=False), b=_det(None, False)),
        "noisy": _rec(12, a=_det(10), b=_det(None, False, false_alarm=40)),  # a false alarm
        "slack": _rec(50, x_plain=1.02, a=_det(9), b=_det(None, False)),  # within 1 step
        "same": _rec(50, x_plain=1.01, a=_det(10), b=_det(None, False)),
    }
    assert not bench.qualifies(records["late"]["detection"], widest, 1)
    assert bench.qualifies(records["late"]["detection"], widest, 2)
    assert not bench.qualifies(records["blind"]["detection"], widest, 100)
    assert not bench.qualifies(records["noisy"]["detection"], widest, 1)
    assert bench.choose(records, 1) == "same"  # fewest fusions, then the lower step time
    assert bench.choose({"all": _rec(1, a=_det(None, False, false_alarm=3))}, 1) is None


def test_embed_scale_knob_grows_the_residual_stream_until_fp16_overflows(bench):
    """The knob is the model's own code, the same on both layer sets: flax's (jitted) here,
    with dropout configured as in the zoo (flax's explicit attention path compiles in fp16 on
    the CPU; its ``dot_product_attention`` path does not)."""
    from examples.transformer import Transformer, TransformerConfig, set_knob

    dt = jnp.float16
    cfg = TransformerConfig(
        num_layers=1,
        d_model=16,
        num_heads=2,
        seq_len=8,
        vocab=11,
        dtype=dt,
        layers="flax",
        attn_dropout=0.1,
    )
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    tokens = jnp.arange(16, dtype=jnp.int32).reshape(2, 8) % 11
    top = float(jnp.max(jnp.abs(model.embed(tokens) + model.pos(jnp.arange(8)))))
    forward = nnx.jit(lambda m, t: m(t))  # a knob is a variable: setting it never recompiles
    y = forward(model, tokens)
    set_knob(model, "embed_scale", 0.5 * 65504 / top)  # large, still in range: finite
    grown = forward(model, tokens)
    assert bool(jnp.all(jnp.isfinite(grown))) and not np.array_equal(grown, y)
    set_knob(model, "embed_scale", 2.0 * 65504 / top)  # the activation itself overflows
    assert not bool(jnp.all(jnp.isfinite(forward(model, tokens))))


def test_the_committed_measurement_is_of_the_current_default(bench):
    """``docs/probe_set.json``'s ``default`` row is the library's default probe set, so the
    README's table says what the default detects and costs."""
    import json

    rec = json.loads((_SCRIPT.parents[1] / "docs" / "probe_set.json").read_text())
    assert tuple(rec["default"]) == DEFAULT_PROBES
    assert tuple(rec["sets"]["default"]["kinds"]) == DEFAULT_PROBES
