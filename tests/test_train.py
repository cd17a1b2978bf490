"""TrainState and the jitted step: no recompiles, tier 1 before non-finite, skipped NaN steps."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from tiny_models import D, Net, data, logistic_loss, loss_fn, set_fast_only

import nan2safe_jax as nan2safe
from nan2safe_jax import Config, Gear, TrainState, detector, incidents, make_train_step
from nan2safe_jax import gear as G
from nan2safe_jax.probe import ProbeStats
from nan2safe_jax.site import Probe

_data = data


def _state(dtype=jnp.float32, cfg=None, lr=1e-3):
    model = Net(rngs=nnx.Rngs(0), dtype=dtype)
    return TrainState.create(model, nan2safe.optax.guard(optax.adam(lr), cfg or Config()), cfg)


@pytest.fixture(scope="module")
def step():
    return make_train_step(loss_fn)


def test_create_names_sites_and_probes():
    state = _state()
    assert set(state.gear.sites) == {"blocks.0", "blocks.1"}
    assert state.detector.names == (
        "blocks.0.probe_hidden",
        "blocks.1.probe_hidden",
        "loss",
        "grad_norm",
        "update_norm",
    )


def test_site_variables_are_rebuilt_by_the_step_not_carried(step):
    """The sites' gear and probe variables are not state: ``rest`` holds none, the step
    rebuilds them (gears from ``state.gear``), and ``state.model`` shows each site's
    effective gear; the probes the forward writes still reach the detector and the metrics."""
    state = _state()
    from nan2safe_jax.site import SiteGear

    assert not any(
        isinstance(v, (SiteGear, Probe))
        for v in jax.tree_util.tree_leaves(
            state.rest, is_leaf=lambda v: isinstance(v, nnx.Variable)
        )
    )
    assert len(state.site_template) == 4  # two sites, a gear and a probe each
    state = state.replace(gear=G.set_site(state.gear, "blocks.1", Gear.SAFE))
    gears = {k: int(v.get_value()) for k, v in nan2safe.site.site_gears(state.model).items()}
    assert gears == {"blocks.0": Gear.FAST, "blocks.1": Gear.SAFE}
    x, y = _data(1)
    new, m = step(state, (x[0], y[0]))
    assert jax.tree_util.tree_structure(new) == jax.tree_util.tree_structure(state)
    probe = np.asarray(m["probes"]["blocks.0.probe_hidden"])
    assert probe[0] > 0  # the forward's max |hidden|, not the template's zeros
    assert int(m["site_gears"]["blocks.1"]) == Gear.SAFE


def test_a_rest_written_back_from_the_model_drops_its_site_variables(step):
    """``state.replace(rest=nnx.split(state.model, nnx.Param, ...)[2])`` (writing a model's
    edited variables back, as the demo does with its knobs) holds the site variables the state
    does not carry: ``replace`` drops them, so the state keeps its structure and steps."""
    state = _state()
    rest = nnx.split(state.model, nnx.Param, ...)[2]
    assert len(jax.tree_util.tree_leaves(rest)) > len(jax.tree_util.tree_leaves(state.rest))
    written = state.replace(rest=rest)
    assert jax.tree_util.tree_structure(written) == jax.tree_util.tree_structure(state)
    x, y = _data(1)
    new, m = step(written, (x[0], y[0]))
    assert bool(m["finite"])


def test_plain_optimizer_is_wrapped_in_guard():
    state = TrainState.create(Net(rngs=nnx.Rngs(0)), optax.sgd(0.1))
    assert nan2safe.optax.is_guarded(state.opt_state)


def test_the_step_passes_the_loss_to_an_optimizer_that_reads_it():
    """``optax.contrib.reduce_on_plateau`` reads the loss as ``value=``: the step passes it,
    and the plateau's scale moves as when the same losses are fed to it by hand."""

    def plateau():
        return optax.contrib.reduce_on_plateau(factor=0.5, patience=1, cooldown=0)

    # A learning rate of 0: the same batch gives the same loss, which never improves.
    state = TrainState.create(Net(rngs=nnx.Rngs(0)), optax.chain(optax.sgd(0.0), plateau()))
    step = make_train_step(loss_fn)
    x, y = data(1)
    ref = plateau()
    ref_state = ref.init(state.params)
    for _ in range(4):
        state, m = step(state, (x[0], y[0]))
        assert not bool(m["skipped"])
        _, ref_state = ref.update(state.params, ref_state, value=m["loss"])
    got = optax.tree_utils.tree_get(state.opt_state, "ReduceLROnPlateauState")
    assert float(got.best_value) == float(ref_state.best_value) == float(m["loss"])
    assert float(got.scale) == float(ref_state.scale) == 0.125  # halved at steps 2, 3 and 4


