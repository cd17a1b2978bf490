"""Safe layer norm and RMS norm: Pallas kernels beside their jnp references."""

from nan2safe_jax.kernels.norms.api import safe_layer_norm, safe_rms_norm

__all__ = ["safe_layer_norm", "safe_rms_norm"]
