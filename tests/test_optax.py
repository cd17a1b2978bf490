"""optax transforms: loss scale, geared clip, skip-non-finite, lr factor, guard."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from nan2safe_jax import Config, Gear, GearState
from nan2safe_jax import gear as G
from nan2safe_jax import optax as n2s_optax

CFG = Config(loss_scale_init=2.0**10, loss_scale_period=3, loss_scale_max=2.0**12)
PARAMS = {"w": jnp.ones((3,), jnp.float32), "b": jnp.zeros((), jnp.float32)}


def _grads(v, dtype=jnp.float32):
    return {"w": jnp.full((3,), v, dtype), "b": jnp.asarray(v, dtype)}


def _same(a, b):
    return all(
        bool(jnp.array_equal(x, y, equal_nan=True))
        for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b), strict=True)
    )


def test_loss_scale_backoff_growth_bounds_and_downshift():
    tx = n2s_optax.dynamic_loss_scale(CFG)
    s = tx.init(PARAMS)
    upd = jax.jit(tx.update)
    assert float(s.scale) == 2.0**10
    _, s = upd(_grads(jnp.nan), s, gear=jnp.int32(0))
    assert float(s.scale) == 2.0**9
    for _ in range(3):
        _, s = upd(_grads(1.0), s, gear=jnp.int32(0))
    assert float(s.scale) == 2.0**10
    for _ in range(12):
        _, s = upd(_grads(1.0), s, gear=jnp.int32(0))
    assert float(s.scale) == 2.0**12  # bounded by loss_scale_max
    _, s = upd(_grads(1.0), s, gear=jnp.int32(Gear.STABLE))
    assert float(s.scale) == 2.0**12 / 256  # the first downshift cuts by 1/256
    _, s2 = upd(_grads(1.0), s, gear=jnp.int32(Gear.STABLE))
    assert float(s2.scale) == float(s.scale)  # only on the transition
    _, s3 = upd(_grads(1.0), s2, gear=jnp.int32(Gear.FAST))
    assert float(s3.scale) == 2.0**12  # the recovery to FAST undoes the cut
    _, s4 = upd(_grads(1.0), s3, gear=jnp.int32(Gear.FAST))
    assert float(s4.scale) == float(s3.scale)  # only on the transition


def test_loss_scale_state_round_trips_through_jit():
    s = n2s_optax.dynamic_loss_scale(CFG).init(PARAMS)
    out = jax.jit(lambda x: x)(s)
    assert type(out) is type(s) and _same(out, s)


@pytest.mark.parametrize("gear,factor", [(Gear.FAST, 1.0), (Gear.STABLE, 0.5), (Gear.SAFE, 0.5)])
def test_geared_clip_matches_optax_at_the_geared_threshold(gear, factor):
    g = {"w": jnp.asarray([3.0, 4.0, 12.0]), "b": jnp.asarray(0.0)}
    tx = n2s_optax.geared_clip(2.0)
    out, state = tx.update(g, tx.init(g), gear=jnp.int32(gear))
    ref, _ = optax.clip_by_global_norm(2.0 * factor).update(g, None)
    np.testing.assert_allclose(out["w"], ref["w"], rtol=1e-6)
    assert int(state.clipped) == 1


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16, jnp.bfloat16])
@pytest.mark.parametrize("max_norm", [2.0, None])
def test_geared_clip_unscales_loss_scaled_updates_like_unscaling_first(dtype, max_norm):
    """``grad_unscale``: loss-scaled gradients in, the clip of the unscaled ones out (the
    reference unscales and clips in float64), in the gradients' dtype."""
    scale = 2.0**10
    scaled = {"w": jnp.asarray(np.asarray([3.0, -4.0, 12.0, 5e-3]) * scale, dtype)}
    unscaled = np.asarray(scaled["w"], np.float64) / scale
    norm = np.sqrt(np.sum(unscaled**2))
    tx = n2s_optax.geared_clip(max_norm)
    out, _ = tx.update(
        scaled,
        tx.init(scaled),
        gear=jnp.int32(Gear.FAST),
        grad_norm=jnp.float32(norm),
        grad_unscale=jnp.float32(1.0 / scale),
    )
    factor = 1.0 if max_norm is None else min(1.0, max_norm / norm)
    assert out["w"].dtype == dtype
    tol = {jnp.float32: 1e-6, jnp.float16: 1e-3, jnp.bfloat16: 1e-2}[dtype]
    np.testing.assert_allclose(np.asarray(out["w"], np.float64), unscaled * factor, rtol=tol)


