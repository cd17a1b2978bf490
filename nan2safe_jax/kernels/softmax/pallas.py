"""Pallas kernel: safe softmax, three passes over each row tile.

A grid step owns ``block_rows`` whole rows and walks them ``lanes`` columns at a time:
pass 1 row max over unmasked non-NaN entries (and NaN / non-finite counts), pass 2 the
Neumaier-compensated denominator in a ``(block_rows, lanes)`` vector accumulator, combined by
a TwoSum lane tree, pass 3 normalise and store (cast to the output dtype on store). The
semantics are those of ``reference.softmax_rows``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from nan2safe_jax.kernels import _common


def _softmax_kernel(*refs, lanes: int, n_cols: int, acc: jnp.dtype, has_mask: bool):
    if has_mask:
        x_ref, mask_ref, o_ref, n_ref = refs
    else:
        x_ref, o_ref, n_ref = refs
        mask_ref = None
    bm, bn = x_ref.shape
    nk = bn // lanes

    def load(k):
        start = pl.multiple_of(k * lanes, lanes)
        v = x_ref[:, pl.ds(start, lanes)].astype(acc)
        valid = start + lax.broadcasted_iota(jnp.int32, (bm, lanes), 1) < n_cols
        if mask_ref is not None:
            valid = valid & (mask_ref[:, pl.ds(start, lanes)] != 0)
        return start, v, valid

    def pass1(k, carry):
        vmax, nnan, nbad = carry
        _, v, valid = load(k)
        isnan = jnp.isnan(v)
        vmax = jnp.maximum(vmax, jnp.where(valid & ~isnan, v, -jnp.inf))
        nnan = nnan + jnp.where(valid & isnan, 1, 0).astype(jnp.int32)
        nbad = nbad + jnp.where(valid & ~_common.isfinite(v), 1, 0).astype(jnp.int32)
        return vmax, nnan, nbad

    izeros = jnp.zeros((bm, lanes), jnp.int32)
    vmax, nnan, nbad = lax.fori_loop(
        0, nk, pass1, (jnp.full((bm, lanes), -jnp.inf, acc), izeros, izeros)
    )
    m = jnp.max(vmax, axis=-1, keepdims=True)
    has_nan = jnp.sum(nnan, axis=-1, keepdims=True) > 0
    inf_row = m == jnp.inf
    m_safe = jnp.where(_common.isfinite(m), m, 0.0).astype(acc)

    def exps(v, valid):
        use = valid & ~jnp.isnan(v)
        arg = jnp.where(use & ~inf_row, v, m_safe)
        e = jnp.where(inf_row, jnp.where(v == jnp.inf, 1.0, 0.0).astype(acc), jnp.exp(arg - m_safe))
        return jnp.where(use, e, 0.0).astype(acc)

    def pass2(k, carry):
        s, c = carry
        _, v, valid = load(k)
        return _common.neumaier_add(s, c, exps(v, valid))

    zeros = jnp.zeros((bm, lanes), acc)
    s, c = lax.fori_loop(0, nk, pass2, (zeros, zeros))
    s, c = _common.lane_combine(s, c)
    denom = s + c
    ok = denom > 0
    denom_safe = jnp.where(ok, denom, 1.0).astype(acc)

    def pass3(k, carry):
        start, v, valid = load(k)
        y = jnp.where(ok, exps(v, valid) / denom_safe, 0.0)
        y = jnp.where(has_nan, jnp.nan, y)
        o_ref[:, pl.ds(start, lanes)] = y.astype(o_ref.dtype)
        return carry

    lax.fori_loop(0, nk, pass3, 0)
    n_ref[...] = jnp.sum(nbad, axis=-1, keepdims=True)


@functools.partial(
    jax.jit, static_argnames=("acc", "out_dtype", "interpret", "block_rows", "lanes")
)
def softmax_rows(
    x2d: jax.Array,
    mask2d: jax.Array | None,
    *,
    acc: jnp.dtype,
    out_dtype: jnp.dtype,
    interpret: bool,
    block_rows: int | None = None,
    lanes: int | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Safe softmax of the rows of ``x2d`` -> ``(y[out_dtype], counts[rows] int32)``."""
    rows, cols = x2d.shape
    bm, lanes, cols_pad, rows_pad = _common.row_blocks(rows, cols, interpret, block_rows, lanes)
    xp = _common.pad2d(x2d, rows_pad, cols_pad)
    args = [xp]
    in_specs = [pl.BlockSpec((bm, cols_pad), lambda i: (i, 0))]
    if mask2d is not None:
        args.append(_common.pad2d(mask2d.astype(jnp.int8), rows_pad, cols_pad))
        in_specs.append(pl.BlockSpec((bm, cols_pad), lambda i: (i, 0)))
    kernel = functools.partial(
        _softmax_kernel, lanes=lanes, n_cols=cols, acc=acc, has_mask=mask2d is not None
    )
    y, n = _common.row_pallas_call(
        kernel,
        args,
        in_specs,
        rows_pad=rows_pad,
        cols_pad=cols_pad,
        bm=bm,
        out_dtype=out_dtype,
        interpret=interpret,
        name="nan2safe_safe_softmax",
    )
    return y[:rows, :cols], n[:rows, 0]
