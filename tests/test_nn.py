"""Tests for nan2safe_jax.nn sites and the example transformer."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from tiny_models import set_fast_only

from examples.transformer import Transformer, TransformerConfig, lm_loss, make_batch, set_knob
from nan2safe_jax import detector, nn, replay, site
from nan2safe_jax.site import Probe, SiteGear

F32, F16 = jnp.float32, jnp.float16


def _finite(tree) -> bool:
    return all(bool(jnp.all(jnp.isfinite(jnp.asarray(t, F32)))) for t in jax.tree.leaves(tree))


def _set_gears(model, value, name: str | None = None, index: int | None = None) -> None:
    """Writes a gear into every site (or the site ``name``; layer ``index`` of a stack)."""
    for n, var in site.site_gears(model).items():
        if name is not None and n != name:
            continue
        cur = var[...]
        new = jnp.full(cur.shape, value, jnp.int32) if index is None else cur.at[index].set(value)
        var[...] = new


def _functional(model):
    """A pure loss over (params, rest, batch) as the train step uses it (split/merge)."""
    graphdef, _, _ = nnx.split(model, nnx.Param, ...)

    def loss(params, rest, batch):
        m = nnx.merge(graphdef, params, rest, copy=True)
        return lm_loss(m, batch), nnx.state(m, Probe)

    return loss


def _split(model):
    _, params, rest = nnx.split(model, nnx.Param, ...)
    return params, rest


# ---------------------------------------------------------------------------------------------
# a tiny fp16 model with scanned layers, shared by the tests below (compiled once: every site
# compiles its three gears, forward and backward, so this is the expensive part of the file)

TINY = TransformerConfig(
    num_layers=2,
    d_model=16,
    num_heads=2,
    seq_len=8,
    vocab=16,
    dtype=F16,
    scan_layers=True,
    norm="rms",
)


@pytest.fixture(scope="module")
def tiny():
    model = Transformer(TINY, rngs=nnx.Rngs(0))
    site.name_sites(model)
    batch = make_batch(jax.random.key(1), TINY, 2)
    step = jax.jit(jax.value_and_grad(_functional(model), has_aux=True))
    return model, batch, step


def test_site_attributes():
    rngs = nnx.Rngs(0)
    mods = {
        "Linear": nn.Linear(4, 3, rngs=rngs),
        "Embed": nn.Embed(5, 4, rngs=rngs),
        "LayerNorm": nn.LayerNorm(4, rngs=rngs),
        "RMSNorm": nn.RMSNorm(4, rngs=rngs),
        "MultiHeadAttention": nn.MultiHeadAttention(2, 4, rngs=rngs),
        "Router": nn.Router(4, 3, 2, rngs=rngs),
        "CrossEntropy": nn.CrossEntropy(),
    }
    probes = {
        "Linear": set(),  # opt-in: probe=True
        "Embed": set(),
        "LayerNorm": {"probe_output", "probe_inv_std", "probe_input"},
        "RMSNorm": {"probe_output", "probe_inv_std", "probe_input"},
        "MultiHeadAttention": {"probe_logits", "probe_probs"},
        "Router": {"probe_logits"},
        "CrossEntropy": {"probe_logits"},
    }
    for name, m in mods.items():
        assert isinstance(m.gear, SiteGear) and m.gear[...].shape == ()
        assert m.gear[...].dtype == jnp.int32 and m.site_name == name
        found = {k for k, v in vars(m).items() if isinstance(v, Probe)}
        assert found == probes[name], name
        for k in found:
            assert getattr(m, k)[...].shape == (detector.NUM_STATS,)
    lin = nn.Linear(4, 3, probe=True, rngs=rngs)
    emb = nn.Embed(5, 4, probe=True, rngs=rngs)
    lin(jnp.full((2, 4), jnp.inf))
    emb(jnp.arange(3))
    assert float(lin.probe_output[...][3]) == 1.0  # the non-finite flag
    assert float(emb.probe_output[...][0]) > 0


def _copy_into(dst, src_vals):
    for k, v in src_vals.items():
        getattr(dst, k)[...] = v


@pytest.mark.parametrize("kind", ["Linear", "Embed", "LayerNorm", "RMSNorm", "MultiHeadAttention"])
def test_fast_matches_flax(kind):
    """Same constructor, same parameters: the FAST gear computes what flax.nnx computes."""
    r = np.random.default_rng(0)
    x = jnp.asarray(r.normal(size=(2, 5, 8)), F32)
    args = {
        "Linear": (8, 6),
        "Embed": (7, 8),
        "LayerNorm": (8,),
        "RMSNorm": (8,),
        "MultiHeadAttention": (2, 8),
    }[kind]
    ref = getattr(nnx, kind)(*args, rngs=nnx.Rngs(0))
    ours = getattr(nn, kind)(*args, rngs=nnx.Rngs(1))
    # same parameter tree as flax (MultiHeadAttention too: [in, h, d] / [h, d, out] kernels)
    _, ref_params = nnx.split(ref, nnx.Param)
    nnx.update(ours, jax.tree.map(lambda a: a + 0.1, ref_params))
    nnx.update(ref, jax.tree.map(lambda a: a + 0.1, ref_params))
    if kind == "MultiHeadAttention":
        mask = jnp.asarray(r.random((2, 1, 5, 5)) > 0.3) | jnp.eye(5, dtype=bool)
        want = ref(x, mask=mask, decode=False)
        got = ours(x, mask=mask)
    else:
        inp = jnp.asarray(r.integers(0, 7, size=(2, 5))) if kind == "Embed" else x
        want, got = ref(inp), ours(inp)
    np.testing.assert_array_equal(got, want)  # bit-for-bit (tests/test_nn_flax_compat.py)


def test_mha_call_conventions():
    rngs = nnx.Rngs(0)
    m = nn.MultiHeadAttention(2, 8, qkv_features=12, out_features=6, normalize_qk=True, rngs=rngs)
    assert isinstance(m.query_ln, nn.LayerNorm) and isinstance(m.key_ln, nn.LayerNorm)
    graphdef, state = nnx.split(m)
    x = jax.ShapeDtypeStruct((2, 5, 8), F32)
    kv = jax.ShapeDtypeStruct((2, 3, 8), F32)

    def calls(state, x, kv):  # shapes only: traced, never compiled
        m = nnx.merge(graphdef, state, copy=True)
        mask = jnp.ones((2, 1, 5, 3), bool)
        return m(x), m(x, kv, mask=mask, deterministic=True), m(x[0], is_causal=True)

    self_attn, cross, unbatched = jax.eval_shape(calls, state, x, kv)
    assert self_attn.shape == cross.shape == (2, 5, 6) and unbatched.shape == (5, 6)
    # decode, dropout and grouped KV heads are supported now (tests/test_nn_flax_compat.py)
    for bad in (dict(num_kv_heads=3), dict(qkv_features=7), dict(attention_fn=lambda *a: a)):
        with pytest.raises(ValueError):
            nn.MultiHeadAttention(2, 8, rngs=rngs, **bad)
    with pytest.raises(ValueError, match="integers"):
        nn.Embed(3, 2, rngs=rngs)(jnp.ones(2))


def test_probes_are_stacked_under_scan(tiny):
    model, batch, step = tiny
    _set_gears(model, 0)
    (loss, probes), _ = step(*_split(model), batch)
    assert _finite(loss)
    logits = probes["blocks"]["attn"]["probe_logits"][...]
    assert logits.shape == (TINY.num_layers, detector.NUM_STATS)
    assert np.all(np.asarray(logits[:, 0]) > 0)  # written by every layer
    assert not np.allclose(logits[0], logits[1])  # per layer, not broadcast
    assert probes["blocks"]["ln1"]["probe_inv_std"][...].shape == (2, detector.NUM_STATS)
    assert float(probes["loss"]["probe_logits"][...][0]) > 0


def test_gear_switch_in_jitted_step_never_recompiles(tiny, count_compiles):
    model, batch, step = tiny
    settings = [(0, None, None), (1, None, None), (2, "blocks.attn", 1), (2, "loss", None)]
    states = []
    for value, name, index in settings:  # build the inputs first: eager ops compile too
        _set_gears(model, 0)
        _set_gears(model, value, name, index)
        states.append(_split(model))
    _set_gears(model, 0)
    jax.block_until_ready(step(*states[0], batch))
    with count_compiles() as c:
        outs = [step(*s, batch) for s in states]
        jax.block_until_ready(outs)
    assert c.count == 0
    losses = [float(o[0][0]) for o in outs]
    assert all(np.isfinite(losses))
    np.testing.assert_allclose(losses, losses[0], rtol=2e-2)  # same model, different paths


def test_fault_injection_and_one_layer_safe(tiny):
    """A q·k scale grown 1e5x in layer 1 only: the probe sees it in that layer; SAFE there runs.

    It is not a fault at FAST any more: flax's default attention (``jax.nn.dot_product_attention``)
    takes even fp16 logits in f32, and its softmax turns +inf logits into a one-hot row, so a
    stock flax model survives this knob; the old FAST path (fp16 logits) died of it.
    """
    model, batch, step = tiny
    _set_gears(model, 0)
    set_knob(model, "qk_scale", 1e5, layer=1)
    try:
        (loss, probes), _ = step(*_split(model), batch)
        assert np.isfinite(float(loss)), "flax's f32 logits do not overflow"
        top = np.asarray(probes["blocks"]["attn"]["probe_logits"][...][:, 0])
        assert top[1] > 1e3 * top[0]  # the probe sees the growth, in the right layer
        _set_gears(model, 2, "blocks.attn", 1)
        (loss, probes), grads = step(*_split(model), batch)
        assert np.isfinite(float(loss)) and _finite(grads)
    finally:
        set_knob(model, "qk_scale", 1.0)
        _set_gears(model, 0)


def _fp16_layer(kind):
    """``(layer, x, weight path, f32 forward of (weights, x))`` of an fp16 layer with f32
    weights."""
    rngs, x = nnx.Rngs(0), jnp.asarray(np.full((2, 4), 1e-3), jnp.float16)
    if kind == "Linear":
        layer = nn.Linear(4, 3, dtype=jnp.float16, rngs=rngs)
        return layer, x, "kernel", lambda w, x=x: x.astype(jnp.float32) @ w + layer.bias[...]
    if kind == "LinearGeneral":
        layer = nn.LinearGeneral(4, (3, 2), dtype=jnp.float16, rngs=rngs)
        ref = lambda w, x=x: jnp.einsum("bi,ijk->bjk", x.astype(jnp.float32), w) + layer.bias[...]
        return layer, x, "kernel", ref
    layer = nn.Embed(3, 4, dtype=jnp.float16, rngs=rngs)
    return layer, x, "embedding", lambda w, x=x: x.astype(jnp.float32) @ w.T


@pytest.mark.parametrize("past", ["weight", "input"])
@pytest.mark.parametrize("kind", ["Linear", "LinearGeneral", "Embed.attend"])
def test_an_fp16_layer_whose_f32_operand_overflows_the_cast_is_located_and_safe_computes_it(
    kind, past
):
    """A stored f32 weight, or an f32 input, past 65504 is inf once promoted to fp16. Tier 2
    names the site (the promotion is inside its scope, not an anonymous cast before it), and
    SAFE computes the layer from the f32 operands, as the f32 reference does (an input cast
    before the gear was chosen made it inf at every gear: "failed again in SAFE", rollbacks,
    doubling stays)."""
    from nan2safe_jax import replay

    layer, x, name, ref = _fp16_layer(kind)
    w = getattr(layer, name)
    if past == "weight":
        w[...] = w[...].reshape(-1).at[1].set(1e5).reshape(w.shape)
    else:
        x = x.astype(jnp.float32).at[0, 1].set(1e5)
    call = layer.attend if kind == "Embed.attend" else layer
    out = {}
    for g in (0, 2):
        layer.gear[...] = jnp.asarray(g, layer.gear[...].dtype)
        out[g] = call(x)
    assert out[0].dtype == out[2].dtype == jnp.float16 and not _finite(out[0])
    assert _finite(out[2])
    want = np.clip(ref(w[...], x), -65504, 65504)  # the saturating cast back to fp16
    np.testing.assert_allclose(np.asarray(out[2], np.float32), want, rtol=2e-3, atol=1e-3)
    layer.gear[...] = jnp.asarray(0, layer.gear[...].dtype)
    report = replay.locate(jax.make_jaxpr(call)(x), (x,))
    assert report.primitive == "convert_element_type" and report.site == type(layer).__name__


@pytest.mark.parametrize("kind", ["LayerNorm", "RMSNorm"])
def test_an_fp16_norm_whose_f32_input_overflows_the_cast_is_located_and_safe_computes_it(kind):
    """As the Linear family above: an f32 input past 65504 into an fp16 norm was cast before
    the gear was chosen, so SAFE normalised infs (NaN at every gear). SAFE reads the f32 input
    now and matches the f64 reference; FAST stays flax's (inf, then NaN)."""
    from nan2safe_jax import replay

    layer = getattr(nn, kind)(4, dtype=jnp.float16, rngs=nnx.Rngs(0))
    twin = getattr(nnx, kind)(4, dtype=jnp.float16, rngs=nnx.Rngs(0))
    x = jnp.asarray([[1e5, -1e5, 5e4, 0.0], [1.0, 2.0, 3.0, 4.5]], jnp.float32)
    out = {}
    for g in (0, 2):
        layer.gear[...] = jnp.asarray(g, layer.gear[...].dtype)
        out[g] = layer(x)
    assert out[0].dtype == out[2].dtype == jnp.float16
    np.testing.assert_array_equal(np.asarray(out[0]), np.asarray(twin(x)))  # flax's, NaN
    assert not _finite(out[0]) and _finite(out[2])
    x64 = np.asarray(x, np.float64)
    centred = x64 - x64.mean(-1, keepdims=True) if kind == "LayerNorm" else x64
    want = centred / np.sqrt(np.mean(np.square(centred), -1, keepdims=True) + 1e-6)
    np.testing.assert_allclose(np.asarray(out[2], np.float64), want, rtol=2e-3, atol=2e-3)
    layer.gear[...] = jnp.asarray(0, layer.gear[...].dtype)
    report = replay.locate(jax.make_jaxpr(layer)(x), (x,))
    assert report.primitive == "convert_element_type" and report.site == kind


