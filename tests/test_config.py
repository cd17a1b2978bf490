"""Config: defaults from docs/design.md, validation errors that name the field."""

import dataclasses

import pytest

from nan2safe_jax import Config


def test_defaults_match_spec():
    cfg = Config()
    assert cfg.window == 128
    assert cfg.z_threshold == 5.0
    assert cfg.diff_threshold == 3.0
    assert cfg.loss_scale_downshift == 1 / 256
    assert cfg.clip_downshift == 0.5
    assert cfg.safe_lr_factor == 0.1
    assert cfg.safe_max_steps == 8
    assert cfg.recovery_window == 64
    assert cfg.ring_buffer is None and cfg.ring_size == cfg.checkpoint_every
    assert cfg.headroom_limit == 0.5
    assert cfg.trigger_risk == 1.0
    assert 30 <= cfg.lr_cooldown <= 50
    assert cfg.alpha == pytest.approx(2 / 129)
    # Beyond SPEC's table: the calibration of tier 1 (issue 12). The thresholds above are
    # floors; the target rate and the headroom gate of the second difference decide.
    assert cfg.false_alarm_rate == 1e-3
    assert cfg.diff_headroom == 2.0**-8
    assert Config(false_alarm_rate=None).false_alarm_rate is None


def test_frozen_and_hashable():
    cfg = Config()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.window = 3
    assert hash(cfg) == hash(Config())
    assert cfg.replace(window=64).window == 64


@pytest.mark.parametrize(
    "field,value",
    [
        ("window", 1),
        ("window", 2.5),
        ("z_threshold", 0.0),
        ("z_threshold", float("nan")),
        ("diff_threshold", -1.0),
        ("min_history", 2),
        ("min_history", 2**30 + 1),
        ("false_alarm_rate", 0.0),
        ("false_alarm_rate", 0.5),
        ("false_alarm_rate", float("inf")),
        ("false_alarm_rate", "1e-3"),
        ("diff_headroom", -0.1),
        ("diff_headroom", 2.0),
        ("headroom_limit", 1.5),
        ("trigger_risk", 0.0),
        ("lr_cooldown", -1),
        ("loss_scale_init", 0.5),
        ("loss_scale_max", 0.1),
        ("loss_scale_factor", 1.0),
        ("loss_scale_downshift", 2.0),
        ("clip_norm", 0.0),
        ("clip_downshift", 0.0),
        ("safe_lr_factor", 1.5),
        ("safe_max_steps", 0),
        ("recovery_window", 0),
        ("ring_buffer", 0),
        ("checkpoint_every", True),
        ("max_incidents", 0),
        # The jitted step counts these in int32: past it, a value was accepted and then crashed
        # the step (OverflowError) or wrapped a SAFE stay negative.
        ("recovery_window", 2**31),
        ("lr_cooldown", 2**40),
        ("loss_scale_period", 2**31),
        ("safe_max_steps", 2**30),  # doubled safe_backoff_max (4) times
    ],
)
def test_invalid_value_names_the_field(field, value):
    with pytest.raises(ValueError, match=field) as info:
        Config(**{field: value})
    assert repr(value) in str(info.value)


def test_numpy_scalars_count_as_the_numbers_they_hold():
    """A value read from an array (``np.int64``, ``np.float32``) is accepted and stored as the
    Python number, so the Config hashes as the one written with literals; a float given for an
    int field, a numpy bool and a NaN are still refused by name."""
    np = pytest.importorskip("numpy")
    cfg = Config(window=np.int64(64), z_threshold=np.float32(4.5), safe_lr_factor=np.float64(0.1))
    assert type(cfg.window) is int and type(cfg.z_threshold) is float
    assert cfg == Config(window=64, z_threshold=4.5, safe_lr_factor=0.1)
    assert hash(cfg) == hash(Config(window=64, z_threshold=4.5, safe_lr_factor=0.1))
    for field, value in (
        ("window", np.float64(64)),
        ("window", np.bool_(True)),
        ("z_threshold", np.float32("nan")),
    ):
        with pytest.raises(ValueError, match=f"Config.{field}"):
            Config(**{field: value})


@pytest.mark.parametrize("make", ["Config", "replace"])
def test_an_unknown_field_is_a_value_error_naming_it(make):
    """A misspelt field raised Python's bare ``TypeError`` (unexpected keyword argument); a
    bad config is a ``ValueError`` naming the field, and this one says which field was meant.
    It stays a ``TypeError`` too, for code that caught that."""
    build = Config if make == "Config" else Config().replace
    with pytest.raises(ValueError, match="'windw'.*did you mean 'window'") as info:
        build(windw=3)
    assert isinstance(info.value, TypeError)
    assert build(window=3).window == 3
