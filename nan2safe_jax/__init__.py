"""nan2safe-jax: keeps JAX/Flax training alive when numerics go bad.

Public surface (see DESIGN.md). ``import nan2safe_jax as nan2safe``.
"""

from nan2safe_jax.config import Config
from nan2safe_jax.gear import Gear, GearState

__all__ = ["Config", "Gear", "GearState"]
__version__ = "0.1.0"
