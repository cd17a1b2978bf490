"""Pallas safe-reduction kernels (installed as nan2safe_jax.kernels)."""
