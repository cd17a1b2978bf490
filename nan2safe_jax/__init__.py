"""nan2safe-jax: keeps JAX/Flax training alive when numerics go bad.

Public surface (see docs/design.md, "Module map"). ``import nan2safe_jax as nan2safe``.
"""

from nan2safe_jax import (  # noqa: F401 - module access
    decode,
    detector,
    gear,
    incidents,
    nn,
    ops,
    optax,
    replay,
    sharding,
    site,
    supervisor,
    trainer,
)
from nan2safe_jax.config import Config
from nan2safe_jax.gear import Gear, GearState
from nan2safe_jax.site import Probe, SiteGear
from nan2safe_jax.train import TrainState, make_train_step
from nan2safe_jax.trainer import Trainer

__all__ = [
    "Config",
    "Gear",
    "GearState",
    "Probe",
    "SiteGear",
    "TrainState",
    "Trainer",
    "decode",
    "detector",
    "gear",
    "make_train_step",
    "nn",
    "ops",
    "optax",
    "replay",
    "sharding",
    "site",
]
__version__ = "0.1.0"