class _BNNet(nnx.Module):
    def __init__(self, *, rngs):
        self.lin = nnx.Linear(D, D, rngs=rngs)
        self.bn = nnx.BatchNorm(D, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)

    def __call__(self, x):
        return self.drop(self.bn(self.lin(x)))


def test_the_state_shares_no_variable_with_its_model_or_the_model_it_shows():
    """Running the model a state was created from, or ``state.model``, in train mode (BatchNorm's
    statistics, Dropout's counter) or editing either leaves the state as it was."""
    model = _BNNet(rngs=nnx.Rngs(0))
    state = TrainState.create(model, optax.sgd(1e-2))

    def arrays(st):
        key = lambda v: jax.dtypes.issubdtype(v.dtype, jax.dtypes.prng_key)
        unkeyed = lambda v: jax.random.key_data(v) if key(v) else v
        return [np.asarray(unkeyed(v)) for v in jax.tree_util.tree_leaves((st.params, st.rest))]

    before = arrays(state)
    x = data(1)[0][0]
    for m in (model, state.model):
        m.train()
        m(x)
        m.lin.kernel[...] = jnp.full_like(m.lin.kernel[...], 7.0)
    assert float(jnp.abs(model.bn.mean[...]).max()) > 0  # the runs did move their own copies
    for a, b in zip(arrays(state), before, strict=True):
        np.testing.assert_array_equal(a, b)


def test_train_state_round_trips_through_jit():
    state = _state()
    out = jax.jit(lambda s: s)(state)
    assert jax.tree_util.tree_structure(out) == jax.tree_util.tree_structure(state)
    for a, b in zip(jax.tree_util.tree_leaves(out), jax.tree_util.tree_leaves(state), strict=True):
        np.testing.assert_array_equal(a, b)


def test_gear_changes_never_recompile(step, count_compiles):
    x, y = _data(1)
    batch = (x[0], y[0])
    state = _state()

    def changes(state):
        gears = [
            lambda gs: G.set_level(gs, Gear.STABLE),
            lambda gs: G.set_site(gs, "blocks.1", Gear.SAFE),
            lambda gs: G.set_level(gs, Gear.SAFE),
            lambda gs: G.set_site(gs, "blocks.1", Gear.FAST),
            lambda gs: G.set_level(gs, Gear.FAST),
        ]
        levels = []
        for change in gears * 2:
            state = state.replace(gear=change(state.gear))
            state, m = step(state, batch)
            levels.append(int(m["site_gears"]["blocks.1"]))
        return state, levels

    state, _ = changes(state)  # warm every eager helper and the step once
    with count_compiles() as c:
        state, levels = changes(state)
    assert c.count == 0
    assert set(levels) == {0, 1, 2}


def test_a_restored_or_host_edited_state_runs_the_program_compiled_for_a_fresh_one(count_compiles):
    """A jitted program is keyed on whether each argument is committed to a device. A fresh
    state's arrays are not, a restored checkpoint's are (orbax places them), and what the host
    sets between steps (a site's gear after a located fault) is not: each mix compiled the
    step again, and a resumed run never matched what the persistent cache held."""
    step = make_train_step(loss_fn)  # its own jit cache: nothing compiled before this test
    x, y = _data(2)
    batch = (x[0], y[0])
    on_device = lambda t: jax.tree_util.tree_map(  # noqa: E731 - as a checkpoint restores it
        lambda a: jax.device_put(np.asarray(a), jax.devices()[0]), t
    )
    fresh = _state()
    assert not any(a.committed for a in jax.tree_util.tree_leaves(fresh))
    state, _ = step(fresh, batch)
    G.set_site(state.gear, "blocks.1", Gear.SAFE)  # its eager helpers compiled here
    on_device(fresh)
    with count_compiles() as c:
        restored = on_device(fresh)
        assert all(a.committed for a in jax.tree_util.tree_leaves(restored))
        state, _ = step(restored, batch)
        edited = state.replace(gear=G.set_site(state.gear, "blocks.1", Gear.SAFE))
        state, m = step(edited, (x[1], y[1]))
        mixed = restored.replace(gear=G.set_site(restored.gear, "blocks.1", Gear.SAFE))
        step(mixed, batch)
    assert c.count == 0
    assert int(m["site_gears"]["blocks.1"]) == Gear.SAFE


def test_clean_stationary_run_never_downshifts(step):
    x, y = _data(50)
    state = _state()
    gears = []
    for i in range(1000):
        state, m = step(state, (x[i % 50], y[i % 50]))
        gears.append(m["next_gear"])
    assert int(jnp.max(jnp.stack(gears))) == Gear.FAST
    assert int(state.gear.downshifts) == 0
    assert float(m["loss"]) < 0.5


