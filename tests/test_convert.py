"""nan2safe.nn.convert on a flax.nnx model mixing every convertible layer.

The model: an ``Embed``, a block stack built with ``nnx.vmap`` and run with ``nnx.scan`` (a
``LayerNorm``, a ``MultiHeadAttention`` with a KV-less causal mask, an ``RMSNorm``, a
``Linear``), an ``nnx.List`` of ``Linear``s, an ``nnx.Dict`` holding a ``LinearGeneral``, a
plain dict (``nnx.data``) holding a ``Linear`` with a custom ``dot_general`` (not convertible:
the site owns the matmul), and a ``Dropout`` (no counterpart). One compile per model where the
test compares the two.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax import lax
from tiny_models import jit_llvm_default, set_fast_only

import nan2safe_jax as nan2safe
from nan2safe_jax import nn
from nan2safe_jax.convert import ConvertReport
from nan2safe_jax.site import path_name

D, L, V, T = 8, 2, 11, 5
GRAD_TOL = 1e-6  # relative to the largest gradient: traced gear (tests/test_nn_flax_compat.py)


class Block(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, attn: bool = True):
        self.ln = nnx.LayerNorm(D, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(2, D, decode=False, rngs=rngs) if attn else None
        self.rms = nnx.RMSNorm(D, rngs=rngs)
        self.mlp = nnx.Linear(D, D, rngs=rngs)

    def __call__(self, x):
        if self.attn is not None:
            x = x + self.attn(self.ln(x), is_causal=True)
        else:
            x = x + self.ln(x)
        return x + self.mlp(self.rms(x))


class Model(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, attn: bool = True):
        self.embed = nnx.Embed(V, D, rngs=rngs)

        @nnx.split_rngs(splits=L)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make(rngs):
            return Block(rngs, attn)

        self.blocks = make(rngs)
        self.heads = nnx.List([nnx.Linear(D, D, rngs=rngs), nnx.Linear(D, D, rngs=rngs)])
        self.proj = nnx.Dict({"lg": nnx.LinearGeneral(D, (2, 4), rngs=rngs)})
        custom = functools.partial(lax.dot_general, precision=lax.Precision.HIGHEST)
        self.extra = nnx.data({"odd": nnx.Linear(D, D, dot_general=custom, rngs=rngs)})
        self.drop = nnx.Dropout(0.0)

    def __call__(self, ids):
        x = self.embed(ids)

        @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
        def run(block, x):
            return block(x)

        x = run(self.blocks, x)
        for h in self.heads:
            x = jnp.tanh(h(x))
        x = self.extra["odd"](self.drop(x))
        y = self.proj["lg"](x)
        return jnp.reshape(y, y.shape[:-2] + (-1,)) @ self.embed.embedding[...].T


IDS = jnp.asarray(np.random.default_rng(0).integers(0, V, size=(2, T)), jnp.int32)


def _forward(model):
    graphdef, state = nnx.split(model)
    return jit_llvm_default(lambda s, ids: nnx.merge(graphdef, s)(ids))(state, IDS)


def _out_and_grads(model):
    """One jitted program: the model's output and the gradients of a fixed functional of it."""

    def f(model, ids):
        y = model(ids)
        return jnp.sum(y * jnp.cos(jnp.arange(y.size, dtype=y.dtype)).reshape(y.shape)), y

    grad = nnx.value_and_grad(f, argnums=nnx.DiffState(0, nnx.Param), has_aux=True)
    graphdef, state = nnx.split(model)
    (_, y), g = jit_llvm_default(lambda s, ids: grad(nnx.merge(graphdef, s), ids))(state, IDS)
    return y, g


@pytest.fixture(scope="module")
def pair():
    """``(reference flax model, converted model, report, the original Param objects)``."""
    original = Model(nnx.Rngs(0))
    reference = nnx.clone(original)
    before = {p: v for p, v in nnx.iter_graph(original) if isinstance(v, nnx.Param)}
    converted, report = nn.convert(original, return_report=True)
    return reference, converted, report, before


