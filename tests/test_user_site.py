"""nan2safe.nn.Site: a user function as a site; tier 2 on code inside one and outside every one.

One tiny model (a Linear, then a hand-written masked softmax attention pooling, then a mean),
built twice: with the softmax wrapped in ``nn.Site`` and with it inline in the module's own
``__call__``. A batch with a fully masked row makes the FAST softmax 0/0 (the ``-inf`` fill
written in the model's own code).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import nan2safe_jax as nan2safe
from nan2safe_jax import incidents, nn, replay
from nan2safe_jax.gear import Gear
from nan2safe_jax.replay.nearest import nearest_site_in_jaxpr
from nan2safe_jax.site import site_from_name_stack

D, T = 4, 3


def pool(h, mask):
    """The model's own masked softmax pooling: ``-inf`` fill, so a fully masked row is 0/0."""
    logits = jnp.where(mask, h.sum(-1), -jnp.inf)
    return jnp.sum(jax.nn.softmax(logits, axis=-1)[..., None] * h, axis=-2)


def pool_safe(h, mask):
    """SAFE: ``nan2safe.ops.softmax`` in SAFE gives zeros on a fully masked row."""
    p = nan2safe.ops.softmax(h.sum(-1), where=mask, gear=Gear.SAFE)
    return jnp.sum(p[..., None] * h, axis=-2)


class Net(nnx.Module):
    def __init__(self, wrapped: bool, *, rngs: nnx.Rngs):
        self.lin = nn.Linear(D, D, rngs=rngs)
        self.pool = nn.Site(pool, safe=pool_safe) if wrapped else None

    def __call__(self, x, mask):
        h = self.lin(x)
        return self.pool(h, mask) if self.pool is not None else pool(h, mask)


def loss_fn(model, batch):
    return jnp.mean(model(batch["x"], batch["mask"]) ** 2)


def _batch(masked_row: bool):
    x = jnp.asarray(np.random.default_rng(0).normal(size=(2, T, D)), jnp.float32)
    mask = jnp.ones((2, T), bool)
    if masked_row:
        mask = mask.at[1].set(False)
    return {"x": x, "mask": mask}


@pytest.fixture(scope="module")
def runs():
    """For both builds: tier 2 on the failing loss-and-gradient program (the train step's core;
    the full step is exercised by the slow examples test): report, nearest site, decision."""
    out = {}
    cfg = nan2safe.Config()
    bad = _batch(True)
    for wrapped in (True, False):
        model = Net(wrapped, rngs=nnx.Rngs(0))
        sites = nan2safe.site.name_sites(model)
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)

        def f(params, rest, batch, graphdef=graphdef):
            return loss_fn(nnx.merge(graphdef, params, rest), batch)

        args = (params, rest, bad)  # the gears are in ``rest``: traced, so lax.switch
        jaxpr = jax.make_jaxpr(jax.value_and_grad(f))(*args)
        report = replay.locate(jaxpr, args)
        nearest = nearest_site_in_jaxpr(jaxpr, report.eqn_path, sites)
        gs = nan2safe.GearState.create(sites)
        out[wrapped] = (model, report, nearest, incidents._downshift(report, gs, gs, cfg, nearest))
    return out


def test_site_is_the_plain_function_at_fast_and_named_by_path():
    model = Net(True, rngs=nnx.Rngs(0))
    sites = nan2safe.site.name_sites(model)
    assert sites == {"lin": (), "pool": ()}
    b = _batch(False)
    h = model.lin(b["x"])
    np.testing.assert_array_equal(model.pool(h, b["mask"]), pool(h, b["mask"]))
    model.pool.gear[...] = jnp.asarray(Gear.SAFE, jnp.int32)
    np.testing.assert_allclose(model.pool(h, b["mask"]), pool(h, b["mask"]), rtol=1e-6)
    bad = _batch(True)
    assert not np.isfinite(np.asarray(pool(h, bad["mask"]))).all()
    assert np.isfinite(np.asarray(model.pool(h, bad["mask"]))).all()  # SAFE path