def test_growing_activations_downshift_before_the_first_nonfinite():
    calm, grow = 80, 60
    scale = [1.0] * calm + [1.35**k for k in range(1, grow + 1)]
    # Stationary data first (16 batches, cycled), then the same batches scaled up geometrically.
    x, y = _data(16)
    idx = np.arange(calm + grow) % 16
    x = (x[idx] * jnp.asarray(scale)[:, None, None]).astype(jnp.float16)
    y = y[idx]
    # A bounded loss (logistic) and no loss scaling: the first non-finite value is then the
    # forward overflow of growing activations, which tier 1 must see coming.
    cfg = Config(loss_scale_init=1.0)
    state = _state(jnp.float16, cfg=cfg, lr=1e-4)
    step = make_train_step(logistic_loss)
    first_stable = first_bad = None
    for i in range(calm + grow):
        state, m = step(state, (x[i], y[i]))
        if first_stable is None and int(m["next_gear"]) >= Gear.STABLE:
            first_stable = i
        if first_bad is None and not bool(m["finite"]):
            first_bad = i
            break
    assert first_bad is not None, "the fault is real: fp16 activations do overflow"
    assert first_stable is not None and calm <= first_stable < first_bad


def _assert_same(new, old):
    for a, b in zip(jax.tree_util.tree_leaves(new), jax.tree_util.tree_leaves(old), strict=True):
        if jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key):
            continue  # RNG streams may advance
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_nan_batch_is_skipped_as_data_with_state_unchanged(step, dtype):
    x, y = _data(4, dtype=dtype)
    state = _state(dtype)
    for i in range(3):
        state, m = step(state, (x[i], y[i]))
    bad_x = x[3].at[0, 0].set(jnp.nan)
    new, m = step(state, (bad_x, y[3]))
    assert bool(m["skipped"]) and bool(m["polluted"]) and not bool(m["incident"])
    # Data, not a model fault: every variable, the gears and the loss scale stay as they were.
    _assert_same(
        (new.params, new.opt_state, new.rest, new.detector),
        (state.params, state.opt_state, state.rest, state.detector),
    )
    _assert_same(new.gear, state.gear)
    assert float(new.loss_scale) == float(state.loss_scale)
    assert int(new.step) == int(state.step) + 1


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_update_probe_is_the_norm_of_the_change_to_the_parameters(step, dtype):
    """The step adds the update inside the optimizer's kernels; the update probe is the norm
    of the change it made, in f32 (against float64). In 16-bit parameters XLA may take the
    change before it is rounded to the parameter's dtype (excess precision, on by default),
    so there the norm agrees to the rounding of a 16-bit value."""
    x, y = _data(3, dtype=dtype)
    state = _state(dtype, Config(loss_scale_init=16.0), lr=1e-2)  # no fp16 overflow skip
    for i in range(2):
        new, m = step(state, (x[i], y[i]))
        assert not bool(m["skipped"])
        f64 = lambda t: [np.asarray(v, np.float64) for v in jax.tree_util.tree_leaves(t)]
        pairs = zip(f64(new.params), f64(state.params), strict=True)
        ref = np.sqrt(sum(np.sum((a - b) ** 2) for a, b in pairs))
        assert ref > 0
        got = ProbeStats.of(new.update_stats).max_abs
        rtol = 1e-5 if dtype == jnp.float32 else 2e-2
        np.testing.assert_allclose(float(got), ref, rtol=rtol)
        state = new
    new, m = step(state, (x[2].at[0, 0].set(jnp.nan), y[2]))
    assert bool(m["skipped"])  # no change; the probe keeps the last applied update's norm
    _assert_same((new.params, new.update_stats), (state.params, state.update_stats))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_training_reduces_the_loss_in_every_dtype(step, dtype):
    x, y = _data(8, dtype=dtype)
    state = _state(dtype, lr=3e-3)
    losses = []
    for i in range(60):
        state, m = step(state, (x[i % 8], y[i % 8]))
        losses.append(float(m["loss"]))
    assert np.all(np.isfinite(losses))
    assert np.mean(losses[-8:]) < np.mean(losses[:8])


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_outside_fp16_the_loss_scale_changes_no_bit(step, dtype):
    """The dynamic loss scale runs in every dtype (``loss_scale`` reads 32768 in a bf16 run,
    newuser51); a power of two scales every gradient exactly, so the parameters are the same
    bits as with the scale pinned at 1 (the README says so)."""
    x, y = _data(4, dtype=dtype)
    pinned = Config(loss_scale_init=1.0, loss_scale_max=1.0)
    runs = []
    for cfg in (Config(), pinned):
        state = _state(dtype, cfg, lr=1e-2)
        for i in range(4):
            state, m = step(state, (x[i], y[i]))
        runs.append((float(m["loss_scale"]), state.params))
    assert [s for s, _ in runs] == [2.0**15, 1.0]
    _assert_same(runs[0][1], runs[1][1])


