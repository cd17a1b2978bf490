"""Compensated (Neumaier) sums and means: Pallas kernel beside its jnp reference."""

from nan2safe_jax.kernels.safe_reduce.api import safe_mean, safe_sum

__all__ = ["safe_mean", "safe_sum"]