def test_every_equation_of_every_path_names_the_site():
    model = Net(True, rngs=nnx.Rngs(0))
    nan2safe.site.name_sites(model)
    b = _batch(False)

    graphdef, st = nnx.split(model)

    def f(st, x):
        return jnp.sum(nnx.merge(graphdef, st)(x, b["mask"]))

    jaxpr = jax.make_jaxpr(jax.grad(f, argnums=1))(st, b["x"])  # traced gear: lax.switch
    named = set()

    def walk(j):
        for eqn in j.eqns:
            if eqn.primitive.name in ("exp", "reduce_max", "div"):
                named.add(site_from_name_stack(str(eqn.source_info.name_stack)))
            for p in eqn.params.values():
                for sub in p if isinstance(p, (tuple, list)) else (p,):
                    if hasattr(sub, "eqns") or hasattr(sub, "jaxpr"):
                        walk(getattr(sub, "jaxpr", sub))

    walk(jaxpr.jaxpr)
    assert "pool" in named


def test_tier2_blames_the_user_site_and_safe_fixes_it(runs):
    model, report, _, dec = runs[True]
    assert report.site == "pool" and report.primitive is not None
    assert dec.kind == "located" and dec.hint is None
    assert int(dec.gear.sites["pool"]) == Gear.SAFE and int(dec.gear.sites["lin"]) < Gear.SAFE
    model.pool.gear[...] = jnp.asarray(dec.gear.sites["pool"])
    loss, grads = nnx.value_and_grad(loss_fn)(model, _batch(True))
    assert np.isfinite(float(loss))
    assert all(np.isfinite(np.asarray(g)).all() for g in jax.tree.leaves(grads))


def test_tier2_outside_every_site_says_so_and_does_not_pretend(runs):
    _, report, nearest, dec = runs[False]
    assert report.site is None and nearest == "lin"
    assert "outside every site" in dec.hint and "nan2safe.nn.Site" in dec.hint
    assert "nearest site is 'lin'" in dec.hint
    assert "fallback" in dec.action.lower() and dec.enter["fallback"]
    assert int(dec.gear.level) == Gear.SAFE  # a fallback: it lowers the learning rate
    # the same fault again with the whole model in SAFE: said to be beyond the gears; one
    # rollback only rules out a damaged state
    again = incidents._downshift(report, dec.gear, dec.gear, nan2safe.Config(), nearest=nearest)
    assert again.kind == "repeat" and again.restore and again.hint == dec.hint
    assert "the gears cannot fix it" in again.action


class _MoE(nnx.Module):
    """A user's block end: the router is a site, the expert math after it is the user's own."""

    def __init__(self, rngs):
        self.router = nn.Linear(D, D, rngs=rngs)

    def __call__(self, x):
        h = self.router(x)
        for _ in range(12):  # the experts, far from the router in program order
            h = jnp.tanh(h) * 1.5 + 0.1
        return jnp.log(h - 2.0)  # the culprit: NaN where h < 2


class _Blocks(nnx.Module):
    def __init__(self, rngs):
        self.moe = nnx.List([_MoE(rngs), _MoE(rngs)])
        self.ln = nnx.List([nn.LayerNorm(D, rngs=rngs), nn.LayerNorm(D, rngs=rngs)])

    def __call__(self, x):
        for ln, moe in zip(self.ln, self.moe, strict=True):
            x = moe(ln(x))
        return x


def test_the_nearest_site_is_one_called_from_the_culprits_own_code():
    """The culprit ends block 0's MoE; block 1's norm is the closest site in program order, but
    the router, called from the culprit's own function, is the one named (newuser46 and
    newuser48 were pointed at the next block's norm)."""
    model = _Blocks(nnx.Rngs(0))
    sites = nan2safe.site.name_sites(model)
    graphdef, st = nnx.split(model)
    x = jnp.ones((2, D))

    def f(st, x):
        return jnp.sum(nnx.merge(graphdef, st)(x))

    jaxpr = jax.make_jaxpr(f)(st, x)
    report = replay.locate(jaxpr, (st, x))
    assert report.primitive == "log" and report.site is None, report
    assert nearest_site_in_jaxpr(jaxpr, report.eqn_path, sites) == "moe.0.router"


def _two_outputs(x, k):
    return x * k, x + k


def _normalised(x, *, axis, scale):
    return scale * x / jnp.sum(x, axis=axis, keepdims=True)


