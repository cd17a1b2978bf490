"""Recovery inside the step and tier 2's decisions: clean skips, staged-state bugs, SAFE where
the fault is, loss-scale overflow grace, clear errors, resume across a probe-set change."""

import dataclasses
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from tiny_models import Block, D, MonitoredNet, Net, data, loss_fn

import nan2safe_jax as nan2safe
from nan2safe_jax import Config, Gear, TrainState, incidents, make_train_step
from nan2safe_jax import gear as G
from nan2safe_jax.checkpoint import Checkpointer
from nan2safe_jax.replay.report import Report
from nan2safe_jax.train import OVERFLOW_GRACE, lr_factors


def _leaves_equal(new, old):
    for a, b in zip(jax.tree_util.tree_leaves(new), jax.tree_util.tree_leaves(old), strict=True):
        if jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key):
            continue  # RNG streams may advance
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


class NormBNNet(nnx.Module):
    """Row-normalises its input (a zero row is 0/0 inside the model), then BatchNorm."""

    def __init__(self, *, rngs):
        self.lin = nnx.Linear(D, D, rngs=rngs)
        self.bn = nnx.BatchNorm(D, rngs=rngs)
        self.block = Block(D, rngs=rngs)
        self.head = nnx.Linear(D, 1, rngs=rngs)

    def __call__(self, x):
        h = x / jnp.linalg.norm(x, axis=-1, keepdims=True)
        return self.head(self.block(self.bn(self.lin(h))))


def _bn_stats(state):
    return [np.asarray(x) for x in jax.tree_util.tree_leaves(nnx.state(state.model, nnx.BatchStat))]


def test_skipped_model_nan_leaves_batchnorm_stats_and_baselines_bit_identical():
    state = TrainState.create(NormBNNet(rngs=nnx.Rngs(0)), optax.adam(1e-3))
    step = make_train_step(loss_fn)
    x, y = data(4)
    for i in range(3):
        moved, _ = step(state, (x[i], y[i]))
        pairs = zip(_bn_stats(moved), _bn_stats(state), strict=True)
        assert any(not np.array_equal(a, b) for a, b in pairs)  # a normal step moves them
        state = moved
    bad = x[3].at[5].set(0.0)  # finite data; the model makes 0/0 from it
    new, m = step(state, (bad, y[3]))
    assert bool(m["incident"]) and bool(m["skipped"]) and not bool(m["polluted"])
    for a, b in zip(_bn_stats(new), _bn_stats(state), strict=True):
        np.testing.assert_array_equal(a, b)
    _leaves_equal(
        (new.params, new.rest, new.detector, new.update_stats),
        (state.params, state.rest, state.detector, state.update_stats),
    )
    assert bool(nan2safe.train.state_is_finite(new))
    # The optimizer's moments are kept; the guard's counters record the skip.
    _leaves_equal(new.opt_state.skip.inner, state.opt_state.skip.inner)
    assert int(new.opt_state.skip.skipped) == int(state.opt_state.skip.skipped) + 1
    assert int(new.opt_state.skip.streak) == int(state.opt_state.skip.streak) + 1
    # The step after the skip is not counted as non-finite.
    _, m2 = step(new, (x[0], y[0]))
    assert float(m2["nonfinite"]) == 0.0 and not bool(m2["skipped"])


def test_a_model_variable_that_overflows_while_the_loss_is_finite_is_skipped_and_located():
    state = TrainState.create(MonitoredNet(rngs=nnx.Rngs(0)), optax.adam(1e-3))
    step = make_train_step(loss_fn)
    x, y = data(2)
    state, m = step(state, (x[0], y[0]))
    assert not bool(m["skipped"]) and float(state.rest["peak"][...]) > 0
    big = (x[1] * 1e6, y[1])
    new, m = step(state, big)
    assert bool(m["finite"]) and bool(m["bad_rest"]) and bool(m["bad_update"])
    assert bool(m["skipped"]) and bool(m["incident"]) and not bool(m["polluted"])
    _leaves_equal((new.params, new.rest), (state.params, state.rest))
    _leaves_equal(new.opt_state.skip.inner, state.opt_state.skip.inner)
    assert bool(nan2safe.train.state_is_finite(new))
    # Tier 2 on this step (the Trainer's): tests/test_trainer.py
    # ::test_a_model_variable_that_overflows_is_located_and_the_model_safe_stay_logged_once


