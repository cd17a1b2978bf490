"""The old home of the Trainer: ``nan2safe_jax.trainer`` (kept so existing imports work)."""

from nan2safe_jax.trainer import (  # noqa: F401
    NanIncidentError,
    Trainer,
    load_factory,
    load_incident,
)

__all__ = ["NanIncidentError", "Trainer", "load_factory", "load_incident"]
