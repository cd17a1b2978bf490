"""Config.probes (which probe kinds a step traces) and gears that share one compiled path."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import nan2safe_jax as nan2safe
from nan2safe_jax import nn, ops, probe


class _Tiny(nnx.Module):
    def __init__(self, *, rngs):
        self.ln = nn.LayerNorm(8, rngs=rngs)
        self.attn = nn.MultiHeadAttention(2, 8, decode=False, rngs=rngs)
        self.head = nn.Linear(8, 5, probe=True, rngs=rngs)
        self.loss = nn.CrossEntropy()

    def __call__(self, x, labels):
        return self.loss(self.head(self.attn(self.ln(x))), labels)


def _loss(model, batch):
    return model(batch["x"], batch["y"])


def _batch():
    x = jnp.asarray(np.random.default_rng(0).normal(size=(2, 4, 8)), jnp.float32)
    return {"x": x, "y": jnp.zeros((2, 4), jnp.int32)}


@pytest.mark.parametrize("bad", ["attn_logits", ("nope",), ("loss_logits", "loss_logits"), 3])
def test_bad_probe_set_raises(bad):
    with pytest.raises(ValueError, match="Config.probes"):
        nan2safe.Config(probes=bad)


@pytest.mark.parametrize(
    "kinds, present, absent",
    [
        # each case compiles a train step: the widest and the empty set in make test
        pytest.param(
            probe.DEFAULT_PROBES,
            ["attn.probe_logits", "ln.probe_inv_std"],
            ["attn.probe_probs"],
            marks=pytest.mark.slow,
        ),
        (probe.PROBE_KINDS, ["attn.probe_probs", "head.probe_output"], []),
        pytest.param(
            ("attn_probs",),
            ["attn.probe_probs"],
            ["attn.probe_logits", "ln.probe_output"],
            marks=pytest.mark.slow,
        ),
        ((), [], ["attn.probe_logits", "loss.probe_logits", "head.probe_output"]),
    ],
)
def test_step_watches_only_the_configured_kinds(kinds, present, absent):
    state = nan2safe.TrainState.create(
        _Tiny(rngs=nnx.Rngs(0)), optax.sgd(0.1), nan2safe.Config(probes=kinds)
    )
    state, m = nan2safe.make_train_step(_loss, fast_program=True)(state, _batch())  # FAST only
    names = set(state.detector.names)
    assert names == set(m["probes"])
    assert {"loss", "grad_norm", "update_norm"} <= names
    assert all(p in names for p in present) and not any(p in names for p in absent)
    for p in present:  # a watched probe was written by the step
        assert float(m["probes"][p][probe.MAX_ABS]) > 0


def test_probe_set_off_traces_no_statistic():
    """A kind that is off is not traced: the attention's probability max disappears."""
    graphdef, state = nnx.split(nn.MultiHeadAttention(2, 8, decode=False, rngs=nnx.Rngs(0)))
    x = _batch()["x"]

    def eqns(kinds):
        with probe.probe_set(kinds):
            jaxpr = jax.make_jaxpr(lambda s, x: nnx.merge(graphdef, s)(x))(state, x)
        return str(jaxpr).count("reduce_max")  # the printed jaxpr includes every branch

    assert eqns(("attn_logits",)) < eqns(("attn_logits", "attn_probs"))


def _branch_counts(f, *args):
    """Branches of each gear ``cond`` in ``f``'s forward (inside the op's ``custom_vjp``; the
    branches themselves are not searched)."""

    def counts(jaxpr):
        out = []
        for e in jaxpr.eqns:
            if e.primitive.name == "cond":
                out.append(len(e.params["branches"]))
                continue
            for p in e.params.values():
                inner = getattr(p, "jaxpr", p)
                if hasattr(inner, "eqns"):
                    out += counts(inner)
        return out

    return counts(jax.make_jaxpr(f)(*args).jaxpr)


@pytest.mark.parametrize("dt, branches", [(jnp.float32, [2]), (jnp.float16, [3])])
def test_identical_paths_share_one_branch(dt, branches):
    """An f32 Linear's STABLE is its FAST: two compiled paths, not three (fp16 keeps three)."""
    x = jnp.ones((2, 4), dt)
    w = jnp.full((4, 3), 0.5, dt)
    assert _branch_counts(lambda x, g: ops.linear(x, w, None, gear=g), x, jnp.int32(0)) == branches
    f = jax.jit(lambda x, g: ops.linear(x, w, None, gear=g))
    fast = f(x, jnp.int32(0))
    for g in (1, 2):  # every gear still runs and agrees on this benign input
        np.testing.assert_allclose(np.asarray(f(x, jnp.int32(g)), np.float32), fast, rtol=1e-3)
