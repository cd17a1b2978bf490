"""A CNN's layers as sites. ``nn.BatchNorm`` / ``ops.batch_norm``: FAST is
``flax.nnx.BatchNorm`` bit for bit (outputs, running averages, gradients), STABLE and SAFE
against a float64 reference, SAFE's degenerate and out-of-range features. ``nn.Conv`` /
``ops.conv``: FAST is ``flax.nnx.Conv`` bit for bit over its padding modes, strides, dilations,
groups and mask; STABLE and SAFE against a float64 reference. ``convert`` of a CNN, and tier 2
naming a BatchNorm that overflows and an fp16 convolution whose output passes 65504.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from nan2safe_jax import nn, ops, replay
from nan2safe_jax.config import Config
from nan2safe_jax.ops import dispatch
from nan2safe_jax.train import TrainState, make_train_step

F32, BF16, F16 = jnp.float32, jnp.bfloat16, jnp.float16


def _pair(**kw):
    return nnx.BatchNorm(6, rngs=nnx.Rngs(0), **kw), nn.BatchNorm(6, rngs=nnx.Rngs(0), **kw)


def _same(a, b):
    assert a.dtype == b.dtype, (a.dtype, b.dtype)
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


# (input dtype, compute dtype): f32 and fp16 inputs with flax's default, a bf16 layer on f32
_DTYPES = [(F32, None), (F16, None), (F32, BF16)]


@pytest.mark.parametrize(("xdt", "dtype"), _DTYPES)
def test_fast_is_flax_batch_norm_bit_for_bit(xdt, dtype):
    """Outputs and running averages in training and inference, with and without a mask, for
    the feature axis last (NHWC) and second (NCHW), fast and two-pass variance; gradients of
    the input and the affine parameters; a scale and bias left out (NCHW in f32 only)."""
    layouts = ((-1, (4, 5, 6), True), (1, (4, 6, 5), False))
    for axis, shape, fast_var in layouts if (xdt, dtype) == (F32, None) else layouts[:1]:
        flax_bn, site = _pair(axis=axis, dtype=dtype, use_fast_variance=fast_var)
        x = (jax.random.normal(jax.random.key(1), shape) * 3 + 1).astype(xdt)
        mask = jax.random.bernoulli(jax.random.key(2), 0.7, shape)
        for m in (None, mask):
            for running in (False, True):
                _same(flax_bn(x, running, mask=m), site(x, running, mask=m))
                _same(flax_bn.mean[...], site.mean[...])
                _same(flax_bn.var[...], site.var[...])

        def loss(mod, x):
            return jnp.sum(jnp.square(mod(x).astype(F32)) * jnp.arange(x.shape[-1]))

        g_flax, g_site = (nnx.grad(loss, argnums=(0, 1))(m, x) for m in (flax_bn, site))
        _same(g_flax[1], g_site[1])
        for k in ("scale", "bias"):
            _same(g_flax[0][k][...], g_site[0][k][...])
    bare = dict(use_scale=False, use_bias=False, dtype=dtype)
    flax_bn, site = _pair(**bare)
    _same(flax_bn(x.reshape(-1, 6)), site(x.reshape(-1, 6)))


def _to_bf16(args, dtype=None, inexact=True):
    """A custom ``promote_dtype``: every operand to bf16, whatever ``dtype`` says."""
    return tuple(None if a is None else jnp.asarray(a, BF16) for a in args)


def test_a_custom_promote_keeps_the_running_averages_as_stored_in_every_gear():
    """flax updates the running averages from the stored f32 values, not from the promoted
    operands: FAST matches flax's bit for bit, and under a traced gear every gear's running
    averages stay f32 (SAFE returned bf16 ones, and the gear switch did not trace)."""
    kw = dict(promote_dtype=_to_bf16)
    flax_bn, site = _pair(**kw)
    x = jax.random.normal(jax.random.key(5), (8, 6)) * 3 + 1
    for _ in range(2):
        _same(flax_bn(x), site(x))
    _same(flax_bn.mean[...], site.mean[...])
    _same(flax_bn.var[...], site.var[...])
    graphdef, st = nnx.split(site)

    @jax.jit
    def run(st, x, gear):
        m = nnx.merge(graphdef, st, copy=True)
        m.gear[...] = gear
        return m(x), nnx.state(m, nnx.BatchStat)

    var = []
    for g in range(3):
        y, stats = run(st, x, jnp.int32(g))
        assert y.dtype == BF16 and stats["var"][...].dtype == stats["mean"][...].dtype == F32
        var.append(np.asarray(stats["var"][...]))
    np.testing.assert_allclose(var[1], var[0], rtol=1e-3)
    np.testing.assert_allclose(var[2], var[0], rtol=1e-3)


def _reference(x, eps, axes):
    x64 = np.asarray(x.astype(F32), np.float64)
    mean, var = x64.mean(axes), x64.var(axes)
    return (x64 - mean) / np.sqrt(var + eps), mean, var


@pytest.mark.parametrize("xdt", [F32, BF16, F16])
@pytest.mark.parametrize("gear", [0, 1, 2])
def test_every_gear_matches_the_float64_reference(xdt, gear):
    """Training: the output, the running averages ``0.9 * old + 0.1 * batch`` and the
    ``inv_std`` probe (its max is ``1/sqrt(min var + eps)``); inference normalises with the
    running averages."""
    x = (jax.random.normal(jax.random.key(3), (8, 3, 6)) * jnp.arange(1.0, 7.0) + 2).astype(xdt)
    old_mean, old_var = jnp.full((6,), 0.5), jnp.full((6,), 2.0)
    y, (mean, var), st = ops.batch_norm(
        x, None, None, old_mean, old_var, 1e-5, gear, momentum=0.9, return_stats=True
    )
    want, m64, v64 = _reference(x, 1e-5, (0, 1))
    tol = {F32: 1e-5, BF16: 2e-2, F16: 2e-3}[xdt]
    assert y.dtype == xdt
    np.testing.assert_allclose(np.asarray(y, np.float64), want, rtol=tol, atol=tol)
    np.testing.assert_allclose(np.asarray(mean), 0.9 * 0.5 + 0.1 * m64, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(var), 0.9 * 2.0 + 0.1 * v64, rtol=1e-5)
    inv_max = float(st["inv_std"][0])
    np.testing.assert_allclose(inv_max, 1 / np.sqrt(v64.min() + 1e-5), rtol=1e-5)
    y_eval, kept = ops.batch_norm(x, None, None, mean, var, 1e-5, gear, use_running_average=True)
    assert kept[0] is mean and kept[1] is var
    x64 = np.asarray(x.astype(F32), np.float64)
    want = (x64 - np.asarray(mean)) / np.sqrt(np.asarray(var, np.float64) + 1e-5)
    np.testing.assert_allclose(np.asarray(y_eval, np.float64), want, rtol=tol, atol=tol)


def test_safe_keeps_a_degenerate_and_an_out_of_range_feature_finite():
    """A constant feature with ``eps=0`` (``0 * inf``) and one of ~1e30 (its variance passes
    f32): FAST is flax's NaN; SAFE's output and gradient are finite (the constant feature 0,
    the huge one normalised as the f64 reference), its running variance saturated, finite."""
    x = jax.random.normal(jax.random.key(4), (16, 6)).at[:, 0].set(5.0).at[:, 1].mul(1e30)

    def run(gear):
        def f(x):
            y, stats = ops.batch_norm(x, None, None, jnp.zeros(6), jnp.ones(6), 0.0, gear)
            return jnp.sum(y * jnp.arange(6.0)), (y, stats)

        return jax.value_and_grad(f, has_aux=True)(x)

    (_, (y0, _)), _ = run(0)
    assert not np.isfinite(np.asarray(y0[:, :2])).all()
    (_, (y2, (mean, var))), g2 = run(2)
    assert np.isfinite(np.asarray(y2)).all() and np.isfinite(np.asarray(g2)).all()
    assert np.isfinite(np.asarray(var)).all() and float(var[1]) > 1e36
    np.testing.assert_array_equal(np.asarray(y2[:, 0]), 0.0)
    want = _reference(x[:, 1:2], 0.0, (0,))[0][:, 0]
    np.testing.assert_allclose(np.asarray(y2[:, 1], np.float64), want, rtol=1e-5, atol=1e-5)


_CONVS = [
    dict(in_features=3, out_features=8, kernel_size=(3, 3)),
    dict(
        in_features=4,
        out_features=6,
        kernel_size=(3, 3),
        strides=2,
        padding="VALID",
        feature_group_count=2,
    ),
    dict(in_features=3, out_features=5, kernel_size=(3,), padding="CAUSAL", kernel_dilation=2),
    dict(in_features=3, out_features=5, kernel_size=(2, 2), padding="CIRCULAR", use_bias=False),
    dict(
        in_features=3,
        out_features=5,
        kernel_size=(3, 3),
        padding=((1, 0), (2, 1)),
        input_dilation=2,
    ),
    dict(
        in_features=3,
        out_features=5,
        kernel_size=(3, 3),
        padding="REFLECT",
        mask=jnp.ones((3, 3, 3, 5)).at[0].set(0),
    ),
]


def _x64():
    """float64 on, for a reference: ``jax.enable_x64(True)`` (``jax.experimental.enable_x64()``
    before it existed)."""
    on = getattr(jax, "enable_x64", None)
    if on is not None:
        return on(True)
    from jax.experimental import enable_x64

    return enable_x64()


def _conv_input(c, xdt):
    shape = (2, 3) + (6,) * len(c["kernel_size"]) + (c["in_features"],)  # two batch axes
    return jax.random.normal(jax.random.key(1), shape).astype(xdt)


@pytest.mark.parametrize(("xdt", "dtype"), _DTYPES)
def test_fast_is_flax_conv_bit_for_bit(xdt, dtype):
    """Outputs and the gradients of the input and kernel, over padding modes (SAME, VALID,
    explicit, CAUSAL, CIRCULAR, REFLECT), strides, dilations, groups, a mask, no bias, 1-D and
    2-D, two batch axes (every configuration in f32; a plain and a grouped one in the others);
    the site is an ``nnx.Conv``."""
    for c in _CONVS if (xdt, dtype) == (F32, None) else _CONVS[:2]:
        flax_conv = nnx.Conv(**c, dtype=dtype, rngs=nnx.Rngs(0))
        site = nn.Conv(**c, dtype=dtype, rngs=nnx.Rngs(0))
        x = _conv_input(c, xdt)
        _same(flax_conv(x), site(x))

        def loss(m, x):
            return jnp.sum(jnp.square(m(x).astype(F32)))

        g_flax, g_site = (nnx.grad(loss, argnums=(0, 1))(m, x) for m in (flax_conv, site))
        _same(g_flax[1], g_site[1])
        _same(g_flax[0]["kernel"][...], g_site[0]["kernel"][...])
    assert isinstance(site, nnx.Conv)
    with pytest.raises(ValueError, match="conv_general_dilated"):
        nn.Conv(3, 4, (3, 3), conv_general_dilated=lambda *a, **k: None, rngs=nnx.Rngs(0))


@pytest.mark.parametrize("xdt", [F32, BF16, F16])
@pytest.mark.parametrize("gear", [0, 1, 2])
def test_every_conv_gear_matches_the_float64_reference(xdt, gear):
    c = dict(
        in_features=4,
        out_features=6,
        kernel_size=(3, 3),
        padding="VALID",
        strides=2,
        feature_group_count=2,
    )
    x = _conv_input(c, xdt)[0] * 4
    kernel = jax.random.normal(jax.random.key(2), (3, 3, 2, 6))
    bias = jnp.linspace(-1.0, 1.0, 6)
    y = ops.conv(
        x,
        kernel,
        bias,
        gear,
        strides=(2, 2),
        padding="VALID",
        dimension_numbers=("NHWC", "HWIO", "NHWC"),
        feature_group_count=2,
    )
    x64 = np.asarray(x.astype(F32), np.float64)
    k64 = np.asarray(jnp.asarray(kernel, xdt).astype(F32) if gear < 2 else kernel, np.float64)
    with _x64():  # (else JAX computes the reference in f32)
        want = np.asarray(
            jax.lax.conv_general_dilated(
                jnp.asarray(x64),
                jnp.asarray(k64),
                (2, 2),
                "VALID",
                dimension_numbers=("NHWC", "HWIO", "NHWC"),
                feature_group_count=2,
                precision="highest",
            )
        ) + np.asarray(bias, np.float64)
    assert want.dtype == np.float64
    tol = {F32: 1e-5, BF16: 3e-2, F16: 3e-3}[xdt]
    assert y.dtype == xdt
    np.testing.assert_allclose(np.asarray(y, np.float64), want, rtol=tol, atol=tol * 10)


def _convs(jaxpr, in_other: bool = False) -> list[bool]:
    """For each ``conv_general_dilated`` of ``jaxpr`` and the jaxprs inside it: whether it is
    inside a ``cond`` branch other than the first (FAST's, or the pass-through of FAST's value:
    ``ops.dispatch``), i.e. in a STABLE or SAFE path."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "conv_general_dilated":
            found.append(in_other)
        for key, v in eqn.params.items():
            subs = v if isinstance(v, (tuple, list)) else (v,)
            for i, sub in enumerate(subs):
                sub = getattr(sub, "jaxpr", sub)
                if hasattr(sub, "eqns"):
                    other = eqn.primitive.name == "cond" and key == "branches" and i > 0
                    found += _convs(sub, in_other or other)
    return found