def test_geared_clip_unscale_without_the_norm_is_an_error():
    g = {"w": jnp.ones((2,))}
    tx = n2s_optax.geared_clip(1.0)
    with pytest.raises(ValueError, match="grad_norm"):
        tx.update(g, tx.init(g), grad_unscale=jnp.float32(0.5))


def test_geared_clip_fp16_norm_does_not_overflow():
    g = {"w": jnp.full((4,), 300.0, jnp.float16)}  # sum of squares = 360000 > fp16 max
    out, _ = n2s_optax.geared_clip(1.0).update(g, n2s_optax.GearedClipState(jnp.int32(0)))
    np.testing.assert_allclose(np.asarray(out["w"], np.float32), 0.5, rtol=1e-3)


@pytest.mark.parametrize("unscale", [None, 0.25])
def test_geared_clip_nonfinite_norm_gives_zero_not_nan(unscale):
    g = {"w": jnp.asarray([jnp.inf, 1.0])}
    extra = {} if unscale is None else {"grad_norm": jnp.float32(jnp.inf), "grad_unscale": unscale}
    tx = n2s_optax.geared_clip(1.0)
    out, state = jax.jit(lambda g: tx.update(g, tx.init(g), **extra))(g)
    np.testing.assert_array_equal(np.asarray(out["w"]), [0.0, 0.0])
    assert int(state.clipped) == 1  # a non-finite norm counts as clipped (to zero)


def test_geared_clip_counts_only_the_steps_it_clips():
    tx = n2s_optax.geared_clip(10.0)
    small = {"w": jnp.asarray([3.0, 4.0])}  # norm 5: under the threshold, passed as is
    out, state = jax.jit(lambda g: tx.update(g, tx.init(g)))(small)
    np.testing.assert_array_equal(np.asarray(out["w"]), [3.0, 4.0])
    assert int(state.clipped) == 0


def test_skip_nonfinite_keeps_params_and_inner_state_however_many_in_a_row():
    inner = optax.adam(0.1)
    tx = n2s_optax.skip_nonfinite(inner)
    s = tx.init(PARAMS)
    s1_updates, s1 = tx.update(_grads(1.0), s, PARAMS)
    for _ in range(10):
        u, s2 = tx.update(_grads(jnp.nan), s1, PARAMS)
        assert _same(s2.inner, s1.inner)
        assert all(float(jnp.max(jnp.abs(x))) == 0 for x in jax.tree_util.tree_leaves(u))
        s1 = s2
    assert int(s1.skipped) == 10 and int(s1.streak) == 10
    # optax.apply_if_finite gives up after max_consecutive_errors and applies the NaN update.
    ref = optax.apply_if_finite(inner, max_consecutive_errors=3)
    rs = ref.init(PARAMS)
    for _ in range(4):
        ru, rs = ref.update(_grads(jnp.nan), rs, PARAMS)
    assert not np.all(np.isfinite(ru["w"]))


def test_safe_lr_factor_applies_only_in_safe():
    gs = GearState.create({"attn": ()})
    tx = n2s_optax.safe_lr_factor(0.1)
    u, _ = tx.update(_grads(1.0), tx.init(PARAMS), gear=gs)
    assert float(u["b"]) == 1.0
    u, _ = tx.update(_grads(1.0), tx.init(PARAMS), gear=G.set_site(gs, "attn", Gear.SAFE))
    assert float(u["b"]) == pytest.approx(0.1)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_guard_equals_f32_inner_when_fast_and_finite(dtype):
    cfg = Config(clip_norm=None)
    inner = optax.adamw(1e-2)
    params = jax.tree_util.tree_map(lambda x: x.astype(dtype), PARAMS)
    tx = n2s_optax.guard(inner, cfg)
    gs = GearState.create({})
    s, rs = tx.init(params), inner.init(PARAMS)
    for v in (0.5, -1.0, 2.0):
        g = _grads(v, dtype)
        u, s = tx.update(g, s, params, gear=gs)
        ru, rs = inner.update(_grads(jnp.asarray(v, dtype).astype(jnp.float32)), rs, PARAMS)
        ru = jax.tree_util.tree_map(lambda x: x.astype(dtype), ru)  # moments are kept in f32
        tol = {jnp.float32: 1e-6, jnp.bfloat16: 1e-2, jnp.float16: 2e-3}[dtype]
        for a, b in zip(jax.tree_util.tree_leaves(u), jax.tree_util.tree_leaves(ru), strict=True):
            assert a.dtype == b.dtype
            np.testing.assert_allclose(np.float32(a), np.float32(b), rtol=tol)