def test_non_scalar_loss_is_a_clear_error():
    state = _state()
    bad = make_train_step(lambda model, batch: model(batch[0]).astype(jnp.float32))
    x, y = _data(1)
    with pytest.raises(ValueError, match="scalar"):
        bad(state, (x[0], y[0]))


def test_sown_probes_are_discovered():
    class Sowing(nnx.Module):
        def __init__(self):
            self.lin = nnx.Linear(D, 1, rngs=nnx.Rngs(0))

        def __call__(self, x):
            h = self.lin(x)
            self.sow(Probe, "out", detector.stats(h))
            return h

    state = TrainState.create(Sowing(), optax.sgd(0.1))
    step = make_train_step(loss_fn)
    x, y = _data(2)
    state, m = step(state, (x[0], y[0]))
    assert "out" in state.detector.names and "out" in m["probes"]
    state, m = step(state, (x[1], y[1]))
    assert int(state.detector.count[state.detector.names.index("out")]) == 2


def test_a_donated_step_computes_what_an_undonated_one_does_skips_included():
    """``donate=True`` gives the states an undonated step gives, bit for bit, over clean steps
    and a skipped one (a NaN in the batch: everything kept)."""
    x, y = _data(5)
    batches = [(x[i], y[i]) for i in range(5)]
    batches[3] = (x[3].at[0, 0].set(jnp.nan), y[3])
    runs = {}
    for donate in (False, True):
        step, state, seen = make_train_step(loss_fn, donate=donate), _state(), []
        for b in batches:
            state, m = step(state, b)
            seen.append((jax.device_get((state.params, state.opt_state)), bool(m["skipped"])))
        runs[donate] = seen
    assert [s for _, s in runs[True]] == [False, False, False, True, False]
    for (a, _), (b, _) in zip(runs[False], runs[True], strict=True):
        _assert_same(a, b)


def _masked_loss(model, batch):
    """``loss_fn`` with an additive mask over the batch's rows (``-inf``: left out)."""
    x, y, bias = batch
    w = jax.nn.softmax(bias)  # the rows' weights: 0 where the bias is -inf
    return jnp.sum(w[:, None] * jnp.square(model(x).astype(jnp.float32) - y))


@pytest.mark.parametrize(
    "fill,rows",
    [(-jnp.inf, 4), (jnp.inf, 4), (jnp.nan, 4), (-jnp.inf, 32)],
    ids=["-inf mask", "+inf", "nan", "-inf everywhere"],
)
def test_a_minus_inf_mask_in_the_batch_is_trained_on_and_nan_or_plus_inf_is_polluted(fill, rows):
    """A ``-inf`` additive mask is a value (its loss and gradients are finite): the step trains
    on it (it was skipped as polluted every step, silently). A ``+inf`` or NaN in the batch is
    data that is not usable, and so is a ``-inf`` the step went non-finite with (every row
    masked: 0/0): skipped as polluted, the gears and the loss scale untouched."""
    x, y = _data(1)
    bias = jnp.zeros(x.shape[1]).at[:rows].set(fill)
    state = _state()
    new, m = make_train_step(_masked_loss)(state, (x[0], y[0], bias))
    usable = fill == -jnp.inf and rows < x.shape[1]
    assert bool(m["polluted"]) is not usable and bool(m["skipped"]) is not usable
    assert bool(m["finite"]) is usable and not bool(m["incident"])
    moved = jax.tree_util.tree_map(lambda a, b: bool(jnp.any(a != b)), state.params, new.params)
    assert any(jax.tree_util.tree_leaves(moved)) is usable
    assert int(new.gear.level) == Gear.FAST
    assert float(nan2safe.optax.loss_scale_of(new.opt_state)) == float(
        nan2safe.optax.loss_scale_of(state.opt_state)
    )


def _scaled_down_loss(model, batch):
    """``loss_fn`` of the batch divided by 1e25 first: a batch of 1e30 trains finite."""
    return loss_fn(model, (batch[0] * 1e-25, batch[1]))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("finite", [False, True], ids=["fails", "trains"])