_CPU_ONLY = pytest.mark.skipif(
    jax.default_backend() != "cpu", reason="the convolution is hoisted on the CPU only"
)


@_CPU_ONLY
@pytest.mark.parametrize("xdt", [F32, BF16, F16])
@pytest.mark.parametrize("gear", [1, 2])
@pytest.mark.parametrize("switched", [False, True], ids=["general", "switched"])
def test_in_the_train_step_a_conv_out_of_fast_convolves_outside_the_switch(xdt, gear, switched):
    """newuser51: XLA:CPU gives a convolution inside a ``cond`` branch a slow generic loop when
    it is one of autodiff's (the kernel's gradient), and an fp16 CNN ran 7-20x slower at
    STABLE or SAFE than at FAST. Inside ``dispatch.hoisting`` (the train step traces its
    model there) with a gear switched at run time (the general program's, or a partial
    program's ``SWITCHED``), no convolution of the forward+backward is inside a STABLE or SAFE
    branch of a ``cond`` (FAST's own, in a ``SWITCHED`` switch, never runs there); the values
    and gradients are those of the gear's own path (a concrete gear calls it
    directly), to f32 rounding."""
    kw = dict(strides=(2, 2), padding="VALID", dimension_numbers=("NHWC", "HWIO", "NHWC"))
    x = jax.random.normal(jax.random.key(1), (2, 7, 7, 4)).astype(xdt)
    kernel = jax.random.normal(jax.random.key(2), (3, 3, 2, 6)) * 0.3
    bias = jnp.linspace(-1.0, 1.0, 6)

    def grad():  # a new function each time: JAX's trace cache does not key on ``hoisting``
        def loss(x, kernel, g):
            y = ops.conv(x, kernel, bias, g, feature_group_count=2, **kw)
            return jnp.sum(jnp.square(y.astype(F32)))

        return jax.value_and_grad(loss, argnums=(0, 1))

    g = dispatch.switched_gear(gear) if switched else jnp.int32(gear)
    with dispatch.hoisting():
        inside = _convs(jax.make_jaxpr(grad())(x, kernel, g).jaxpr)
        got = jax.jit(grad())(x, kernel, g)
    assert len(inside) >= 3 and not any(inside), inside  # forward, and the two gradients
    want = grad()(x, kernel, gear)
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want), strict=True):
        assert a.dtype == b.dtype
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=2e-5)
    # outside the train step (a user's own jit of a site): the paths stay in the switch
    assert any(_convs(jax.make_jaxpr(grad())(x, kernel, g).jaxpr))