def test_guard_skips_and_backs_off_the_loss_scale():
    tx = n2s_optax.guard(optax.sgd(0.1), CFG)
    s = tx.init(PARAMS)
    gs = GearState.create({})
    u, s2 = jax.jit(tx.update)(_grads(jnp.inf), s, PARAMS, gear=gs)
    assert float(n2s_optax.loss_scale_of(s2)) == float(n2s_optax.loss_scale_of(s)) / 2
    assert int(s2.skip.skipped) == 1
    assert all(float(jnp.max(jnp.abs(x))) == 0 for x in jax.tree_util.tree_leaves(u))
    out = jax.jit(lambda x: x)(s2)
    assert type(out) is type(s2) and _same(out, s2)


def test_fp16_adam_moments_do_not_underflow_to_inf():
    params = {"w": jnp.ones((4,), jnp.float16)}
    g = {"w": jnp.full((4,), 1e-3, jnp.float16)}  # g**2 * (1 - b2) underflows in fp16
    raw, _ = optax.adam(1e-2).update(g, optax.adam(1e-2).init(params), params)
    assert not np.all(np.isfinite(np.asarray(raw["w"], np.float32)))  # the fault is real
    tx = n2s_optax.in_float32(optax.adam(1e-2))
    u, state = tx.update(g, tx.init(params), params)
    assert u["w"].dtype == jnp.float16 and np.all(np.isfinite(np.asarray(u["w"], np.float32)))
    assert jax.tree_util.tree_leaves(state)[1].dtype == jnp.float32


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize(
    "grad,applied", [(0.5, True), (0.5, False), (jnp.nan, False), (jnp.inf, False)]
)
def test_apply_update_matches_update_then_apply(dtype, grad, applied):
    """The fused form (both outcomes traced, selected per leaf) against the reference: the
    guard's ``update`` with ``finite=applied``, then ``optax.apply_updates``; parameters,
    moments, skip counters and loss scale alike, through jit. (An applied step has finite
    gradients: the train step applies only those.)"""
    tx = n2s_optax.guard(optax.adamw(1e-2), CFG)
    params = jax.tree_util.tree_map(lambda x: (x + 0.25).astype(dtype), PARAMS)
    gs = GearState.create({})
    s = tx.init(params)
    s = tx.update(_grads(0.3, dtype), s, params, gear=gs)[1]  # moments that are not zero
    g = _grads(grad, dtype)
    ok = jnp.asarray(applied)

    def reference(g, s, p, ok):
        u, s = tx.update(g, s, p, gear=gs, finite=ok)
        return optax.apply_updates(p, u), s

    def fused(g, s, p, ok):
        return n2s_optax.apply_update(tx, g, s, p, ok, gear=gs)

    got, want = jax.jit(fused)(g, s, params, ok), jax.jit(reference)(g, s, params, ok)
    if applied and np.isfinite(grad):
        assert not _same(got[0], params)  # the update was applied
    if not applied:
        assert _same(got[0], params)  # a skip leaves the parameters exactly
        assert int(got[1].skip.skipped) == int(s.skip.skipped) + 1
    assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(want)
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want), strict=True):
        assert a.dtype == b.dtype
        np.testing.assert_allclose(np.float32(a), np.float32(b), rtol=1e-6, atol=0)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_update_outcomes_are_the_guards_two_verdicts_unselected(dtype):
    """``update_outcomes`` gives what the guard's ``update`` gives with ``finite=True`` (added
    to the parameters) and with ``finite=False`` (its state only): the train step keeps one
    by its own verdict. The skip keeps the inner state exactly and moves the counters."""
    tx = n2s_optax.guard(optax.adamw(1e-2), CFG)
    params = jax.tree_util.tree_map(lambda x: (x + 0.25).astype(dtype), PARAMS)
    gs = GearState.create({})
    s = tx.init(params)
    s = tx.update(_grads(0.3, dtype), s, params, gear=gs)[1]
    g = _grads(0.5, dtype)

    def reference(g, s, p):
        u, applied = tx.update(g, s, p, gear=gs, finite=jnp.asarray(True))
        _, skipped = tx.update(g, s, p, gear=gs, finite=jnp.asarray(False))
        return optax.apply_updates(p, u), applied, skipped

    got = jax.jit(lambda g, s, p: n2s_optax.update_outcomes(tx, g, s, p, gear=gs))(g, s, params)
    want = jax.jit(reference)(g, s, params)
    assert not _same(got[0], params)
    assert _same(got[2].skip.inner, s.skip.inner)
    assert int(got[2].skip.skipped) == int(s.skip.skipped) + 1
    assert float(got[2].loss_scale.scale) < float(s.loss_scale.scale)
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want), strict=True):
        assert a.dtype == b.dtype
        np.testing.assert_allclose(np.float32(a), np.float32(b), rtol=1e-6, atol=0)


