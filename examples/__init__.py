"""Runnable examples built on nan2safe_jax (the demo transformer lives in transformer.py)."""