def test_a_batch_value_past_2_64_is_polluted_when_the_step_fails_with_it(step, dtype, finite):
    """A finite batch value of 1e30 squares past f32 in the first LayerNorm: the step is
    skipped as polluted input, the gears and the loss scale untouched (newuser52: the norm's
    square was blamed and sent to SAFE). A model that reads the same batch and trains finite
    (it scales the input down first) trains on it."""
    x, y = _data(1, dtype=dtype)
    batch = (x[0].at[3, 0].set(1e30), y[0])
    state = _state(dtype)
    run = make_train_step(_scaled_down_loss) if finite else step
    new, m = run(state, batch)
    assert bool(m["polluted"]) is not finite and bool(m["skipped"]) is not finite
    assert bool(m["finite"]) is finite and not bool(m["incident"])
    moved = jax.tree_util.tree_map(lambda a, b: bool(jnp.any(a != b)), state.params, new.params)
    assert any(jax.tree_util.tree_leaves(moved)) is finite
    assert int(new.gear.level) == Gear.FAST
    if not finite:
        report = incidents.polluted_report(batch)
        got = (report.kind, report.input_path, report.channels)
        assert got == ("huge", "[0]", {0: [3], 1: [0]}), got
        assert "1e+30" in report.explanation and "rows [3]" in report.explanation


def test_a_mask_fill_at_the_bottom_of_the_range_is_not_huge_data(step):
    """``finfo.min`` (flax's mask fill) in a batch is a value the data means, as ``-inf`` is:
    a step that fails with it is an incident tier 2 can locate, not polluted input."""
    x, y = _data(1)
    new, m = step(_state(), (x[0].at[3, 0].set(jnp.finfo(jnp.float32).min), y[0]))
    assert not bool(m["polluted"]) and bool(m["incident"]) and bool(m["skipped"])


def test_scaled_gradients_that_overflow_in_a_masked_batch_are_the_loss_scales_not_the_datas():
    """A finite loss whose scaled gradients overflow, in a batch with a ``-inf`` mask: the
    loss scale backs off as in any batch (the mask was blamed, every step skipped as polluted
    at the same scale, until the Trainer stopped on "no usable batch")."""
    x, y = _data(1)
    bias = jnp.zeros(x.shape[1]).at[:4].set(-jnp.inf)
    loud = lambda model, b: _masked_loss(model, b[:3]) * b[3]  # noqa: E731
    state = _state()
    new, m = make_train_step(loud)(state, (x[0], y[0], bias, jnp.float32(1e36)))
    assert bool(m["overflow"]) and not bool(m["polluted"]) and bool(m["skipped"])
    assert float(nan2safe.optax.loss_scale_of(new.opt_state)) < float(
        nan2safe.optax.loss_scale_of(state.opt_state)
    )


def test_a_fresh_state_can_be_donated_by_a_jit_of_the_users():
    """No two leaves of a fresh state are one array (XLA refuses to donate a buffer twice):
    ``jax.jit(make_train_step(loss_fn, jit=False), donate_argnums=0)`` runs, and so does a
    donating jit of the user's around the guard alone; the compiled step refuses to be traced,
    saying what to do instead."""
    state = _state()
    arrays = [x for x in jax.tree_util.tree_leaves(state) if isinstance(x, jax.Array)]
    params = {id(x) for x in jax.tree_util.tree_leaves(state.params)}
    own = [id(x) for x in arrays if id(x) not in params]
    assert len(own) == len(set(own))
    x, y = _data(1)
    stepped, m = jax.jit(make_train_step(loss_fn, jit=False), donate_argnums=0)(state, (x[0], y[0]))
    assert int(stepped.step) == 1 and bool(m["finite"])
    tx = nan2safe.optax.guard(optax.adam(1e-3))
    params = {"w": jnp.ones(3)}
    update = jax.jit(lambda g, s, p: tx.update(g, s, p), donate_argnums=(1,))
    _, opt_state = update({"w": jnp.ones(3)}, tx.init(params), params)
    assert int(nan2safe.optax.skipped_of(opt_state)) == 0
    with pytest.raises(TypeError, match="jit=False"):
        jax.jit(make_train_step(loss_fn))(_state(), (x[0], y[0]))


def test_a_numpy_batch_vmapped_into_a_site_runs_from_the_first_step():
    """The Trainer passes NumPy batches. The step's first call traced the loss with the batch
    closed over (to learn the probe names), which made a NumPy leaf a constant, and a site's
    ``custom_vjp`` under ``vmap`` refused it; the batch is now an argument, as in the step."""

    class Rows(nnx.Module):
        def __init__(self):
            self.norm = nan2safe.nn.LayerNorm(3, rngs=nnx.Rngs(0))
            self.w = nnx.Param(jnp.ones(()))

        def __call__(self, a):
            return jax.vmap(self.norm)(a) * self.w[...]

    state = TrainState.create(Rows(), optax.sgd(0.1))
    step = make_train_step(lambda m, b: jnp.sum(jnp.square(m(b["a"]))))
    a = np.arange(12, dtype=np.float32).reshape(4, 3)
    _, m = step(state, {"a": a})
    np.testing.assert_allclose(float(m["loss"]), 4 * 3.0, rtol=1e-4)  # each row: (-1.22, 0, 1.22)


