"""End to end on two public flax.nnx models nobody here wrote (slow: kept out of ``make test``).

- examples/gemma_nnx.py (the Flax NNX Gemma example, condensed): fp16 compute turns the
  model's own ``K_MASK`` fill into ``-inf``, a left-padded row makes fully masked attention
  rows and the softmax 0/0. Adopted by ``convert`` plus its attention core as an ``nn.Site``.
- examples/nnx_cnn.py (the Flax NNX MNIST tutorial's CNN): an fp16 overflow in ``linear1``.

Each runs ``Trainer`` through the fault: it survives (no ``NanIncidentError``, finite
parameters, finite losses after the fault) and tier 2 names the culprit site. The fast tests of
the same behaviours are tests/test_convert.py and tests/test_user_site.py.
"""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest

import nan2safe_jax as nan2safe
from examples import gemma_nnx, nnx_cnn

pytestmark = pytest.mark.slow


def _fit(model, loss_fn, batches, workdir):
    cfg = nan2safe.Config(checkpoint_every=4)
    with nan2safe.Trainer(model, optax.adam(1e-3), loss_fn, cfg, workdir) as trainer:
        history = trainer.fit(batches, len(batches))
        events = list(trainer.events)
        params = trainer.state.params
    located = [e["report"]["site"] for e in events if e["type"] == "locate"]
    assert all(np.isfinite(np.asarray(p)).all() for p in jax.tree.leaves(params))
    return history, events, located


def test_gemma_fully_masked_rows_in_fp16(tmp_path):
    model, report = gemma_nnx.build()
    assert {c.path for c in report.converted} == {
        f"layers.{i}.mlp.{p}" for i in range(2) for p in ("gate_proj", "up_proj", "down_proj")
    }
    left = {a.path: a.reason for a in report.left_alone}
    assert "outside every site" in left["layers.0.attn"]  # the hand-written attention
    assert "layers.1.attn.core" in report.sites  # ... whose core is a user site
    cfg = gemma_nnx.Config()
    pads = {1: 3, 3: 3}  # steps whose last row is left-padded
    batches = [
        gemma_nnx.make_batch(jax.random.key(i), cfg, left_pad=pads.get(i, 0)) for i in range(6)
    ]
    history, events, located = _fit(model, gemma_nnx.loss_fn, batches, tmp_path)
    assert not np.isfinite(history[1]["loss"])  # the fault happened, at FAST
    # Step 1's fault puts layer 0's core in SAFE; at step 3 (layer 0 still in SAFE) layer 1's
    # FAST core makes it: layer 1 is named, not layer 0 again (which rolled back and doubled
    # layer 0's SAFE stay for every padded batch, newuser29).
    assert located == ["layers.0.attn.core", "layers.1.attn.core"], located
    assert not any(e["type"] in ("rollback", "error") for e in events)
    assert np.isfinite(history[-1]["loss"]) and not any(e.get("hint") for e in events)


def test_cnn_fp16_overflow_in_linear1(tmp_path):
    model, report = nnx_cnn.build(faulty=True)
    assert {c.path for c in report.converted} == {"conv1", "conv2", "linear1", "linear2"}
    batches = [nnx_cnn.make_batch(jax.random.key(i)) for i in range(6)]
    history, events, located = _fit(model, nnx_cnn.loss_fn, batches, tmp_path)
    assert not np.isfinite(history[0]["loss"])
    assert located and located[0] == "linear1"
    enter = [e for e in events if e["type"] == "safe_enter"]
    assert enter[0]["site"] == "linear1"
    assert all(np.isfinite(h["loss"]) for h in history[1:])
