"""Pallas kernel: blocked Neumaier row sums.

Layout: the reduction is a row reduction over ``x2d[rows, cols]``; each grid step ``(i, j)``
owns a ``(block_rows, block_cols)`` tile and walks it in ``lanes``-wide chunks with
``lax.fori_loop``, keeping a ``(block_rows, lanes)`` vector accumulator ``s`` and its
compensation ``c`` (Neumaier's update, elementwise). At the end of the tile the lanes are
combined by a TwoSum tree (``_common.lane_combine``), and the tile writes one ``(s, c, count)``
triple per row. The wrapper combines the tiles of a row with a second compensated tree in jnp.

A sequential compensated loop over single elements would be hopeless (and in interpret mode,
one XLA while-loop step per element); the vector accumulator keeps the loop count at
``block_cols / lanes`` per tile.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from nan2safe_jax.kernels import _common


def default_blocks(interpret: bool) -> dict[str, int]:
    """Tile sizes. Interpret mode: few, huge tiles (each grid step and loop step is an XLA
    while-loop iteration on the host). Compiled (GPU): 8 x 4096 tiles walked 128 lanes at a
    time -> 8 fp32 values per thread per chunk with 4 warps."""
    if interpret:
        return dict(block_rows=8, block_cols=131072, lanes=1024)
    return dict(block_rows=8, block_cols=4096, lanes=128)


def _sum_kernel(x_ref, s_ref, c_ref, n_ref, *, lanes: int, acc: jnp.dtype):
    bm, bn = x_ref.shape
    zeros = jnp.zeros((bm, lanes), acc)

    def body(k, carry):
        s, c, n = carry
        start = pl.multiple_of(k * lanes, lanes)
        v = x_ref[:, pl.ds(start, lanes)].astype(acc)
        s, c = _common.neumaier_add(s, c, v)
        n = n + jnp.where(_common.isfinite(v), 0, 1).astype(jnp.int32)
        return s, c, n

    s, c, n = lax.fori_loop(0, bn // lanes, body, (zeros, zeros, jnp.zeros((bm, lanes), jnp.int32)))
    s, c = _common.lane_combine(s, c)
    s_ref[...] = s
    c_ref[...] = c
    n_ref[...] = jnp.sum(n, axis=-1, keepdims=True)


@functools.partial(
    jax.jit, static_argnames=("acc", "interpret", "block_rows", "block_cols", "lanes")
)
def sum_rows(
    x2d: jax.Array,
    *,
    acc: jnp.dtype,
    interpret: bool,
    block_rows: int | None = None,
    block_cols: int | None = None,
    lanes: int | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Compensated row sums of ``x2d[rows, cols]`` (in ``acc``) and int32 non-finite counts.

    Same semantics as ``reference.sum_rows``. Rows that are few and long are split into
    sub-rows (so that a 1-row sum still fills a tile); padding is zeros (the identity).
    """
    d = default_blocks(interpret)
    bm = block_rows or d["block_rows"]
    bn_max = block_cols or d["block_cols"]
    lanes = lanes or d["lanes"]
    rows, cols = x2d.shape
    if rows == 0:
        return jnp.zeros((0,), acc), jnp.zeros((0,), jnp.int32)
    cols = max(cols, 1)
    # Split few long rows into `split` sub-rows.
    split = 1
    while rows * split < bm and cols >= 2 * split * lanes:
        split *= 2
    sub = -(-cols // split)
    bn = min(bn_max, max(_common.next_pow2(sub), 1))
    lanes = min(lanes, bn)
    sub = _common.round_up(sub, bn)
    xp = x2d
    if split * sub != x2d.shape[1]:
        xp = jnp.pad(xp, ((0, 0), (0, split * sub - x2d.shape[1])))
    xp = xp.reshape(rows * split, sub)
    bm = min(bm, _common.next_pow2(rows * split))
    r_pad = _common.round_up(rows * split, bm)
    if r_pad != rows * split:
        xp = jnp.pad(xp, ((0, r_pad - rows * split), (0, 0)))
    grid = (r_pad // bm, sub // bn)
    part = jax.ShapeDtypeStruct((r_pad, grid[1]), acc)
    out_spec = pl.BlockSpec((bm, 1), lambda i, j: (i, j))
    s, c, n = pl.pallas_call(
        functools.partial(_sum_kernel, lanes=lanes, acc=acc),
        out_shape=(part, part, jax.ShapeDtypeStruct((r_pad, grid[1]), jnp.int32)),
        grid=grid,
        in_specs=[pl.BlockSpec((bm, bn), lambda i, j: (i, j))],
        out_specs=(out_spec, out_spec, out_spec),
        interpret=interpret,
        compiler_params=_common.compiler_params(interpret),
        name="nan2safe_safe_sum",
    )(xp)
    s = s[: rows * split].reshape(rows, -1)
    c = c[: rows * split].reshape(rows, -1)
    n = n[: rows * split].reshape(rows, -1)
    return _common.tree_sum(s, c), jnp.sum(n, axis=-1, dtype=jnp.int32)