@_CPU_ONLY
def test_the_train_steps_general_program_convolves_outside_the_switch():
    """The train step traces its model inside ``dispatch.hoisting``: its general program (a
    gear switched at run time) holds no convolution in a STABLE or SAFE branch."""
    model = nn.Conv(3, 4, (3, 3), dtype=F16, rngs=nnx.Rngs(0))
    state = TrainState.create(model, optax.sgd(1e-3))
    step = make_train_step(lambda m, x: jnp.mean(m(x).astype(F32) ** 2), jit=False)
    x = jax.random.normal(jax.random.key(0), (2, 6, 6, 3))
    convs = _convs(jax.make_jaxpr(step)(state, x).jaxpr)
    assert len(convs) >= 3 and not any(convs), convs


def test_an_fp16_conv_past_65504_is_located_and_saturates_in_safe():
    """fp16 activations of 300 through a kernel of 10s sum past 65504: FAST is flax's inf;
    tier 2 names the convolution and the site; STABLE and SAFE saturate at 65504."""
    site = nn.Conv(3, 4, (3, 3), dtype=F16, rngs=nnx.Rngs(0))
    twin = nnx.Conv(3, 4, (3, 3), dtype=F16, rngs=nnx.Rngs(0))
    for m in (site, twin):
        m.kernel[...] = jnp.full((3, 3, 3, 4), 10.0)
    x = jnp.full((1, 5, 5, 3), 300.0, F32)
    _same(site(x), twin(x))
    assert not np.isfinite(np.asarray(site(x), np.float32)).all()
    report = replay.locate(jax.make_jaxpr(site)(x), (x,))
    assert report.primitive == "conv_general_dilated" and report.site == "Conv", report
    for g in (1, 2):
        site.gear[...] = jnp.asarray(g, site.gear[...].dtype)
        assert float(jnp.max(site(x))) == 65504.0