def test_metrics_probes_are_one_array_row_per_probe_and_scanned_layers_stay_one_block():
    """``metrics["probes"]`` is every probe's statistics as one array (a ``NamedValues``, in
    the detector's order), each row what the forward wrote; a scanned probe's layers reach the
    stack as one ``[L, NUM_STATS]`` operand of its conditional, not a slice per layer."""
    from examples.transformer import Transformer, TransformerConfig, lm_loss, make_batch
    from nan2safe_jax.probe import NUM_STATS, NamedValues
    from nan2safe_jax.site import collect_probes

    cfg = TransformerConfig(
        num_layers=3, d_model=32, num_heads=2, seq_len=8, scan_layers=True, knobs=False
    )
    state = TrainState.create(Transformer(cfg, rngs=nnx.Rngs(0)), optax.adam(1e-3))
    batch = make_batch(jax.random.key(0), cfg, 2)
    step = make_train_step(lm_loss, fast_program=True)  # the FAST-only program alone
    new, m = step(state, batch)
    probes = m["probes"]
    assert isinstance(probes, NamedValues) and len(jax.tree_util.tree_leaves(probes)) == 1
    assert tuple(probes) == new.detector.names
    assert "blocks.attn.probe_logits[2]" in probes
    # the reference: the same forward (at FAST, as the FAST-only program ran it, without
    # compiling every gear's path), its probe variables read row by row
    model = set_fast_only(state.model)

    @nnx.jit  # (eagerly, op by op, the scanned forward took a third of the test)
    def reference(model, batch):
        with nan2safe.probe.probe_set(state.cfg.probes):
            return lm_loss(model, batch)

    loss = reference(model, batch)
    rows = collect_probes(model)
    for name, row in rows.items():
        if name in probes:
            np.testing.assert_allclose(np.asarray(probes[name]), np.asarray(row), rtol=1e-5)
    np.testing.assert_allclose(float(probes["loss"][0]), float(loss), rtol=1e-5)
    # one [3, NUM_STATS] operand per scanned probe in the stack's conditional, in the FAST-only
    # program and in the general one (its sites' gear switches)
    for fast_only in (True, False):
        jaxpr = jax.make_jaxpr(
            lambda s, b, f=fast_only: nan2safe.train.train_step(s, b, lm_loss, fast_only=f)
        )(state, batch)
        stack = next(
            e
            for e in jaxpr.eqns
            if e.primitive.name == "cond"
            and e.outvars[0].aval.shape == (len(new.detector.names), NUM_STATS)
        )
        shapes = [v.aval.shape for v in stack.invars[1:]]
        assert shapes.count((3, NUM_STATS)) >= 5 and (1, NUM_STATS) in shapes


@pytest.mark.parametrize("form", ["schedule", "inject_hyperparams", "MultiSteps", "constant"])
def test_the_detector_reads_the_rate_the_optimizer_applies_after_skipped_steps(form):
    """``lr_schedule`` is called with the count the optimizer's schedule reads: two skipped
    steps (gradients that overflow) leave it at 0, so the third step's rate is ``sched(0)``, not
    ``sched(2)`` (the rate the detector was told drifted ahead of the optimizer's); under
    ``MultiSteps(2)`` it advances once per two micro-steps."""
    sched = lambda n: 0.01 * (1.0 + jnp.asarray(n, jnp.float32))  # noqa: E731
    tx = {
        "schedule": optax.adam(sched),
        "inject_hyperparams": optax.inject_hyperparams(optax.adam)(learning_rate=sched),
        "MultiSteps": optax.MultiSteps(optax.adam(sched), 2),
        "constant": optax.adam(0.01),
    }[form]
    state = TrainState.create(Net(rngs=nnx.Rngs(0)), tx)
    # a finite batch whose third item makes the scaled gradients overflow, the loss finite
    # (not a data fault: a loss of 3e38 was inf, and a batch value past 2**64 with it polluted)
    scaled = lambda model, b: loss_fn(model, (b[0], b[1])) * b[2]  # noqa: E731
    step = make_train_step(scaled, lr_schedule=sched)
    x, y = data(5)
    for i in range(5):
        state, m = step(state, (x[i], y[i], jnp.float32(1e36 if i < 2 else 1.0)))
        assert bool(m["finite"]) == (i >= 2)
    # three applied steps: counts 0, 1, 2 (MultiSteps: 0, 0, 1) when the fifth step ran
    want = {"MultiSteps": sched(1)}.get(form, sched(2))
    np.testing.assert_allclose(float(state.detector.last_lr), float(want), rtol=1e-6)