@pytest.mark.parametrize("gear", [0, 1, 2])
@pytest.mark.parametrize("probe", [False, True])
def test_a_probed_site_with_static_arguments_has_the_plain_gradient_at_every_gear(probe, gear):
    """A traced gear recomputes the path in the backward with the call's own static arguments
    (a float, a keyword ``axis``): the probe's reading of the output does not leak into them.
    Reference: the plain functions' gradients."""

    class M(nnx.Module):
        def __init__(self):
            self.a = nn.Site(_two_outputs, safe=_two_outputs, probe=probe)
            self.b = nn.Site(_normalised, safe=_normalised, probe=probe)

        def __call__(self, x):
            u, v = self.a(x, 3.0)
            w = self.b(x + 1.0, axis=-1, scale=jnp.float32(2.0))
            return jnp.sum(u) + jnp.sum(v) + jnp.sum(w**2)

    def plain(x):
        u, v = _two_outputs(x, 3.0)
        return jnp.sum(u) + jnp.sum(v) + jnp.sum(_normalised(x + 1.0, axis=-1, scale=2.0) ** 2)

    m, x = M(), jnp.arange(4.0)
    for s in (m.a, m.b):
        s.gear[...] = jnp.asarray(gear, s.gear[...].dtype)
    got = nnx.jit(nnx.grad(lambda m, x: m(x), argnums=1))(m, x)  # jit: the gear is traced
    np.testing.assert_allclose(got, jax.grad(plain)(x), rtol=1e-6)


def test_site_validates_its_paths():
    with pytest.raises(ValueError, match="safe must be callable"):
        nn.Site(pool, safe=3)

    class M(nnx.Module):
        def f(self, x):
            return x

    with pytest.raises(ValueError, match="bound to a module"):
        nn.Site(M().f, safe=pool_safe)


def _square(x):
    return x * x


def _square_sum(x):  # wrong: drops the last axis
    return jnp.sum(jnp.square(x.astype(jnp.float32)), -1).astype(x.dtype)


def _square_f32(x):  # wrong: another dtype
    return jnp.square(x.astype(jnp.float32))


@pytest.mark.parametrize(
    "wrong, said",
    [(_square_sum, r"float16\[2\]"), (_square_f32, r"float32\[2, 3\]")],
    ids=["shape", "dtype"],
)
@pytest.mark.parametrize("traced", [False, True], ids=["eager", "jit"])
def test_paths_that_disagree_are_named_at_the_first_call(wrong, said, traced):
    """``lax.switch`` would raise a TypeError about its own branches, at the first traced
    call only; the site names itself and the path, eagerly too."""
    site = nn.Site(_square, safe=wrong, name="sq")
    x = jnp.ones((2, 3), jnp.float16)
    call = nnx.jit(lambda s, x: s(x)) if traced else (lambda s, x: s(x))
    pattern = (
        rf"Site 'sq': the safe path \(_square_\w+\) returns {said}, "
        r"the fast path returns float16\[2, 3\]"
    )
    with pytest.raises(ValueError, match=pattern):
        call(site, x)
    ok = nn.Site(_square, safe=lambda x: _square_f32(x).astype(x.dtype), name="ok")
    assert call(ok, x).shape == (2, 3)


def test_paths_that_disagree_only_for_a_static_argument_are_named_for_it():
    def fast(x, upcast):
        return x * x

    def safe(x, upcast):
        y = jnp.square(x.astype(jnp.float32))
        return y if upcast else y.astype(x.dtype)

    site = nn.Site(fast, safe=safe, name="sq")
    x = jnp.ones((2, 3), jnp.float16)
    assert site(x, upcast=False).shape == (2, 3)
    with pytest.raises(ValueError, match="Site 'sq': the safe path"):
        site(x, upcast=True)


def test_site_in_a_vmapped_stack_has_a_layer_gear_and_static_kwargs():
    @nnx.vmap(in_axes=None, out_axes=0, axis_size=3)
    def make():
        return nn.Site(lambda x, *, power: x**power, safe=lambda x, *, power: x**power, probe=True)

    stack = make()
    assert stack.gear.get_value().shape == (3,)
    assert stack.probe_output.get_value().shape[0] == 3

    @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
    def run(site, x):
        return site(x, power=2)  # power stays a Python int: static in every path

    y = run(stack, jnp.full((2,), 1.5))
    np.testing.assert_allclose(y, 1.5**8)