def test_layers_become_sites_sharing_the_same_param_objects(pair):
    _, model, report, before = pair
    assert isinstance(model.embed, nn.Embed)
    assert isinstance(model.blocks.attn, nn.MultiHeadAttention)
    assert isinstance(model.blocks.ln, nn.LayerNorm) and isinstance(model.blocks.rms, nn.RMSNorm)
    assert isinstance(model.heads[1], nn.Linear) and isinstance(model.proj["lg"], nn.LinearGeneral)
    after = {p: v for p, v in nnx.iter_graph(model) if isinstance(v, nnx.Param)}
    assert set(after) == set(before)
    assert all(after[p] is before[p] for p in before)  # the very objects: nothing copied
    assert isinstance(report, ConvertReport)


def test_param_tree_and_optimizer_state_fit_both_ways(pair):
    reference, model, _, _ = pair
    ps_ref, ps_new = nnx.state(reference, nnx.Param), nnx.state(model, nnx.Param)
    assert jax.tree.structure(ps_ref) == jax.tree.structure(ps_new)
    for a, b in zip(jax.tree.leaves(ps_ref), jax.tree.leaves(ps_new), strict=True):
        np.testing.assert_array_equal(a, b)
    tx = optax.adam(1e-3)
    assert jax.tree.structure(tx.init(ps_ref)) == jax.tree.structure(tx.init(ps_new))
    # a flax checkpoint of the params restores into the converted model and back
    other = Model(nnx.Rngs(7))
    fresh = nn.convert(Model(nnx.Rngs(3)))
    nnx.update(fresh, nnx.state(other, nnx.Param))
    back = Model(nnx.Rngs(5))
    nnx.update(back, nnx.state(fresh, nnx.Param))
    for a, b in zip(
        jax.tree.leaves(nnx.state(other, nnx.Param)),
        jax.tree.leaves(nnx.state(back, nnx.Param)),
        strict=True,
    ):
        np.testing.assert_array_equal(a, b)


def test_fast_outputs_equal_bit_for_bit(pair):
    reference, model, _, _ = pair
    np.testing.assert_array_equal(np.asarray(_forward(model)), np.asarray(_forward(reference)))


def test_fast_gradients_within_tolerance():
    """Every layer kind but attention, in the same structure (attention's FAST gradients
    against flax's are tests/test_nn_flax_compat.py's; left out here to keep this file's
    compile time down)."""
    reference = Model(nnx.Rngs(1), attn=False)
    model = nn.convert(nnx.clone(reference))
    y_ref, g_ref = _out_and_grads(reference)
    y_new, g_new = _out_and_grads(model)
    np.testing.assert_array_equal(np.asarray(y_new), np.asarray(y_ref))  # bit-for-bit
    # relative to the largest gradient of the model (a traced gear: the last bits may differ)
    scale = max(float(np.abs(np.asarray(b)).max()) for b in jax.tree.leaves(g_ref))
    for a, b in zip(jax.tree.leaves(g_new), jax.tree.leaves(g_ref), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=GRAD_TOL * scale)


def test_report_names_sites_and_what_was_left_alone(pair):
    _, model, report, _ = pair
    got = {c.path: c for c in report.converted}
    assert set(got) == {
        "embed",
        "blocks.ln",
        "blocks.attn",
        "blocks.rms",
        "blocks.mlp",
        "heads.0",
        "heads.1",
        "proj.lg",
    }
    assert got["blocks.attn"].stack == (L,) and got["embed"].stack == ()
    assert set(got["blocks.attn"].sites) == {
        "blocks.attn",
        "blocks.attn.query",
        "blocks.attn.key",
        "blocks.attn.value",
        "blocks.attn.out",
    }
    assert report.sites == nan2safe.site.name_sites(model)
    assert report.sites["blocks.ln"] == (L,) and report.sites["heads.0"] == ()
    assert model.blocks.attn.probe_logits.get_value().shape[0] == L  # per-layer probes
    left = {a.path: a for a in report.left_alone}
    assert "dot_general" in left["extra.odd"].reason and left["extra.odd"].cls == "Linear"
    assert "no nan2safe.nn counterpart" in left["drop"].reason
    assert "outside every site" in left[""].reason and left["blocks"].cls == "Block"
    text = str(report)
    assert "blocks.attn: nnx.MultiHeadAttention stacked [2]" in text and "extra.odd" in text
    assert "tier 1 has no probe there" in text  # a hand-written attention's logits (newuser46)