def test_router_fault_injection():
    """fp16 router scores past 65504 (growing router weights): NaN gates in FAST, SAFE fixes."""
    router = nn.Router(8, 4, 2, dtype=F16, rngs=nnx.Rngs(0))
    router.kernel[...] = jnp.full((8, 4), 1.0).at[0].set(jnp.asarray([1.0, 0.9, 0.8, 0.7]))
    x = jnp.full((3, 8), 100.0, F16)
    graphdef, params, rest = nnx.split(router, nnx.Param, ...)

    @jax.jit
    def run(params, rest, x):
        def f(params):
            r = nnx.merge(graphdef, params, rest, copy=True)
            out = r(x)
            return jnp.sum(out.gates.astype(F32) * jnp.asarray([1.0, -1.0])), (
                out,
                r.probe_logits[...],
            )

        return jax.value_and_grad(f, has_aux=True)(params)

    outs = []
    for gear, scale in ((0, 1.0), (0, 100.0), (2, 100.0)):
        router.gear[...] = jnp.int32(gear)
        router.logit_scale[...] = jnp.float32(scale)
        outs.append(run(*nnx.split(router, nnx.Param, ...)[1:], x))
    (_, (ok, _)), _ = outs[0]
    assert _finite(ok.gates)
    (_, (bad, probe)), _ = outs[1]
    assert not _finite(bad.gates) and float(probe[4]) == 1.0  # the probe shows the overflow
    (_, (safe, _)), grads = outs[2]
    assert _finite(safe.gates) and _finite(grads) and safe.gates.dtype == F16
    np.testing.assert_array_equal(np.asarray(safe.indices), np.asarray(ok.indices))