def test_update_outcomes_needs_a_guard_state():
    tx = optax.sgd(0.1)
    with pytest.raises(ValueError, match="guard"):
        n2s_optax.update_outcomes(tx, _grads(1.0), tx.init(PARAMS), PARAMS)


def test_apply_update_of_a_plain_optimizer_is_update_then_apply():
    tx = optax.sgd(0.1)
    p, g = PARAMS, _grads(1.0)
    new, s = n2s_optax.apply_update(tx, g, tx.init(p), p, jnp.asarray(True))
    ref = optax.apply_updates(p, tx.update(g, tx.init(p), p)[0])
    assert _same(new, ref) and _same(s, tx.init(p))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_geared_clip_known_finite_skips_the_mask_with_the_same_result(dtype):
    tx = n2s_optax.geared_clip(2.0)
    g = _grads(3.0, dtype)
    masked, _ = tx.update(g, tx.init(PARAMS), gear=jnp.int32(0))
    known, _ = tx.update(g, tx.init(PARAMS), gear=jnp.int32(0), finite=True)
    assert _same(known, masked)

    def checks(finite):
        def f(g):
            norm = optax.global_norm(g)
            return tx.update(g, tx.init(PARAMS), gear=jnp.int32(0), grad_norm=norm, finite=finite)

        return str(jax.make_jaxpr(f)(g)).count("is_finite")

    assert checks(True) == 1 and checks(None) == 1 + len(g)  # the norm's; no mask per leaf


def test_geared_clip_takes_a_float64_norm_under_x64():
    """With x64 on, a caller's float64 ``grad_norm`` still gives f32 clipped updates (the
    multiplier's ``lax.cond`` branches must agree in dtype)."""
    if not hasattr(jax, "enable_x64"):
        pytest.skip("jax.enable_x64 not in this JAX")
    with jax.enable_x64(True):
        g = {"w": jnp.asarray([3.0, 4.0], jnp.float32)}
        tx = n2s_optax.geared_clip(1.0)
        norm = jnp.asarray(5.0, jnp.float64)
        out, _ = tx.update(g, tx.init(g), grad_norm=norm, grad_unscale=jnp.float32(1.0))
    assert out["w"].dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(out["w"]), [0.6, 0.8], rtol=1e-6)


@pytest.mark.parametrize(
    "wrap",
    [
        lambda g: optax.chain(g, optax.identity()),
        lambda g: optax.apply_if_finite(g, 3),
        lambda g: optax.MultiSteps(g, 2),
        lambda g: n2s_optax.guard(g),
    ],
    ids=["chain", "apply_if_finite", "MultiSteps", "guard"],
)
def test_a_guard_nested_inside_another_wrapper_is_refused(wrap):
    """A guard inside ``optax.chain`` (or ``apply_if_finite`` ...) gets a second guard around
    it, whose ``grad_unscale`` reaches the inner one through the chain's extra arguments: the
    gradients were unscaled twice (SGD moved parameters 1/32768 of the way, silently). Refused
    with the fix; the guard outermost, around the same wrappers, is the supported form."""
    params = {"w": jnp.ones((3,))}
    with pytest.raises(ValueError, match="tx: .*Put the guard outermost"):
        n2s_optax.guard(wrap(n2s_optax.guard(optax.sgd(0.1)))).init(params)
    outer = n2s_optax.guard(optax.chain(optax.identity(), optax.sgd(0.1)), Config(clip_norm=None))
    state = outer.init(params)
    g, gs = {"w": jnp.full((3,), 2.0)}, GearState.create({})
    upd, _ = outer.update(g, state, params, gear=gs, grad_unscale=0.5, grad_norm=3**0.5)
    np.testing.assert_allclose(np.asarray(upd["w"]), -0.1 * np.ones(3), rtol=1e-6)