def test_a_layer_under_two_attributes_is_one_site_named_in_the_report():
    """A tied layer (the same module under two attributes) becomes one site, shared under both
    names; the report names that site on its converted line, not an empty list plus "already
    sites"."""

    class Tied(nnx.Module):
        def __init__(self, rngs):
            self.shared = nnx.Linear(4, 4, rngs=rngs)
            self.a = self.shared
            self.mha = nnx.MultiHeadAttention(2, 4, qkv_features=4, decode=False, rngs=rngs)
            self.b = self.mha

    model, report = nn.convert(Tied(nnx.Rngs(0)), return_report=True)
    assert model.a is model.shared and isinstance(model.a, nn.Linear)
    got = {c.path: c.sites for c in report.converted}
    assert len(got) == 2 and set(report.sites) == {n for names in got.values() for n in names}
    (linear,) = (names for names in got.values() if len(names) == 1)
    assert linear[0] in ("a", "shared")
    (mha,) = (names for names in got.values() if len(names) == 5)
    assert {n.split(".")[0] for n in mha} in ({"mha"}, {"b"})
    assert "already sites" not in str(report) and " -> \n" not in str(report) + "\n"


def test_include_exclude_and_bad_arguments():
    m, rep = nn.convert(Model(nnx.Rngs(0)), exclude=["blocks.*", nnx.Embed], return_report=True)
    assert isinstance(m.blocks.ln, nnx.LayerNorm) and isinstance(m.embed, nnx.Embed)
    assert isinstance(m.heads[0], nn.Linear)
    assert {a.path for a in rep.left_alone if a.reason == "excluded"} >= {"blocks.ln", "embed"}
    m = nn.convert(Model(nnx.Rngs(0)), include="LayerNorm")
    assert isinstance(m.blocks.ln, nn.LayerNorm) and isinstance(m.heads[0], nnx.Linear)
    one = nn.convert(nnx.Linear(2, 3, rngs=nnx.Rngs(0)))  # the root itself
    assert isinstance(one, nn.Linear)
    with pytest.raises(ValueError, match="include"):
        nn.convert(Model(nnx.Rngs(0)), include=[3])
    with pytest.raises(ValueError, match="model"):
        nn.convert({"a": 1})


class _Dense(nnx.Linear):
    """A project's own name for flax's Linear (type-based rules read it): no code of its own."""

    def __init__(self, *args, tag="dense", **kwargs):
        super().__init__(*args, **kwargs)
        self.tag = tag


class _Scaled(nnx.Linear):
    def __call__(self, x):  # code a site would not run
        return super().__call__(x) * 2.0


class _Helper:
    def helper(self):
        return 1


class _Mixed(nnx.Linear, _Helper):  # a mixin's method after the flax base
    pass


class _Holder(nnx.Module):  # a container: no code
    def __init__(self, rngs):
        self.dense = _Dense(4, 4, rngs=rngs)
        self.scaled = _Scaled(4, 4, rngs=rngs)
        self.mixed = _Mixed(4, 4, rngs=rngs)
        self.plain = nnx.Linear(4, 4, rngs=rngs)
        self.alias = self.plain


