"""Checkpointer: finite states only; newest complete, finite checkpoint wins on restore."""

import os
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from tiny_models import Net, data, loss_fn

from nan2safe_jax import Gear, TrainState, make_train_step
from nan2safe_jax import gear as G
from nan2safe_jax.checkpoint import Checkpointer, CheckpointMismatchError, tree_is_finite


def _trained(steps=3, seed=0):
    state = TrainState.create(Net(rngs=nnx.Rngs(seed)), optax.adam(1e-3))
    step = make_train_step(loss_fn)
    x, y = data(steps)
    for i in range(steps):
        state, _ = step(state, (x[i], y[i]))
    return state


def _equal(a, b):
    la, lb = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb, strict=True):
        np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32))


@pytest.fixture(scope="module")
def trained():
    state = _trained()
    return state.replace(gear=G.set_site(state.gear, "blocks.1", Gear.SAFE))


def test_round_trip_keeps_params_gears_and_baselines(tmp_path, trained):
    ck = Checkpointer(tmp_path / "ck")
    assert ck.save(3, trained)
    fresh = TrainState.create(Net(rngs=nnx.Rngs(1)), optax.adam(1e-3))
    restored, step = ck.restore_latest(fresh)
    assert step == 3
    _equal(restored, trained)
    assert int(restored.gear.sites["blocks.1"]) == Gear.SAFE


@pytest.mark.parametrize("version", ["site variables in rest", "and one array per site"])
def test_a_checkpoint_of_an_earlier_layout_restores_into_todays(tmp_path, trained, version):
    """Checkpoints written before ``site.SiteTemplate`` held the sites' gear and probe
    variables in ``rest``, and before ``gear.SiteValues`` also the gears' per-site fields as
    one array per site (dicts, flattened in sorted name order): they restore, gears and all,
    into today's state instead of being skipped as corrupt."""
    from nan2safe_jax.checkpoint import _per_site_dicts, _with_site_variables

    old = _with_site_variables(trained)
    if version == "and one array per site":
        old = _per_site_dicts(old)
    assert len(jax.tree_util.tree_leaves(old)) > len(jax.tree_util.tree_leaves(trained))
    ck = Checkpointer(tmp_path / "ck")
    assert ck.save(3, old)
    fresh = TrainState.create(Net(rngs=nnx.Rngs(1)), optax.adam(1e-3))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # not skipped with a warning
        restored, step = ck.restore_latest(fresh)
    assert step == 3
    assert isinstance(restored.gear.sites, G.SiteValues)
    assert list(restored.gear.sites) == list(trained.gear.sites)
    _equal(restored, trained)
    assert int(restored.gear.sites["blocks.1"]) == Gear.SAFE


def test_nonfinite_state_is_never_written(tmp_path, trained):
    ck = Checkpointer(tmp_path / "ck", async_save=False)
    assert ck.save(3, trained)
    bad = trained.replace(
        params=jax.tree_util.tree_map(lambda p: p.at[(0,) * p.ndim].set(jnp.nan), trained.params)
    )
    assert not tree_is_finite(bad)
    assert not ck.save(6, bad)  # host check
    assert not ck.save(6, trained, finite=False)  # the step's own verdict
    assert ck.steps() == [3]


def test_corrupt_checkpoint_is_skipped_with_a_warning(tmp_path, trained):
    ck = Checkpointer(tmp_path / "ck", async_save=False)
    ck.save(3, trained)
    later = trained.replace(step=trained.step + 3)
    ck.save(6, later)
    for root, _, files in os.walk(ck.path(6)):
        for f in files:
            open(os.path.join(root, f), "w").close()  # truncate every file
    with pytest.warns(UserWarning, match="incomplete or corrupt"):
        restored, step = Checkpointer(tmp_path / "ck").restore_latest(trained)
    assert step == 3
    _equal(restored, trained)


