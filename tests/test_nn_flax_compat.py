"""nan2safe_jax.nn against the real flax.nnx classes: FAST is Flax.

Each test builds the flax.nnx module and ours from the same ``Rngs`` (same parameters, since
the initialisation order is flax's), runs both on the same inputs and compares. In f32 the
outputs are bit-for-bit in every dtype (the same ops), and so are the gradients with a gear
known at trace time (direct dispatch, plain autodiff): jitted, as the train step's FAST-only
program runs a site; eagerly with a concrete gear where flax itself cannot be jitted. With a
*traced* gear (what the general program does) FAST's forward and backward are still plain code
and JAX's autodiff of the same formula, but each op's value and cotangent pass one gear
``cond``, which XLA does not fuse across, so gradients may differ in the last bits (seen: a few
ulps in f32 on reduced bias gradients): GRAD_TOL below, relative to the gradient's max.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from tiny_models import jit_bits, set_fast_only

from nan2safe_jax import nn

F32, BF16, F16 = jnp.float32, jnp.bfloat16, jnp.float16
DTYPES = [F32, F16, BF16]
# gradient tolerance through a traced gear, relative to the gradient's max (a few ulps: fp16
# normalize_qk reduces its q/k LayerNorm gradients in another order, ~3 fp16 ulps)
GRAD_TOL = {F32: 1e-6, F16: 4e-3, BF16: 2e-2}


def _x(shape, dt, seed=0, scale=1.0):
    return jnp.asarray(np.random.default_rng(seed).normal(size=shape) * scale, dt)


def _same(a, b):
    a, b = jnp.asarray(a), jnp.asarray(b)
    assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, b.dtype, a.shape, b.shape)
    np.testing.assert_array_equal(np.asarray(a.astype(F32)), np.asarray(b.astype(F32)))


def _grad_close(a, b, dt, floor=0.0):
    """``a`` within ``GRAD_TOL[dt]`` of ``b``'s largest value, or within ``floor``.

    ``floor`` (``_noise_floor``): a gradient that is rounding noise, such as attention's key
    bias gradient (exactly 0 in exact arithmetic: the softmax ignores a constant added to a
    row's logits; ~1e-3 of noise in fp16), differs between two summation orders by as much as
    it is large, so it is compared at the dtype's epsilon times the largest gradient instead.
    """
    a, b = np.asarray(jnp.asarray(a, F32)), np.asarray(jnp.asarray(b, F32))
    atol = max(GRAD_TOL[dt] * np.abs(b).max(), floor, 1e-30)
    np.testing.assert_allclose(a, b, rtol=0, atol=atol)


def _noise_floor(leaves, dt) -> float:
    """The dtype's epsilon times the largest gradient among ``leaves``: the rounding noise of a
    gradient summed from terms that large (see ``_grad_close``)."""
    big = max(float(np.abs(np.asarray(jnp.asarray(x, F32))).max()) for x in leaves)
    return float(jnp.finfo(dt).eps) * big


def _params_equal(ours, theirs):
    po = nnx.state(ours, nnx.Param).flat_state()
    pt = nnx.state(theirs, nnx.Param).flat_state()
    assert dict(jax.tree.map(jnp.shape, dict(po))) == dict(jax.tree.map(jnp.shape, dict(pt)))
    for (_p, a), (_q, b) in zip(
        sorted(po, key=lambda t: t[0]), sorted(pt, key=lambda t: t[0]), strict=True
    ):
        _same(a.get_value(), b.get_value())


def _compare(ours, theirs, args, dt, call=lambda m, *a: m(*a), flax_jit=True):
    """Forward under jit bit-for-bit; gradients w.r.t. params and the first input. Returns our
    jitted forward's output.

    ``flax_jit=False`` runs flax eagerly: JAX 0.10's ``jax.nn.dot_product_attention`` asks for
    the ``F16_F16_F32`` dot algorithm, which CPU rejects at compile time, so flax's fp16
    attention does not compile under ``jit`` on CPU (eagerly JAX falls back to the default).
    """
    _params_equal(ours, theirs)
    tjit = jit_bits if flax_jit else (lambda f: f)
    fo = jit_bits(call)(ours, *args)
    ft = tjit(call)(theirs, *args)
    _same(fo, ft)

    def loss(m, x, *rest):
        y = call(m, x, *rest).astype(F32)
        return jnp.sum(y * jnp.cos(jnp.arange(y.size, dtype=F32)).reshape(y.shape))

    argnums = nnx.DiffState(0, nnx.Param)
    floats = jnp.issubdtype(args[0].dtype, jnp.floating)
    gfun = nnx.grad(loss, argnums=(argnums, 1) if floats else argnums)
    go, gt = jit_bits(gfun)(ours, *args), tjit(gfun)(theirs, *args)
    lo, lt = jax.tree.leaves(go), jax.tree.leaves(gt)
    assert len(lo) == len(lt)
    floor = _noise_floor(lt, dt)
    for a, b in zip(lo, lt, strict=True):
        _grad_close(a, b, dt, floor)  # traced gear: the last bits may differ (module docstring)
    # A gear known at trace time dispatches directly: plain autodiff, bit-for-bit in every
    # dtype. Jitted, that is the FAST-only program's site (every gear ``fast_only_gear``); where
    # flax runs eagerly, a concrete gear eagerly.
    fast = _fast_only(ours) if flax_jit else ours
    for a, b in zip(jax.tree.leaves(tjit(gfun)(fast, *args)), lt, strict=True):
        _same(a, b)
    return fo


def _fast_only(module):
    """A copy of ``module`` whose every site gear is FAST known at trace time (what the train
    step's FAST-only program traces: no gear switch)."""
    return set_fast_only(nnx.clone(module))


@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("pet", [None, F32])
def test_linear(dt, pet):
    kw = dict(dtype=dt, preferred_element_type=pet)
    ours, theirs = nn.Linear(8, 5, rngs=nnx.Rngs(0), **kw), nnx.Linear(8, 5, rngs=nnx.Rngs(0), **kw)
    y = _compare(ours, theirs, (_x((2, 3, 8), dt),), dt)
    assert y.dtype == (pet or dt)


@pytest.mark.parametrize("dt", DTYPES)
def test_embed(dt):
    ours, theirs = (
        nn.Embed(7, 4, dtype=dt, rngs=nnx.Rngs(0)),
        nnx.Embed(7, 4, dtype=dt, rngs=nnx.Rngs(0)),
    )
    ids = jnp.asarray([[0, 3, 6], [-1, 2, 9]])  # 9 is past the table: NaN, as in flax
    _same(ours(ids), theirs(ids))
    q = _x((2, 4), dt)
    _same(nnx.jit(lambda m, q: m.attend(q))(ours, q), nnx.jit(lambda m, q: m.attend(q))(theirs, q))
    one_o, one_t = nn.Embed(1, 4, rngs=nnx.Rngs(0)), nnx.Embed(1, 4, rngs=nnx.Rngs(0))
    _same(one_o(ids), one_t(ids))  # one embedding: broadcast whatever the index
    assert bool(jnp.all(jnp.isfinite(one_o(ids))))


def _norm_cases():
    """Both kinds, both variants, every dtype; ``make test`` keeps each kind's variants in
    alternating dtypes (every dtype and every variant once per kind), the rest is ``slow``."""
    variants = [(True, False), (False, True)]  # (use_fast_variance, masked)
    out = []
    for k, kind in enumerate(["LayerNorm", "RMSNorm"]):
        for d, dt in enumerate(DTYPES):
            for v, (fast_var, masked) in enumerate(variants):
                marks = [] if (k + d + v) % 2 == 0 else [pytest.mark.slow]
                name = f"{kind}-{fast_var}-{masked}-{jnp.dtype(dt).name}"
                out.append(pytest.param(kind, dt, fast_var, masked, marks=marks, id=name))
    return out


@pytest.mark.parametrize("kind, dt, fast_var, masked", _norm_cases())
def test_norms(kind, dt, fast_var, masked):
    kw = dict(dtype=dt, use_fast_variance=fast_var)
    ours = getattr(nn, kind)(16, rngs=nnx.Rngs(0), **kw)
    theirs = getattr(nnx, kind)(16, rngs=nnx.Rngs(0), **kw)
    for m in (ours, theirs):
        m.scale[...] = jnp.linspace(0.5, 1.5, 16)
        if kind == "LayerNorm":
            m.bias[...] = jnp.linspace(-1, 1, 16)
    x = _x((3, 4, 16), dt, scale=3.0) + 1
    mask = jnp.asarray(np.random.default_rng(1).random((3, 4, 16)) > 0.3) if masked else None
    _compare(ours, theirs, (x,), dt, call=lambda m, x: m(x, mask=mask))


def _mha_pair(**kw):
    kw = dict(kw)
    args = (kw.pop("num_heads", 4), kw.pop("in_features", 8))
    return (
        nn.MultiHeadAttention(*args, rngs=nnx.Rngs(0), **kw),
        nnx.MultiHeadAttention(*args, rngs=nnx.Rngs(0), **kw),
    )


def _mha_cases():
    """Every feature alone in every dtype (``slow``), and in ``make test`` every feature and
    every dtype in three combined cases.

    Each case compiles flax's and our attention forward and backward (about 10 s on a loaded
    core); a combined case checks its features together for the price of one.
    """
    cases = ["plain", "causal-mask", "gqa", "normalize_qk", "sow", "unbatched"]
    out = [
        pytest.param(dt, case, marks=pytest.mark.slow, id=f"{case}-{jnp.dtype(dt).name}")
        for case in cases
        for dt in DTYPES
    ]
    fast = [
        ("causal-mask+gqa+sow", F16),
        ("normalize_qk+unbatched", F32),
        ("causal-mask+unbatched", BF16),
    ]
    out += [pytest.param(dt, case, id=f"{case}-{jnp.dtype(dt).name}") for case, dt in fast]
    return out


@pytest.mark.parametrize("dt, case", _mha_cases())
def test_mha(dt, case):
    features = set(case.split("+"))
    kw = dict(dtype=dt, decode=False)
    if "gqa" in features:
        kw["num_kv_heads"] = 2
    width = 8
    if "normalize_qk" in features:
        # head_dim 8, not 2: flax's jitted program lets XLA rewrite a head_dim-2 projection as a
        # multiply + reduce fused into the q/k LayerNorm's reductions (another summation order);
        # our projection's value passes a gear cond first. From head_dim 8 up the two agree.
        kw["normalize_qk"] = True
        width = 32
    ours, theirs = _mha_pair(in_features=width, **kw)
    x = _x((2, 5, width), dt)
    mask = None
    causal = "causal-mask" in features
    if causal:
        mask = jnp.ones((2, 1, 5, 5), bool).at[:, :, 1, :].set(False)  # a fully-masked row
    if "unbatched" in features:
        x = x[0]
        mask = None if mask is None else mask[0]
    sow = "sow" in features

    def call(m, x):
        return m(x, mask=mask, is_causal=causal, sow_weights=sow)

    on_cpu = jax.default_backend() == "cpu"
    y = _compare(ours, theirs, (x,), dt, call=call, flax_jit=not (on_cpu and dt == F16 and not sow))
    assert bool(jnp.all(jnp.isfinite(y.astype(F32))))  # the fully-masked row is finite (flax)
    if sow:  # the first weights sown: those of the jitted forward
        wo = nnx.pop(ours, nnx.Intermediate)["attention_weights"]
        wt = nnx.pop(theirs, nnx.Intermediate)["attention_weights"]
        _same(wo.get_value()[0], wt.get_value()[0])


@pytest.mark.parametrize("broadcast", [True, False])
def test_mha_dropout(broadcast):
    kw = dict(dropout_rate=0.5, broadcast_dropout=broadcast, decode=False)
    ours, theirs = _mha_pair(**kw)
    assert isinstance(ours.rngs, nnx.RngStream)
    x = _x((2, 5, 8), F32)
    _same(ours(x, deterministic=False), theirs(x, deterministic=False))  # same key, same drop
    _same(ours(x, deterministic=True), theirs(x, deterministic=True))
    ours2, theirs2 = _mha_pair(keep_rngs=False, **kw)
    assert ours2.rngs is None
    _same(
        ours2(x, deterministic=False, rngs=nnx.Rngs(dropout=3)),
        theirs2(x, deterministic=False, rngs=nnx.Rngs(dropout=3)),
    )


@pytest.mark.parametrize("num_kv_heads", [4, 2])
def test_mha_decode(num_kv_heads):
    ours, theirs = _mha_pair(num_kv_heads=num_kv_heads, decode=True)
    x = _x((2, 6, 8), F32)
    for m in (ours, theirs):
        m.init_cache(x.shape)
    step = nnx.jit(lambda m, t: m(t))
    for i in range(3):
        _same(step(ours, x[:, i : i + 1]), step(theirs, x[:, i : i + 1]))
    _same(ours.cached_key.get_value(), theirs.cached_key.get_value())
    assert int(ours.cache_index.get_value()) == 3


def test_param_tree_loads_both_ways():
    ours, theirs = _mha_pair(num_kv_heads=2, normalize_qk=True, decode=False)
    shapes = jax.tree.map(jnp.shape, nnx.state(ours, nnx.Param))
    assert shapes == jax.tree.map(jnp.shape, nnx.state(theirs, nnx.Param))
    assert ours.query.kernel.shape == (8, 4, 2) and ours.key.bias.shape == (2, 2)
    assert ours.out.kernel.shape == (4, 2, 8)
    x = _x((2, 5, 8), F32)
    other = nnx.MultiHeadAttention(4, 8, num_kv_heads=2, normalize_qk=True, rngs=nnx.Rngs(7))
    nnx.update(ours, nnx.state(other, nnx.Param))  # flax -> ours
    _same(ours(x, decode=False), other(x, decode=False))
    nnx.update(theirs, nnx.state(ours, nnx.Param))  # ours -> flax
    _same(theirs(x, decode=False), ours(x, decode=False))


def test_metadata_kept():
    m = nn.MultiHeadAttention(
        2,
        4,
        rngs=nnx.Rngs(0),
        kernel_metadata={"tag": (None, "model", None)},
        out_kernel_metadata={"tag": ("model", None, None)},
        query_ln_scale_metadata={"tag": (None,)},
        normalize_qk=True,
    )
    assert m.query.kernel.get_metadata()["tag"] == (None, "model", None)
    assert m.out.kernel.get_metadata()["tag"] == ("model", None, None)
    assert m.query_ln.scale.get_metadata()["tag"] == (None,)


def test_abstract_construction():
    """nnx.eval_shape, then only the Params filled in: the model runs (gears default FAST)."""

    class Block(nnx.Module):
        def __init__(self, rngs):
            self.ln = nn.LayerNorm(8, rngs=rngs)
            self.attn = nn.MultiHeadAttention(2, 8, decode=False, rngs=rngs)

        def __call__(self, x):
            return self.attn(self.ln(x))

    abstract = nnx.eval_shape(lambda: Block(nnx.Rngs(0)))
    concrete = Block(nnx.Rngs(0))
    nnx.update(abstract, nnx.state(concrete, nnx.Param))
    x = _x((2, 3, 8), F32)
    _same(abstract(x), concrete(x))
    assert int(abstract.attn.gear.get_value()) == 0


class _Stack(nnx.Module):
    """Two LayerNorm + attention blocks stacked by ``nnx.vmap``, run by ``nnx.scan``."""

    def __init__(self, rngs):
        @nnx.split_rngs(splits=2)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make(r):
            return nnx.Sequential(
                nn.LayerNorm(8, rngs=r), nn.MultiHeadAttention(2, 8, decode=False, rngs=r)
            )

        self.blocks = make(rngs)

    def __call__(self, x):
        step = lambda b, x: b(x)  # noqa: E731
        return nnx.scan(step, in_axes=(0, nnx.Carry), out_axes=nnx.Carry)(self.blocks, x)


@pytest.mark.parametrize("how", ["nnx.jit", "TrainState"])
def test_an_abstract_stack_given_only_its_params_runs_after_fill_defaults(how):
    """A params-only checkpoint restored the orbax way: ``nnx.eval_shape``, then only the
    Params. Its gears, knobs and probes are abstract, which no ``jit`` or ``nnx.scan`` takes;
    ``TrainState.create`` fills them, and ``nn.fill_defaults`` does for a loop of one's own."""
    import optax

    from nan2safe_jax import TrainState, make_train_step

    concrete = _Stack(nnx.Rngs(0))
    abstract = nnx.eval_shape(lambda: _Stack(nnx.Rngs(0)))
    nnx.update(abstract, nnx.state(concrete, nnx.Param))
    x = _x((2, 3, 8), F32)
    if how == "nnx.jit":
        nn.fill_defaults(abstract)
        assert abstract.blocks.layers[1].gear.get_value().shape == (2,)
        assert float(abstract.blocks.layers[1].qk_scale.get_value()[0]) == 1.0
        run = nnx.jit(lambda m, x: m(x))
        _same(run(abstract, x), run(concrete, x))
    else:
        loss = lambda m, x: jnp.mean(m(x) ** 2)  # noqa: E731
        step = make_train_step(loss)
        _, got = step(TrainState.create(abstract, optax.sgd(0.1)), x)
        _, want = step(TrainState.create(concrete, optax.sgd(0.1)), x)
        assert float(got["loss"]) == float(want["loss"])


def _closed_over_pairs():
    r = lambda: nnx.Rngs(0)  # noqa: E731
    mha = dict(num_heads=2, in_features=8, qkv_features=8, decode=False, rngs=None)
    return {
        "LayerNorm": (lambda: nnx.LayerNorm(8, rngs=r()), lambda: nn.LayerNorm(8, rngs=r())),
        "RMSNorm": (lambda: nnx.RMSNorm(8, rngs=r()), lambda: nn.RMSNorm(8, rngs=r())),
        "MultiHeadAttention": (
            lambda: nnx.MultiHeadAttention(**{**mha, "rngs": r()}),
            lambda: nn.MultiHeadAttention(**{**mha, "rngs": r()}),
        ),
    }


_TRANSFORMS = {
    "jit": lambda f, x: jax.jit(f)(x),
    "grad": lambda f, x: jax.grad(lambda x: f(x).sum())(x),
    "vmap": lambda f, x: jax.vmap(f)(x[:, None])[:, 0],
    "jvp": lambda f, x: jax.jvp(f, (x,), (jnp.ones_like(x),))[1],
    "scan": lambda f, x: jax.lax.scan(lambda c, xi: (c, f(xi[None])[0]), 0, x)[1],
}


@pytest.mark.parametrize("transform", list(_TRANSFORMS))
@pytest.mark.parametrize("kind", list(_closed_over_pairs()))
def test_a_site_closed_over_by_a_plain_jax_transform_runs_as_flax_does(kind, transform):
    """A layer closed over by ``jax.jit`` / ``grad`` / ``vmap`` / ``jvp`` / ``lax.scan`` (not an
    ``nnx`` transform): its probes cannot be written from that trace and are skipped, and the
    result is flax's."""
    make_flax, make_ours = _closed_over_pairs()[kind]
    theirs, ours = make_flax(), make_ours()
    x = _x((4, 3, 8), F32)
    got = _TRANSFORMS[transform](lambda x: ours(x), x)
    want = _TRANSFORMS[transform](lambda x: theirs(x), x)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)