class _CNN(nnx.Module):
    def __init__(self, rngs, dtype=None):
        self.conv = nnx.Conv(3, 8, (3, 3), dtype=dtype, rngs=rngs)
        self.bn = nnx.BatchNorm(8, dtype=dtype, rngs=rngs)
        self.head = nnx.Linear(8, 4, dtype=dtype, rngs=rngs)

    def __call__(self, x):
        return self.head(nnx.relu(self.bn(self.conv(x))).mean((1, 2)))


def test_convert_makes_a_cnns_conv_and_batch_norm_sites_sharing_their_variables():
    """Outputs and running averages stay flax's in training and after ``model.eval()``; the
    BatchNorm site holds flax's very ``BatchStat`` objects; converting again changes nothing. A
    BatchNorm with ``axis_name`` is left alone, with the reason."""
    model, twin = _CNN(nnx.Rngs(0)), _CNN(nnx.Rngs(0))
    stat = model.bn.mean
    model, report = nn.convert(model, return_report=True)
    assert isinstance(model.bn, nn.BatchNorm) and model.bn.mean is stat
    assert isinstance(model.conv, nn.Conv) and "conv: nnx.Conv -> conv" in str(report)
    assert "bn: nnx.BatchNorm -> bn" in str(report)
    assert nn.convert(model, return_report=True)[1].converted == ()  # sites stay as they are
    x = jax.random.normal(jax.random.key(0), (4, 8, 8, 3))
    for _ in range(2):
        _same(model(x), twin(x))
    _same(model.bn.var[...], twin.bn.var[...])
    model.eval()
    twin.eval()
    _same(model(x), twin(x))
    masked = nnx.Conv(3, 5, (3, 3), mask=jnp.ones((3, 3, 3, 5)).at[0].set(0), rngs=nnx.Rngs(0))
    twin_conv = nnx.Conv(3, 5, (3, 3), mask=masked.mask, rngs=nnx.Rngs(0))
    site = nn.convert(masked)  # the mask is an array: carried over, not left abstract
    _same(site(x[..., :3]), twin_conv(x[..., :3]))

    @nnx.vmap(in_axes=0, out_axes=0)
    def stack(rngs):
        return nnx.BatchNorm(4, use_scale=False, use_bias=False, rngs=rngs)

    _, report = nn.convert(stack(nnx.Rngs(0).fork(split=3)), return_report=True)
    assert report.converted[0].stack == (3,)  # from its statistics: it has no parameter
    pmapped = nnx.Sequential(nnx.BatchNorm(3, axis_name="batch", rngs=nnx.Rngs(0)))
    _, report = nn.convert(pmapped, return_report=True)
    assert not report.converted and "axis_name" in report.left_alone[0].reason


