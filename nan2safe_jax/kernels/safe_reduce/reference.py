"""Pure-jnp safe sum / mean: the XLA fallback and the oracle the Pallas kernels are tested on.

The compensated sum is a pairwise TwoSum tree over the reduced axis: every level adds halves
with an exact error term, and the errors are summed alongside (cascaded summation). It is
vectorised (``log2(n)`` fused elementwise levels), so it is the fast path on CPU too.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from nan2safe_jax.kernels import _common


@functools.partial(jax.jit, static_argnames=("acc",))
def sum_rows(x2d: jax.Array, acc: jnp.dtype) -> tuple[jax.Array, jax.Array]:
    """Compensated row sums of ``x2d[rows, cols]`` in ``acc``; and non-finite counts per row.

    IEEE semantics for non-finite inputs: a NaN gives NaN, +inf gives +inf, +inf and -inf
    together give NaN (the exact sum is undefined). Counts are int32.
    """
    xs = x2d.astype(acc)
    counts = jnp.sum(~jnp.isfinite(xs), axis=-1, dtype=jnp.int32)
    if xs.shape[-1] == 0:
        return jnp.zeros(xs.shape[:1], acc), counts
    # Non-finite values propagate through the tree's plain adds (IEEE); only the error terms
    # of non-finite partial sums are dropped (set to 0), so no NaN is made from an inf.
    return _common.tree_sum(xs), counts