def test_steps_skipped_for_overflowing_gradients_never_count_toward_leaving_stable(step):
    """A step the loss scale skipped (finite loss, scaled gradients past fp16) did not train:
    it is not calm, so ``recovery_window`` of them in STABLE do not return the model to FAST
    (they did, and the next step was an incident again)."""
    cfg = Config(
        recovery_window=3,
        loss_scale_init=2.0**24,
        loss_scale_min=2.0**16,
        loss_scale_downshift=1.0,
    )
    state = _state(jnp.float16, cfg)
    state = state.replace(gear=G.set_level(state.gear, Gear.STABLE, cfg))
    x, y = _data(5)
    for i in range(5):
        state, m = step(state, (x[i], y[i]))
        assert bool(m["skipped"]) and not np.isfinite(float(m["grad_norm"]))
        assert int(m["next_gear"]) == Gear.STABLE and int(state.gear.calm) == 0
    # With a scale that fits, the same steps count and the model recovers after the window.
    cfg = cfg.replace(loss_scale_init=1.0, loss_scale_min=1.0)
    state = _state(jnp.float16, cfg)
    state = state.replace(gear=G.set_level(state.gear, Gear.STABLE, cfg))
    gears = []
    for i in range(3):
        state, m = step(state, (x[i], y[i]))
        assert not bool(m["skipped"])
        gears.append(int(m["next_gear"]))
    assert gears == [Gear.STABLE, Gear.STABLE, Gear.FAST]


def test_a_guard_made_with_another_config_is_refused_naming_the_fields():
    """``TrainState.create`` keeps a guard the caller made; its loss scale, clip and SAFE lr
    factor come from the guard's own Config. A ``cfg`` that differs there was ignored without
    a word (``Config(clip_norm=None)`` with ``guard(sgd)`` still clipped at 1.0)."""
    model = Net(rngs=nnx.Rngs(0))
    cfg = Config(clip_norm=None, loss_scale_init=4.0)
    with pytest.raises(ValueError, match="clip_norm 1.0 \\(guard\\) vs None \\(cfg\\)") as info:
        TrainState.create(model, nan2safe.optax.guard(optax.sgd(1.0)), cfg)
    assert "loss_scale_init" in str(info.value) and "safe_lr_factor" not in str(info.value)
    for tx in (optax.sgd(1.0), nan2safe.optax.guard(optax.sgd(1.0), cfg)):
        state = TrainState.create(model, tx, cfg)
        assert float(state.loss_scale) == 4.0
    # Fields the guard does not read may differ; a guard given without a Config keeps its own
    # (it was compared with Config() and refused, review19).
    TrainState.create(model, nan2safe.optax.guard(optax.sgd(1.0)), Config(min_history=8))
    state = TrainState.create(model, nan2safe.optax.guard(optax.sgd(1.0), cfg))
    assert state.cfg == cfg and float(state.loss_scale) == 4.0


class _BF16Norm(nnx.Module):
    """A bf16 ``LayerNorm`` whose input its gain (a model variable, not a parameter) can push
    past ~1e19, where its f32 variance overflows: ``rsqrt(inf)`` is 0, so the norm outputs
    zeros and the loss stays finite. (A batch of such values would be the data's fault.)"""

    def __init__(self, *, rngs):
        self.gain = nnx.Variable(jnp.ones((), jnp.float32))
        self.ln = nan2safe.nn.LayerNorm(D, dtype=jnp.bfloat16, rngs=rngs)
        self.head = nnx.Linear(D, 1, dtype=jnp.bfloat16, rngs=rngs)

    def __call__(self, x):
        return self.head(self.ln((x * self.gain[...]).astype(jnp.bfloat16)))