@pytest.mark.parametrize("transform", ["jit", "grad", "vmap"])
def test_a_probed_site_closed_over_by_a_plain_transform_runs_and_keeps_its_probe(transform):
    """A plain JAX transform that closes over a site cannot mutate it: the probe is left as it
    was (flax's layers and ``nn``'s sites do so), where writing it raised
    ``TraceContextError``."""
    site = nn.Site(lambda x: x * 2, safe=lambda x: x * 2, probe=True)
    x = jnp.arange(8, dtype=jnp.float32).reshape(2, 4)
    site(x)  # eager: writes the probe
    before = np.asarray(site.probe_output[...])
    if transform == "jit":
        out = jax.jit(lambda x: site(x))(x)
        np.testing.assert_array_equal(out, 2 * x)
    elif transform == "grad":
        g = jax.grad(lambda x: site(x).sum())(x)
        np.testing.assert_array_equal(g, jnp.full_like(x, 2.0))
    else:
        np.testing.assert_array_equal(jax.vmap(site)(x), 2 * x)
    np.testing.assert_array_equal(np.asarray(site.probe_output[...]), before)


@pytest.mark.parametrize("scoped", [True, False])
def test_a_module_of_your_own_with_a_site_gear_is_named_inside_site_scope(scoped):
    """A module holding a ``SiteGear`` whose scores overflow before its ``ops.softmax``:
    inside ``nan2safe.site.scope(self)`` tier 2 names it by its path; without it the fault is
    outside every site, which the README did not say."""
    import optax

    from nan2safe_jax import TrainState, ops
    from nan2safe_jax import site as site_lib

    class Scores(nnx.Module):
        def __init__(self):
            self.gear = nan2safe.SiteGear(jnp.zeros((), jnp.int32))
            self.w = nnx.Param(jnp.full((4, 4), 1e30))

        def __call__(self, x):
            if not scoped:
                return ops.softmax(x @ self.w[...], gear=self.gear[...])
            with site_lib.scope(self):
                return ops.softmax(x @ self.w[...], gear=self.gear[...])

    class Model(nnx.Module):
        def __init__(self):
            self.attn = Scores()

        def __call__(self, x):
            return self.attn(x)

    model = Model()
    TrainState.create(model, optax.sgd(0.1))  # names the site by its path
    graphdef, state = nnx.split(model)
    x = jnp.full((2, 4), 1e10)
    f = lambda state, x: nnx.merge(graphdef, state)(x)  # noqa: E731
    r = replay.locate(jax.make_jaxpr(f)(state, x), (state, x))
    assert r is not None and r.primitive == "dot_general" and r.kind == "inf"
    assert r.site == ("attn" if scoped else None), r


def _attend(q, k, v, mask):
    """The Gemma example's core: a finite fill that is ``-inf`` in fp16, then softmax."""
    logits = jnp.einsum("BTH,BSH->BTS", q, k)
    probs = jax.nn.softmax(jnp.where(mask[:, None, :], logits, -2.3819763e38), axis=-1)
    return jnp.einsum("BTS,BSH->BTH", probs.astype(k.dtype), v)


def _attend_safe(q, k, v, mask):
    f32 = jnp.float32
    logits = jnp.einsum("BTH,BSH->BTS", q.astype(f32), k.astype(f32))
    where = jnp.broadcast_to(mask[:, None, :], logits.shape)
    probs = nan2safe.ops.softmax(logits, where=where, gear=Gear.SAFE)
    return jnp.einsum("BTS,BSH->BTH", probs, v.astype(f32)).astype(v.dtype)


class _Layer(nnx.Module):
    def __init__(self, rngs):
        self.w = nnx.Linear(D, D, rngs=rngs, dtype=jnp.float16)
        self.core = nn.Site(_attend, safe=_attend_safe)

    def __call__(self, x, mask):
        h = self.w(x)
        return x + self.core(h, h, h, mask)


class _TwoLayers(nnx.Module):
    def __init__(self, rngs):
        self.layers = nnx.List([_Layer(rngs), _Layer(rngs)])

    def __call__(self, x, mask):
        for layer in self.layers:
            x = layer(x, mask)
        return x


