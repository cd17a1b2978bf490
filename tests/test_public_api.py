"""The public surface: every name in __all__ imports, and DESIGN.md's entry points exist."""

import importlib

import nan2safe_jax as nan2safe


def test_every_name_in_all_imports():
    for name in nan2safe.__all__:
        assert getattr(nan2safe, name) is not None, name


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
