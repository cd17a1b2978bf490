"""Runs an adopted example model through its fault with a ``Trainer`` and prints what happened
(``python -m examples.gemma_nnx``, ``python -m examples.nnx_cnn``)."""

from __future__ import annotations

import tempfile

import numpy as np
import optax

import nan2safe_jax as nan2safe


def fit_through_the_fault(model, loss_fn, batches, report) -> None:
    """Prints ``convert``'s report, one line per step (loss, gear, SAFE sites) and each tier-2
    report; the workdir is a temporary folder."""
    print(report)
    cfg = nan2safe.Config(checkpoint_every=4)
    with tempfile.TemporaryDirectory() as workdir:
        with nan2safe.Trainer(model, optax.adam(1e-3), loss_fn, cfg, workdir) as trainer:
            history = trainer.fit(batches, len(batches))
            events = list(trainer.events)
    for h in history:
        safe = ", ".join(h["safe_sites"]) or "-"
        print(f"step {h['step']}: loss {h['loss']:.4g}  gear {h['gear']}  SAFE: {safe}")
    for e in events:
        if e["type"] == "locate":
            r = e["report"]
            print(f"step {e['step']}: tier 2 names {r['site']} ({r['primitive']}, {r['source']})")
    print("survived:", bool(np.isfinite(history[-1]["loss"])))
