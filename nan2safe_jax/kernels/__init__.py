"""Safe reductions for the SAFE gear: Pallas kernels beside pure-jnp references.

One folder per op family (``safe_reduce``, ``softmax``,
``norms``), each with ``api.py`` (dispatch), ``reference.py`` (pure jnp, the XLA fallback)
and ``pallas.py`` (the kernels). Every entry point takes ``implementation=None | "pallas" |
"reference"`` and ``with_count`` (also return the int32 number of non-finite inputs seen).
See nan2safe_jax/kernels/README.md for the design and what is verified where.
"""

from nan2safe_jax.kernels.norms import safe_layer_norm, safe_rms_norm
from nan2safe_jax.kernels.safe_reduce import safe_mean, safe_sum
from nan2safe_jax.kernels.softmax import safe_softmax

__all__ = ["safe_layer_norm", "safe_mean", "safe_rms_norm", "safe_softmax", "safe_sum"]