def test_finite_gradients_whose_norm_passes_f32_are_named_as_the_steps_own_sum():
    """Every gradient finite but ~1e21: the step's one-pass f32 sum of squares overflows, so the
    step is skipped. Tier 2's culprit is then that sum, in the library's own step code; the
    hint says so and points at the loss and the weights, not at ``convert``."""
    state = TrainState.create(Net(rngs=nnx.Rngs(0)), optax.sgd(0.0))
    step = make_train_step(lambda m, b: 1e22 * jnp.mean(m(b[0])))
    x, y = data(1)
    _, m = step(state, (x[0], y[0]))
    assert bool(jnp.isfinite(m["loss"])) and bool(m["skipped"])
    report = nan2safe.replay.locate_step(step, state, (x[0], y[0]))
    assert incidents.in_step_bookkeeping(report), report.source
    hint = incidents.unsited_hint(report, state.gear.sites)
    assert "train step's own bookkeeping" in hint and "convert" not in hint


def _nan_update_at(k, factor=jnp.nan):
    """An optimizer fault: a finite gradient whose update is NaN at the optimizer's step k (or
    multiplied by another ``factor``)."""

    def init(params):
        del params
        return jnp.zeros([], jnp.int32)

    def update(updates, count, params=None):
        del params
        f = jnp.where(count == k, factor, 1.0)
        return jax.tree_util.tree_map(lambda u: u * f, updates), count + 1

    return optax.GradientTransformation(init, update)


# NaN, or finite elements whose norm overflows f32 (the step's one-pass update norm reads it
# as non-finite: an update of norm ~1e19 or more is a fault all the same)
@pytest.mark.parametrize("factor", [float("nan"), 1e30], ids=["nan", "norm_overflow"])
def test_nonfinite_update_from_finite_gradients_is_skipped_and_escalates(factor):
    tx = optax.chain(optax.sgd(1e-2), _nan_update_at(2, factor))
    state = TrainState.create(Net(rngs=nnx.Rngs(0)), tx)
    step = make_train_step(loss_fn)
    x, y = data(3)
    for i in range(2):
        state, m = step(state, (x[i], y[i]))
        assert not bool(m["skipped"])
    new, m = step(state, (x[2], y[2]))
    assert bool(m["finite"]) and bool(m["bad_update"])
    assert bool(m["skipped"]) and bool(m["incident"])
    _leaves_equal((new.params, new.opt_state), (state.params, state.opt_state))
    assert int(m["next_gear"]) == Gear.STABLE


def _push_first_up_kernel(amount):
    """An optimizer transform adding ``amount`` to element [0, 0] of block 0's ``up`` kernel."""

    def update(updates, state, params=None):
        del params

        def one(path, u):
            name = jax.tree_util.keystr(path)
            if "blocks" in name and "[0]" in name and "up" in name and "kernel" in name:
                return u.at[0, 0].add(jnp.asarray(amount, u.dtype))
            return u

        return jax.tree_util.tree_map_with_path(one, updates), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_an_update_that_overflows_the_parameter_dtype_is_a_bad_update(dtype):
    """A finite update that takes a parameter past its dtype's largest value (stored as inf)
    is a bad update: the parameters stay finite. XLA may compute the change in f32 before it
    is rounded to the parameter's dtype (excess precision); the check must see the stored
    value. The weight sits on an input feature that is 0 in the data, so it changes nothing
    in the forward and its gradient is finite."""
    big = float(jnp.finfo(dtype).max)
    model = Net(rngs=nnx.Rngs(0), dtype=dtype)
    kernel = model.blocks[0].up.kernel
    kernel[...] = kernel[...].at[0, 0].set(jnp.asarray(0.75 * big, dtype))
    cfg = Config(loss_scale_init=1.0, clip_norm=None)
    tx = optax.chain(optax.sgd(1e-3), _push_first_up_kernel(0.5 * big))
    state = TrainState.create(model, nan2safe.optax.guard(tx, cfg), cfg)
    x, y = data(1, dtype=dtype)
    new, m = make_train_step(loss_fn)(state, (x[0].at[:, 0].set(0), y[0]))
    assert bool(m["finite"]) and bool(m["bad_update"]) and bool(m["skipped"])
    _leaves_equal((new.params, new.opt_state), (state.params, state.opt_state))