def test_subclasses_are_converted_when_named_and_their_own_code_is_said():
    model, report = nn.convert(_Holder(nnx.Rngs(0)), exclude=["alias"], return_report=True)
    left = {a.path: a.reason for a in report.left_alone}
    assert (
        isinstance(model.dense, _Dense) and "converted only when include= names it" in left["dense"]
    )
    assert isinstance(model.scaled, _Scaled) and "code of its own (__call__)" in left["scaled"]
    assert isinstance(model.mixed, _Mixed) and "code of its own (helper)" in left["mixed"]
    assert "" not in left  # a container with no code is no "user code outside every site"
    # one layer under two paths, one excluded: said, not silently converted at the other
    assert isinstance(model.plain, nn.Linear) and "shared with plain" in left["alias"]

    stock = _Holder(nnx.Rngs(0))
    x = jnp.linspace(-1, 1, 8, dtype=jnp.float32).reshape(2, 4)
    want = stock.dense(x)
    model, report = nn.convert(stock, include=[_Dense], return_report=True)
    assert isinstance(model.dense, nn.Linear) and model.dense.tag == "dense"
    np.testing.assert_array_equal(np.asarray(model.dense(x)), np.asarray(want))
    assert [(c.path, c.flax_class) for c in report.converted] == [("dense", "Linear (_Dense)")]
    assert isinstance(model.scaled, _Scaled)  # include= does not override its own code
    m2 = nn.convert(_Holder(nnx.Rngs(0)), include=[nnx.Linear])  # the flax base names it too
    assert isinstance(m2.dense, nn.Linear) and isinstance(m2.scaled, _Scaled)


def test_converted_model_trains_with_per_layer_gears(pair):
    _, model, _, _ = pair
    state = nan2safe.TrainState.create(model, optax.sgd(0.1))
    assert state.gear.sites["blocks.attn"].shape == (L,)
    assert "blocks.attn.probe_logits[1]" in state.detector.names


class _Recurrent(nnx.Module):
    def __init__(self, cell, dtype, rngs):
        make = {"lstm": nnx.LSTMCell, "gru": nnx.GRUCell, "simple": nnx.SimpleCell}[cell]
        self.rnn = nnx.RNN(make(4, 8, dtype=dtype, param_dtype=jnp.float32, rngs=rngs))
        self.head = nnx.Linear(8, 2, dtype=dtype, param_dtype=jnp.float32, rngs=rngs)

    def __call__(self, x):
        return self.head(self.rnn(x)[:, -1])


@pytest.mark.parametrize(
    "cell, dtype",
    [("lstm", jnp.float32), ("lstm", jnp.float16), ("gru", jnp.float32), ("gru", jnp.float16)]
    + [("simple", jnp.float32)],  # (flax's fp16 SimpleCell does not run: its carry turns f32)
    ids=["lstm-f32", "lstm-f16", "gru-f32", "gru-f16", "simple-f32"],
)
def test_the_layers_inside_flax_recurrent_cells_are_converted(cell, dtype):
    """nnx.RNN and its cells have no site of their own, but their nnx.Linear layers do: they
    were left as they were (only the head became a site, and the report named none of them),
    which a user reads as a protected LSTM. FAST (the train step's FAST-only program) still
    computes what flax computes, bit for bit."""
    reference = _Recurrent(cell, dtype, nnx.Rngs(0))
    model, report = nn.convert(nnx.clone(reference), return_report=True)
    inner = {c.path for c in report.converted} - {"head"}
    linears = {
        path_name(p)
        for p, m in nnx.iter_graph(reference)
        if type(m) is nnx.Linear and path_name(p) != "head"
    }
    assert linears and inner == linears, (inner, linears)
    left = {a.path: a.cls for a in report.left_alone}
    assert left["rnn"] == "RNN" and left["rnn.cell"] == type(reference.rnn.cell).__name__
    x = jax.random.normal(jax.random.key(1), (3, 5, 4)).astype(dtype)

    def run(module):  # at XLA's default LLVM level, as the suite's other bit comparisons
        graphdef, state = nnx.split(module)
        return jit_llvm_default(lambda s, x: nnx.merge(graphdef, s)(x))(state, x)

    fast = set_fast_only(nnx.clone(model))
    np.testing.assert_array_equal(np.asarray(run(fast)), np.asarray(run(reference)))