def _walk(jaxpr, out, prefix=""):
    """(primitive, full name stack) of every equation, entering nested jaxprs.

    A nested jaxpr's equations (scan body, cond branch, pjit) carry a name stack relative to
    the equation that holds them; the full stack is the parent's stack joined with it.
    """
    for eqn in jaxpr.eqns:
        own = str(eqn.source_info.name_stack)
        full = "/".join(p for p in (prefix, own) if p)
        out.append((eqn.primitive.name, full))
        for v in eqn.params.values():
            for sub in v if isinstance(v, (tuple, list)) else (v,):
                if hasattr(sub, "jaxpr") and hasattr(sub, "consts"):
                    _walk(sub.jaxpr, out, full)
                elif hasattr(sub, "eqns"):
                    _walk(sub, out, full)
    return out


def test_name_stack_maps_equations_to_sites(tiny):
    model, batch, _ = tiny
    names = site.name_sites(model)
    assert {"blocks.attn", "blocks.ln1", "blocks.mlp.fc1", "head", "loss"} <= set(names)
    assert names["blocks.attn"] == (TINY.num_layers,) and names["head"] == ()
    loss = _functional(model)
    grad_jaxpr = jax.make_jaxpr(jax.grad(lambda p, r, b: loss(p, r, b)[0]))(*_split(model), batch)
    eqns = _walk(grad_jaxpr.jaxpr, [])
    stacks = [s for _, s in eqns]
    for name in names:
        assert any(f"nan2safe[{name}]" in s for s in stacks), name
    # the attention core (inside nnx.scan) and its backward carry the attention site
    attn = [(p, s) for p, s in eqns if site.site_from_name_stack(s) == "blocks.attn"]
    assert any(p == "dot_general" for p, _ in attn) and any(p == "cond" for p, _ in attn)
    backward = [s for s in stacks if "transpose" in s and "nan2safe[" in s]
    assert backward and any(site.site_from_name_stack(s) == "head" for s in backward)
    # the forward of the embedding lookup is attributed to its site, not to a neighbour
    gathers = [s for p, s in eqns if p == "gather"]
    assert any(site.site_from_name_stack(s) == "embed" for s in gathers)


