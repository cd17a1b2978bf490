"""Placeholder; filled by the kernels work."""