def test_a_checkpoint_of_a_changed_model_raises_and_is_left_as_it_is(tmp_path, trained):
    """A model whose head grew is not a corrupt checkpoint: skipping it would start the run
    again, and its saves would replace the old run's checkpoints. An error names the array."""
    ck = Checkpointer(tmp_path / "ck", async_save=False)
    ck.save(3, trained)
    ck.save(6, trained.replace(step=trained.step + 3))
    ck.close()
    wider = Net(rngs=nnx.Rngs(0))
    wider.head = nnx.Linear(wider.head.in_features, 2, rngs=nnx.Rngs(1))
    other = TrainState.create(wider, optax.adam(1e-3))
    ck = Checkpointer(tmp_path / "ck", async_save=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # not a "corrupt, skipped" warning either
        said = r"different model: .*head.*\(1,\) there, \(2,\) here"
        with pytest.raises(CheckpointMismatchError, match=said):
            ck.restore_latest(other)
    assert isinstance(CheckpointMismatchError("x"), ValueError)
    assert ck.steps() == [3, 6]
    restored, step = ck.restore_latest(trained)  # the run's own model still resumes
    assert step == 6


@pytest.mark.parametrize("stray", ["empty_step_folder", "step_without_its_item"])
def test_a_stray_step_folder_hides_no_good_checkpoint(tmp_path, trained, stray):
    """orbax infers single or multi item from the first step folder it reads; one stray folder
    must not make the good checkpoints unreadable, nor the next save fail."""
    ck = Checkpointer(tmp_path / "ck", async_save=False)
    ck.save(3, trained)
    ck.save(6, trained.replace(step=trained.step + 3))
    ck.close()
    if stray == "empty_step_folder":
        (tmp_path / "ck" / "9").mkdir()
        want = 6
    else:
        import shutil

        shutil.rmtree(tmp_path / "ck" / "6" / "default")
        want = 3
    ck = Checkpointer(tmp_path / "ck", async_save=False, max_to_keep=5)
    with pytest.warns(UserWarning, match="incomplete or corrupt"):
        _, step = ck.restore_latest(trained)
    assert step == want
    assert ck.save(12, trained.replace(step=trained.step + 9))
    assert ck.restore_latest(trained)[1] == 12


def test_restore_before_a_step(tmp_path, trained):
    ck = Checkpointer(tmp_path / "ck", async_save=False)
    ck.save(3, trained)
    ck.save(6, trained.replace(step=trained.step + 3))
    _, step = ck.restore_latest(trained, before=5)
    assert step == 3
    assert ck.restore_latest(trained, before=2) is None


def test_probe_name_files_follow_orbax_retention(tmp_path, trained):
    """``max_to_keep`` deletes old checkpoints; their probe-name files go too."""
    ck = Checkpointer(tmp_path / "ck", max_to_keep=2, async_save=False)
    for step in (2, 4, 6, 8):
        ck.save(step, trained)
    assert ck.steps() == [6, 8]
    names = sorted(int(f.stem) for f in (tmp_path / "ck_probes").glob("*.json"))
    assert names == [6, 8]
    _, step = ck.restore_latest(trained)
    assert step == 8


def test_state_is_finite_matches_the_host_check_in_one_process(trained):
    from nan2safe_jax.checkpoint import state_is_finite

    assert state_is_finite(trained)
    bad = trained.replace(
        params=jax.tree_util.tree_map(lambda p: p.at[(0,) * p.ndim].set(jnp.inf), trained.params)
    )
    assert not state_is_finite(bad)
    assert not state_is_finite({"a": np.array([1.0, np.nan]), "n": np.arange(3)})
    assert state_is_finite({"a": np.array([1.0, 2.0]), "n": np.arange(3)})


class _Stock(nnx.Module):
    """A stock flax.nnx model: no sites, so the gears' per-site arrays have zero size."""

    def __init__(self, rngs):
        self.fc = nnx.Linear(4, 2, rngs=rngs)

    def __call__(self, x):
        return self.fc(x)


@pytest.mark.parametrize("written", ["today", "before SiteValues"])
def test_a_model_without_sites_saves_and_restores_its_empty_gear_arrays(tmp_path, written):
    """orbax refuses zero-size arrays: the siteless state's empty per-site gear values are left
    out of the checkpoint and taken back from the template (the Trainer's first checkpoint of a
    stock flax model raised 'Cannot save arrays with zero size'). A checkpoint written before
    ``gear.SiteValues`` (empty per-site dicts: no arrays at all) still restores: the kept
    arrays are numbered among themselves, as it numbered them (review: a gap in the keys made
    orbax refuse it, and the run started over)."""
    from nan2safe_jax.checkpoint import _per_site_dicts, _with_site_variables

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the model has no sites, on purpose
        state = TrainState.create(_Stock(nnx.Rngs(0)), optax.adam(1e-2))
        fresh = TrainState.create(_Stock(nnx.Rngs(1)), optax.adam(1e-2))
    step = make_train_step(lambda m, b: jnp.mean((m(b[0]) - b[1]) ** 2))
    x, y = jnp.ones((3, 4)), jnp.zeros((3, 2))
    state, _ = step(state, (x, y))
    assert any(np.size(v) == 0 for v in jax.tree_util.tree_leaves(state))
    ck = Checkpointer(tmp_path / "ck", async_save=False)
    if written == "today":
        assert ck.save(1, state)
    else:
        old = _per_site_dicts(_with_site_variables(state))
        assert old is not None and not any(np.size(v) == 0 for v in jax.tree_util.tree_leaves(old))
        assert ck.save(1, old)
    restored, at = ck.restore_latest(fresh)
    assert at == 1
    _equal(restored, state)


class _Two(nnx.Module):
    """Two layers of one shape: restored by position alone, a rename swaps their weights."""

    def __init__(self, first="a", second="b", seed=0):
        rngs = nnx.Rngs(seed)
        setattr(self, first, nnx.Linear(4, 4, rngs=rngs))
        setattr(self, second, nnx.Linear(4, 4, rngs=rngs))
        self.order = (first, second)

    def __call__(self, x):
        return getattr(self, self.order[1])(getattr(self, self.order[0])(x))


@pytest.mark.parametrize("change", ["renamed layer", "optimizer", "no names kept"])
def test_a_state_whose_arrays_are_named_otherwise_is_refused_naming_the_first(tmp_path, change):
    """A checkpoint keeps its arrays' names: a layer renamed to another of the same shapes (by
    position, ``a``'s weights went to ``c``'s place and the others moved: the loss jumped from
    4.8 to 7.8, silently) or another optimizer is refused naming the first array that
    differs, and the checkpoint is kept; one written without names restores by position."""
    ck = Checkpointer(tmp_path / "ck")
    saved = TrainState.create(_Two(), optax.adam(1e-3))
    assert ck.save(1, saved)
    if change == "renamed layer":
        like = TrainState.create(_Two("c", "b", seed=1), optax.adam(1e-3))
        with pytest.raises(CheckpointMismatchError, match=r"array 0 is .params\['a'\]"):
            ck.restore_latest(like)
    elif change == "optimizer":
        like = TrainState.create(_Two(seed=1), optax.sgd(1e-3))
        with pytest.raises(CheckpointMismatchError, match=r"there, .* here|only (here|there)"):
            ck.restore_latest(like)
    else:
        for f in (tmp_path / "ck_paths").iterdir():
            f.unlink()
        restored, _ = ck.restore_latest(TrainState.create(_Two(seed=1), optax.adam(1e-3)))
        _equal(restored, saved)
    assert ck.steps() == [1]
