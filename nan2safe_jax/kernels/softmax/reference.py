"""Pure-jnp safe softmax: the XLA fallback and the oracle of the Pallas kernel.

Written so that its own autodiff is finite wherever its output is finite (double-where on the
exp argument, stop-gradient on the row max), for the "differentiate the reference" fallback.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from nan2safe_jax.kernels import _common


@functools.partial(jax.jit, static_argnames=("acc",))
def softmax_rows(
    x2d: jax.Array, mask2d: jax.Array | None, acc: jnp.dtype
) -> tuple[jax.Array, jax.Array]:
    """Safe softmax over the rows of ``x2d`` in ``acc``; returns ``(y[acc], counts[rows])``.

    Semantics (shared with the kernel):
      * entries with ``mask2d == False`` are ignored (probability 0, never read as NaN);
      * a row with no unmasked entry, or only -inf ones, gives zeros;
      * +inf entries share the row's mass equally (the limit of softmax), the rest get 0;
      * an unmasked NaN makes its row NaN (propagated, never created) and is counted;
      * otherwise the row max is subtracted, exp() <= 1, and the denominator (>= 1) is a
        compensated sum.
    ``counts`` = number of unmasked non-finite inputs per row (int32).
    """
    x = x2d.astype(acc)
    valid = jnp.ones(x.shape, bool) if mask2d is None else mask2d.astype(bool)
    isnan = jnp.isnan(x)
    counts = jnp.sum(valid & ~jnp.isfinite(x), axis=-1, dtype=jnp.int32)
    has_nan = jnp.any(valid & isnan, axis=-1, keepdims=True)
    use = valid & ~isnan
    m = lax.stop_gradient(jnp.max(jnp.where(use, x, -jnp.inf), axis=-1, keepdims=True))
    inf_row = m == jnp.inf
    m_safe = jnp.where(jnp.isfinite(m), m, 0)
    arg = jnp.where(use & ~inf_row, x, m_safe)  # finite or -inf: exp() <= 1, grads finite
    e = jnp.where(inf_row, (x == jnp.inf).astype(acc), jnp.exp(arg - m_safe))
    e = jnp.where(use, e, 0)
    denom = _common.tree_sum(e)[..., None]
    ok = denom > 0
    y = jnp.where(ok, e / jnp.where(ok, denom, 1), 0)
    return jnp.where(has_nan, jnp.nan, y), counts
