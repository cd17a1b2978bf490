"""NaN-free softmax: Pallas kernel beside its jnp reference."""

from nan2safe_jax.kernels.softmax.api import safe_softmax

__all__ = ["safe_softmax"]