def test_a_plain_optimizer_state_is_kept_after_nonfinite_gradients():
    """A state whose optimizer is not a ``guard`` (built by hand, not by ``TrainState.create``)
    keeps its parameters and optimizer state after non-finite gradients too."""
    tx = optax.with_extra_args_support(optax.adam(1e-3))
    state = TrainState.create(Net(rngs=nnx.Rngs(0)), optax.adam(1e-3))
    state = state.replace(tx=tx, opt_state=tx.init(state.params))

    def nan_on_marker(model, batch):  # finite data; the loss is NaN where x[0, 0] is 1e3
        return loss_fn(model, batch) * jnp.where(batch[0][0, 0] == 1e3, jnp.nan, 1.0)

    x, y = data(2)
    step = make_train_step(nan_on_marker)
    moved, m = step(state, (x[0], y[0]))
    assert not bool(m["skipped"])
    new, m = step(moved, (x[1].at[0, 0].set(1e3), y[1]))
    assert not bool(m["finite"]) and not bool(m["polluted"]) and bool(m["skipped"])
    _leaves_equal((new.params, new.opt_state), (moved.params, moved.opt_state))


def test_safe_lr_cut_applies_to_the_safe_site_only_and_on_its_last_safe_step():
    cfg = Config(clip_norm=None, safe_max_steps=1, loss_scale_init=1.0)
    state = TrainState.create(Net(rngs=nnx.Rngs(0)), optax.sgd(0.5), cfg)
    step = make_train_step(loss_fn)
    x, y = data(1)
    fast, _ = step(state, (x[0], y[0]))
    safe_in = state.replace(gear=G.set_site(state.gear, "blocks.0", Gear.SAFE, cfg=cfg))
    safe, m = step(safe_in, (x[0], y[0]))
    assert int(np.max(m["site_gears"]["blocks.0"])) == Gear.SAFE
    assert int(safe.gear.sites["blocks.0"]) == Gear.STABLE  # the stay ends with this step
    flat = lambda s: jax.tree_util.tree_flatten_with_path(s.params)[0]
    for (path, v0), (_, vf), (_, vs) in zip(flat(state), flat(fast), flat(safe), strict=True):
        d_fast = np.asarray(vf) - np.asarray(v0)
        d_safe = np.asarray(vs) - np.asarray(v0)
        in_site = [getattr(k, "key", None) for k in path[:2]] == ["blocks", 0]
        assert np.any(d_fast != 0)
        np.testing.assert_allclose(d_safe, (0.1 if in_site else 1.0) * d_fast, rtol=1e-5, atol=1e-7)


def test_lr_factors_follow_sites_layers_and_the_global_level():
    gs = G.GearState.create({"a": (), "stack": (3,)})
    params = {"a": {"w": jnp.ones((2, 2))}, "stack": {"w": jnp.ones((3, 4))}, "h": jnp.ones(2)}
    f = lr_factors(params, G.set_site(gs, "stack", Gear.SAFE, index=1), 0.1)
    assert float(f["a"]["w"]) == 1.0 and float(f["h"]) == 1.0
    np.testing.assert_allclose(np.asarray(f["stack"]["w"])[:, 0], [1.0, 0.1, 1.0])
    f = lr_factors(params, G.set_level(gs, Gear.SAFE), 0.1)
    assert all(np.all(np.asarray(v) == np.float32(0.1)) for v in jax.tree_util.tree_leaves(f))