def test_a_bf16_batch_norm_whose_variance_overflows_is_an_incident_located_at_it():
    """A bf16 CNN whose input reaches ~1e20 (the batch times a gain of 1e10, twice: a batch
    value past 2**64 would be the data's fault): the BatchNorm's f32 variance passes f32
    (FAST's output is finite; its input probe and its running variance are not). The train
    step watches the BatchNorm's probes, skips the step as an incident, and tier 2 names the
    BatchNorm; in SAFE the same forward is finite."""
    model = nn.convert(_CNN(nnx.Rngs(0), dtype=BF16))
    x = jax.random.normal(jax.random.key(0), (4, 6, 6, 3))
    y = jnp.arange(4) % 4

    def loss_fn(m, batch):
        logits = m(batch[0] * batch[2] * batch[2]).astype(F32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch[1]).mean()

    state = TrainState.create(model, optax.adam(1e-3), Config())
    step = make_train_step(loss_fn)
    state, m = step(state, (x, y, F32(1.0)))
    assert not m["skipped"] and {"bn.probe_inv_std", "bn.probe_input"} <= set(m["probes"].names)
    big = x * 1e20
    _, m = step(state, (x, y, F32(1e10)))
    assert m["incident"] and m["skipped"], {k: m[k] for k in ("loss", "bad_rest", "finite")}
    assert not m["polluted"]
    graphdef, st = nnx.split(model)

    def forward(x):
        return nnx.merge(graphdef, st, copy=True)(x)

    report = replay.locate(jax.make_jaxpr(forward)(big), (big,))
    assert report is not None and report.site == "bn", report
    model.bn.gear[...] = jnp.asarray(2, model.bn.gear[...].dtype)
    out = model(big)
    assert np.isfinite(np.asarray(out, np.float32)).all()
    assert np.isfinite(np.asarray(model.bn.var[...])).all()