def test_scanned_remat_matches_unscanned():
    """Same weights: a python loop over blocks == nnx.scan over nnx.vmap-built blocks + remat."""
    cfg = TransformerConfig(num_layers=1, d_model=8, num_heads=2, seq_len=4, vocab=8, norm="rms")
    unscanned = Transformer(cfg, rngs=nnx.Rngs(0))
    scanned = Transformer(dataclasses.replace(cfg, scan_layers=True, remat=True), rngs=nnx.Rngs(0))
    blocks_params = nnx.state(unscanned.blocks, nnx.Param)
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *[blocks_params[i] for i in range(1)])
    nnx.update(scanned.blocks, stacked)
    for a in ("embed", "pos", "norm", "head"):
        nnx.update(getattr(scanned, a), nnx.state(getattr(unscanned, a), nnx.Param))
    batch = make_batch(jax.random.key(2), cfg, 2)
    for m in (unscanned, scanned):  # FAST known at trace time: the layers, not the gear paths
        set_fast_only(m)
    la, pa = jax.jit(_functional(unscanned))(*_split(unscanned), batch)
    lb, pb = jax.jit(_functional(scanned))(*_split(scanned), batch)
    np.testing.assert_allclose(la, lb, rtol=1e-5)
    np.testing.assert_allclose(  # the layer's probe, unstacked vs stacked [1, NUM_STATS]
        pa["blocks"][0]["attn"]["probe_logits"][...],
        pb["blocks"]["attn"]["probe_logits"][...][0],
        rtol=1e-5,
    )


