"""The public surface: every name in __all__ resolves, old module paths alias the new homes."""

import importlib
import inspect
import types
from pathlib import Path

import nan2safe_jax as nan2safe


def test_every_name_in_all_imports():
    assert len(set(nan2safe.__all__)) == len(nan2safe.__all__)
    for name in nan2safe.__all__:
        obj = vars(nan2safe)[name]  # bound in the package itself, not found by a fallback
        if isinstance(obj, types.ModuleType):
            assert obj.__name__ == f"nan2safe_jax.{name}", name  # the submodule of that name
        else:
            assert inspect.isclass(obj) or inspect.isfunction(obj), name
            assert obj.__name__ == name and obj.__module__.startswith("nan2safe_jax."), name


def test_old_module_paths_are_aliases_of_the_new_homes():
    from nan2safe_jax import checkpoint, detector, numerics, ops, optax, probe, report, runlog

    assert (ops.FAST, ops.STABLE, ops.SAFE) == (
        nan2safe.Gear.FAST,
        nan2safe.Gear.STABLE,
        nan2safe.Gear.SAFE,
    )
    assert all(isinstance(g, nan2safe.Gear) for g in (ops.FAST, ops.STABLE, ops.SAFE))
    assert ops._stats is probe.op_stats
    assert detector.stats is probe.stats and detector.STATS is probe.STATS
    assert optax.all_finite is numerics.all_finite and optax.MAX_I32 == numerics.MAX_I32
    assert checkpoint.tree_is_finite is numerics.tree_is_finite
    for name in runlog.__all__:
        if name != "to_jsonable":
            assert getattr(report, name) is getattr(runlog, name), name
    assert report._figure.__module__ == "nan2safe_jax.runlog.dashboard"


def test_kernels_path_is_the_import_path():
    kernels = importlib.import_module("nan2safe_jax.kernels")
    assert Path(kernels.__file__).parent == Path(nan2safe.__file__).parent / "kernels"


def test_design_contract_names():
    assert (nan2safe.Gear.FAST, nan2safe.Gear.STABLE, nan2safe.Gear.SAFE) == (0, 1, 2)
    for fn in ("softmax", "attention", "layer_norm", "rms_norm", "cross_entropy"):
        assert callable(getattr(nan2safe.ops, fn))
    for mod in ("Linear", "Embed", "LayerNorm", "RMSNorm", "MultiHeadAttention", "Router"):
        assert isinstance(getattr(nan2safe.nn, mod), type)
    assert callable(nan2safe.optax.guard)
    assert callable(nan2safe.TrainState.create)
    assert callable(nan2safe.make_train_step)
    assert callable(nan2safe.Trainer.fit)
    assert callable(nan2safe.replay.locate) and callable(nan2safe.replay.locate_step)


def test_kernels_are_installed_under_the_package():
    kernels = importlib.import_module("nan2safe_jax.kernels")
    for fn in ("safe_sum", "safe_mean", "safe_softmax", "safe_layer_norm", "safe_rms_norm"):
        assert callable(getattr(kernels, fn))


def test_cli_parses():
    from nan2safe_jax import cli

    assert callable(cli.main)


def test_adoption_names():
    """issue #16: adopting an existing flax.nnx model."""
    from nan2safe_jax import convert, user_site
    from nan2safe_jax.replay import nearest

    assert nan2safe.nn.convert is convert.convert and callable(nan2safe.nn.convert)
    assert nan2safe.nn.Site is user_site.Site and isinstance(nan2safe.nn.Site, type)
    assert nan2safe.nn.ConvertReport is convert.ConvertReport
    for name in ("convert", "Site", "ConvertReport"):
        assert name in nan2safe.nn.__all__
    assert callable(nearest.nearest_site) and callable(nearest.nearest_site_in_jaxpr)