@pytest.mark.parametrize("safe", [0, 1])
def test_the_layer_whose_fast_core_fails_is_named_not_the_one_already_in_safe(safe):
    """Two layers of one core, a fully masked row: with one core in SAFE, the other's FAST core
    makes the NaN and is named. The SAFE core's FAST values are computed and dropped by its gear
    switch, but the JVP of its softmax's ``reduce_max`` also compares them (``eq(x, max)``) for
    a tangent nothing uses: dead code, which made the dropped ``-inf`` a root, so tier 2 named
    the site already in SAFE again and again (newuser29, the Gemma example)."""
    model = _TwoLayers(nnx.Rngs(0))
    state = nan2safe.TrainState.create(model, optax.adam(1e-3), nan2safe.Config())
    g = nan2safe.gear.set_level(state.gear, Gear.STABLE)
    state = state.replace(gear=nan2safe.gear.set_site(g, f"layers.{safe}.core", Gear.SAFE))
    x = np.random.default_rng(0).normal(size=(2, T, D)).astype(np.float16)
    mask = np.ones((2, T), bool)
    mask[0] = False

    def loss_fn(m, batch):
        return jnp.mean(m(*batch).astype(jnp.float32) ** 2)

    step = nan2safe.make_train_step(loss_fn)
    _, metrics = step(state, (x, mask))
    assert not np.isfinite(float(metrics["loss"]))
    report = replay.locate_step(step, state, (x, mask))
    assert report.site == f"layers.{1 - safe}.core" and report.direction == "forward"
    assert report.primitive == "convert_element_type" and report.reproducible


def _naive_softmax(x):
    e = jnp.exp(x)
    return e / jnp.sum(e, axis=-1, keepdims=True)


def _softmax_f32(x):
    return jax.nn.softmax(x.astype(jnp.float32), axis=-1).astype(x.dtype)


class _SoftmaxThenSquare(nnx.Module):
    def __init__(self):
        self.sm = nn.Site(_naive_softmax, safe=_softmax_f32)
        self.w0 = nnx.Param(jnp.ones((8,), jnp.float32))
        self.w = nnx.Param(jnp.ones((8,), jnp.float32))

    def __call__(self, x):
        x = x * self.w0.astype(jnp.float16)  # the site's input depends on a parameter
        h = self.sm(x) + x
        return h * h * self.w.astype(jnp.float16)  # the model's own op, outside every site


@pytest.mark.parametrize("big", [12.0, 1000.0], ids=["clean", "fault_after_the_site"])
def test_a_site_in_safe_is_not_blamed_for_a_fault_after_it(big):
    """The site is in SAFE, and its FAST ``exp`` overflows (the reason it is there). With 1000
    in the batch, ``h * h`` overflows too, outside every site: tier 2 named the site's dropped
    ``exp`` (newuser36); with 12 the step is finite and there is nothing to name (the loss is
    scaled down so that the fp16 loss scale does not overflow the backward)."""
    cfg = nan2safe.Config()
    state = nan2safe.TrainState.create(_SoftmaxThenSquare(), optax.sgd(1e-3), cfg)
    state = state.replace(gear=nan2safe.gear.set_site(state.gear, "sm", Gear.SAFE, cfg=cfg))
    x = jnp.ones((2, 8), jnp.float16).at[0, 0].set(big)

    def loss_fn(m, batch):
        return jnp.mean(m(batch).astype(jnp.float32)) * 1e-3

    step = nan2safe.make_train_step(loss_fn)
    _, metrics = step(state, x)
    report = replay.locate_step(step, state, x)
    if big == 12.0:
        assert np.isfinite(float(metrics["loss"]))
        assert report.primitive is None and report.site is None, report  # "only finite values"
    else:
        assert not np.isfinite(float(metrics["loss"]))
        assert (report.primitive, report.site, report.direction) == ("mul", None, "forward")
        assert report.source.endswith(f"test_user_site.py:{_line_of('h * h * self.w')}")


def _line_of(text: str) -> int:
    with open(__file__) as f:
        hits = [i + 1 for i, line in enumerate(f) if text in line and "_line_of" not in line]
    assert len(hits) == 1, hits
    return hits[0]