class _TwinLinears(nnx.Module):
    """Two bf16 flax Linears of one shape (converted: the same traced branches at two sites)."""

    def __init__(self, rngs):
        self.a = nnx.Linear(8, 8, dtype=jnp.bfloat16, rngs=rngs)
        self.b = nnx.Linear(8, 8, dtype=jnp.bfloat16, rngs=rngs)

    def __call__(self, x):
        h = jnp.tanh(self.a(x))
        return self.b(h)  # _TWIN_B_LINE


def test_an_eager_call_under_remat_compiles_nothing_its_first_call_did_not(count_compiles):
    """newuser52: eagerly, under a fresh ``nnx.remat`` (which traces the gears), every site's
    branches were new ``jit`` and ``cond`` functions at every call, each compiled again: 35-45 s
    per forward of a small converted ViT, 0.05 s for flax's. The second call compiles nothing
    and returns the first's output bit for bit. The two layers trace the same branches but keep
    their own sites: an overflow in the second is located there, not in the first."""
    model = nn.convert(_TwinLinears(nnx.Rngs(0)))
    x = jax.random.normal(jax.random.key(0), (4, 8))
    outs, counts = [], []
    for _ in range(2):  # an evaluation loop: a fresh remat, eagerly, from one line
        with count_compiles() as c:
            outs.append(np.asarray(nnx.remat(lambda m, x: m(x))(model, x), np.float32))
        counts.append(c.count)
    assert counts[0] > 0 and counts[1] == 0, counts
    np.testing.assert_array_equal(outs[0], outs[1])

    model.a.bias[...] = jnp.full((8,), 10.0, jnp.float32)  # tanh(a(x)) ~ 1 everywhere
    model.b.kernel[...] = jnp.full((8, 8), 1e38, jnp.float32)  # b's sums pass bf16's range
    graphdef, state = nnx.split(model)

    def forward(state, x):  # the gears are traced
        return nnx.merge(graphdef, state)(x)

    report = replay.locate(jax.make_jaxpr(forward)(state, x), (state, x))
    assert report is not None and report.site == "b" and report.primitive == "dot_general", report
    line = next(i for i, t in enumerate(open(__file__), 1) if t.rstrip().endswith("_TWIN_B_LINE"))
    assert report.user_source == f"{__file__}:{line}", report.user_source