def test_a_norm_whose_statistics_overflow_to_a_finite_output_is_an_incident_located_at_it():
    """The loss and gradients are finite, only the norm's input probe read the inf: the step is
    an incident (skipped, state kept), tier 2 names the variance's ``square`` as an overflow in
    the norm, and with that site in SAFE the same batch trains on the right normalisation (a
    LayerNorm is shift- and scale-invariant: the reference is the batch as it came)."""
    state = TrainState.create(_BF16Norm(rngs=nnx.Rngs(0)), optax.adam(1e-3))
    step = make_train_step(loss_fn)
    x, y = _data(1)
    state, m = step(state, (x[0], y[0]))
    assert not bool(m["incident"]) and bool(m["finite"])
    # rows centred first: E[x²] overflows f32, while mean² (0 here) never comes close
    centred = x[0] - x[0].mean(-1, keepdims=True)
    hot = state.model
    hot.gain[...] = jnp.float32(3e19)
    state = state.replace(rest=nnx.split(hot, nnx.Param, ...)[2])
    new, m = step(state, (centred, y[0]))
    assert np.isfinite(float(m["loss"])) and np.isfinite(float(m["grad_norm"]))
    assert bool(m["incident"]) and not bool(m["finite"]) and bool(m["skipped"])
    assert not bool(m["polluted"])  # the model made the values, not the batch
    assert float(m["probes"]["ln.probe_input"][detector.NONFINITE]) == len(centred)  # every row
    np.testing.assert_array_equal(new.params["ln"]["scale"], state.params["ln"]["scale"])

    report = nan2safe.replay.locate_step(step, state, (centred, y[0]))
    assert report.reproducible and report.site == "ln"
    assert (report.primitive, report.diagnosis) == ("square", "overflow"), report

    safe = state.replace(gear=G.set_site(state.gear, "ln", Gear.SAFE))
    new, m = step(safe, (centred, y[0]))
    assert bool(m["finite"]) and not bool(m["incident"]) and not bool(m["skipped"])
    model = new.replace(gear=safe.gear).model
    big = centred * 3e19
    got = np.asarray(model.ln(big.astype(jnp.bfloat16)), np.float32)
    ref = np.asarray(model.ln(x[0].astype(jnp.bfloat16)), np.float32)
    assert np.abs(got).max() > 0.5
    np.testing.assert_allclose(got, ref, atol=0.05)


class _Fp16Probed(nnx.Module):
    """An fp16 ``Linear`` with an output probe whose overflow ``tanh`` absorbs: the loss stays
    finite, the probe reads the inf, and the scaled gradients overflow with it."""

    def __init__(self, *, rngs):
        self.lin = nan2safe.nn.Linear(D, D, dtype=jnp.float16, probe=True, rngs=rngs)
        self.head = nnx.Linear(D, 1, dtype=jnp.float16, rngs=rngs)

    def __call__(self, x):
        return self.head(jnp.tanh(self.lin(x.astype(jnp.float16))))


def test_a_forward_probe_that_reads_an_inf_is_an_incident_not_the_loss_scales_overflow():
    """The forward pass never sees the loss scale, so no scale cures an inf a model probe
    read: a step whose scaled gradients overflow with it is an incident at once, not one of
    the up to ``2 * OVERFLOW_GRACE`` overflows that halve the scale first."""
    state = TrainState.create(_Fp16Probed(rngs=nnx.Rngs(0)), optax.adam(1e-3))
    step = make_train_step(loss_fn)
    x, y = _data(1)
    _, m = step(state, (x[0], y[0]))
    assert bool(m["finite"]) and not bool(m["incident"])
    _, m = step(state, (x[0] * 2e4, y[0]))
    assert np.isfinite(float(m["loss"])) and not np.isfinite(float(m["grad_norm"]))
    assert float(m["probes"]["lin.probe_output"][detector.NONFINITE]) > 0
    assert bool(m["incident"]) and not bool(m["overflow"]) and bool(m["skipped"])
    assert int(m["next_gear"]) == Gear.STABLE


def test_a_probe_that_reads_an_inf_in_a_batch_with_a_minus_inf_mask_is_polluted():
    """A ``-inf`` mask fill is data when the step goes non-finite with it, the loss *or* a
    model probe: the batch that overflows the norm's statistics carries a mask, so it is
    skipped as polluted (the gears untouched, no incident); the same mask with usable rows
    trains."""
    state = TrainState.create(_BF16Norm(rngs=nnx.Rngs(0)), optax.adam(1e-3))
    step = make_train_step(_masked_loss)
    x, y = _data(1)
    bias = jnp.zeros(x.shape[1]).at[:2].set(-jnp.inf)
    state, m = step(state, (x[0], y[0], bias))
    assert not bool(m["polluted"]) and not bool(m["skipped"]) and bool(m["finite"])
    big = (x[0] - x[0].mean(-1, keepdims=True)) * 3e19
    new, m = step(state, (big, y[0], bias))
    assert np.isfinite(float(m["loss"]))
    assert bool(m["polluted"]) and bool(m["skipped"]) and not bool(m["incident"])
    assert int(new.gear.level) == Gear.FAST and int(m["next_gear"]) == Gear.FAST
    np.testing.assert_array_equal(new.params["ln"]["scale"], state.params["ln"]["scale"])