def test_loss_scale_overflow_grace_backs_off_without_an_incident():
    cfg = Config(loss_scale_init=2.0**24, loss_scale_max=2.0**24)
    state = TrainState.create(Net(rngs=nnx.Rngs(0), dtype=jnp.float16), optax.adam(1e-3), cfg)
    step = make_train_step(loss_fn)
    x, y = data(24, dtype=jnp.float16)
    scales, overflows = [], 0
    for i in range(24):
        state, m = step(state, (x[i], y[i]))
        scales.append(float(m["loss_scale"]))
        assert not bool(m["incident"])  # the loss scale's business, never tier 2's
        if bool(m["overflow"]):
            overflows += 1
            assert bool(m["skipped"])
            if overflows <= OVERFLOW_GRACE:
                assert int(m["next_gear"]) == Gear.FAST  # grace: no downshift yet
        elif overflows:
            break
    assert overflows >= 2 and not bool(m["skipped"])
    assert scales[1] == scales[0] / 2  # the back-off of one overflow
    assert all(np.diff(scales) <= 0)


def test_loss_fn_with_aux_is_supported_or_rejected_clearly():
    state = TrainState.create(Net(rngs=nnx.Rngs(0)), optax.sgd(0.1))
    x, y = data(1)

    def with_aux(model, batch):
        loss = loss_fn(model, batch)
        return loss, {"twice": 2 * loss}

    with pytest.raises(ValueError, match="has_aux=True"):
        make_train_step(with_aux)(state, (x[0], y[0]))
    _, m = make_train_step(with_aux, has_aux=True)(state, (x[0], y[0]))
    assert float(m["aux"]["twice"]) == pytest.approx(2 * float(m["loss"]))


def test_model_without_sites_warns_at_create():
    with pytest.warns(UserWarning, match="no sites"):
        TrainState.create(nnx.Linear(D, 1, rngs=nnx.Rngs(0)), optax.sgd(0.1))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        TrainState.create(Net(rngs=nnx.Rngs(0)), optax.sgd(0.1))


def test_checkpoint_resumes_across_a_probe_set_change(tmp_path):
    state = TrainState.create(Net(rngs=nnx.Rngs(0)), optax.adam(1e-3))
    step = make_train_step(loss_fn)
    x, y = data(3)
    for i in range(3):
        state, _ = step(state, (x[i], y[i]))
    old = state.with_probes(state.detector.names + ("extra",))
    ck = Checkpointer(tmp_path / "ck", async_save=False)
    assert ck.save(3, old)
    template = TrainState.create(Net(rngs=nnx.Rngs(1)), optax.adam(1e-3))
    restored, at = ck.restore_latest(template)
    ck.close()
    assert at == 3 and restored.detector.names == template.detector.names
    _leaves_equal((restored.params, restored.detector), (state.params, state.detector))


def _report(site):
    blank = Report.no_equation(
        kind="nan", inputs=[], channels={}, diagnosis="0/0", explanation="", replays=0, seconds=0
    )
    return dataclasses.replace(blank, primitive="div", site=site)


def test_tier2_rolls_back_when_a_site_fails_again_in_safe():
    cfg = Config(safe_max_steps=3)
    gs = G.GearState.create({"blocks.0": (), "blocks.1": ()})
    first = incidents._downshift(_report("blocks.0"), gs, gs, cfg)
    assert first.kind == "located" and not first.restore
    assert int(first.gear.sites["blocks.0"]) == Gear.SAFE
    again = incidents._downshift(_report("blocks.0"), first.gear, first.gear, cfg)
    assert again.kind == "repeat" and again.restore
    assert int(again.gear.safe_left["blocks.0"]) == 2 * cfg.safe_max_steps  # a longer stay
    outside = incidents._downshift(_report(None), gs, gs, cfg)
    assert outside.kind == "located" and int(outside.gear.level) == Gear.SAFE