def test_config_validation(tiny):
    with pytest.raises(ValueError, match="divisible"):
        TransformerConfig(d_model=10, num_heads=3)
    with pytest.raises(ValueError, match="dtype"):
        TransformerConfig(dtype=jnp.int32)
    with pytest.raises(ValueError, match="no Knob"):
        set_knob(tiny[0], "nope", 1.0)


@jax.custom_vjp
def _users_rule(x):
    return x * 2.0


_users_rule.defvjp(lambda x: (x * 2.0, None), lambda _, ct: (ct * 3.0,))


def test_a_run_is_reused_only_where_its_text_is_all_it_computes(monkeypatch):
    """``dispatch._rules``: a user's custom rule (its backward named only, in the jaxpr's text)
    is never reused; a library's (jax.nn.relu's) is, by its source location. The cache keeps
    the most recently used runs (``_RUNS_MAX``)."""
    from nan2safe_jax.ops import dispatch

    x = jnp.ones((3,))
    users = jax.make_jaxpr(lambda x: _users_rule(x) + 1.0)(x)
    assert dispatch._rules(users.jaxpr) is None
    library = jax.make_jaxpr(jax.nn.relu)(x)
    rules = dispatch._rules(library.jaxpr)
    assert rules and any(r.startswith("relu at ") for r in rules), rules
    assert all(r.rsplit(" at ", 1)[-1].startswith(dispatch._LIBRARY_PREFIXES) for r in rules)
    assert dispatch._rules(jax.make_jaxpr(jnp.sin)(x).jaxpr) == ()

    monkeypatch.setattr(dispatch, "_RUNS", dispatch.collections.OrderedDict())
    monkeypatch.setattr(dispatch, "_RUNS_MAX", 2)
    made = []

    def make(tag):
        return lambda: made.append(tag) or tag

    assert [dispatch._reused_run(k, make(k)) for k in ("a", "b", "a", "c", "b")] == list("abacb")
    assert made == ["a", "b", "c", "b"]  # "b", least recently used, left for "c"
    assert dispatch._reused_run(None, make("z")) == "z" and list(dispatch._RUNS) == ["c", "b"]
