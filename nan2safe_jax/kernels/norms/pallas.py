"""Pallas kernels: safe layer norm and RMS norm over row tiles.

A grid step owns ``block_rows`` whole rows and walks them ``lanes`` columns at a time
(``lax.fori_loop``): pass 1 max |x| over finite entries (for the power-of-two range
compression) and the non-finite count; pass 2 the compensated sum of x (layer norm) or x**2
(RMS norm); pass 3 (layer norm) the compensated sums of d and d**2, d = x - mean, in one loop
(corrected two-pass variance); last pass
normalise, apply scale/bias and store (cast on store). Each compensated sum is a
``(block_rows, lanes)`` Neumaier accumulator closed by a TwoSum lane tree. Semantics are those
of ``reference.py``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from nan2safe_jax.kernels import _common
from nan2safe_jax.kernels.norms import reference


def _norm_kernel(
    *refs, kind: str, has_scale: bool, has_bias: bool, lanes: int, n_cols: int, eps: float, acc
):
    refs = list(refs)
    x_ref = refs.pop(0)
    scale_ref = refs.pop(0) if has_scale else None
    bias_ref = refs.pop(0) if has_bias else None
    o_ref, n_ref = refs
    bm, bn = x_ref.shape
    nk = bn // lanes
    zeros = jnp.zeros((bm, lanes), acc)

    def load(k):
        start = pl.multiple_of(k * lanes, lanes)
        v = x_ref[:, pl.ds(start, lanes)].astype(acc)
        valid = start + lax.broadcasted_iota(jnp.int32, (bm, lanes), 1) < n_cols
        fin = _common.isfinite(v)
        return start, jnp.where(valid & fin, v, 0.0).astype(acc), valid, fin

    def pass1(k, carry):
        amax, nbad = carry
        _, v, valid, fin = load(k)
        nbad = nbad + jnp.where(valid & ~fin, 1, 0).astype(jnp.int32)
        return jnp.maximum(amax, jnp.abs(v)), nbad

    amax, nbad = lax.fori_loop(0, nk, pass1, (zeros, jnp.zeros((bm, lanes), jnp.int32)))
    sc = _common.pow2_scale(jnp.max(amax, axis=-1, keepdims=True))
    bad = jnp.sum(nbad, axis=-1, keepdims=True)
    eps_s = reference.eps_scaled(eps, sc)

    def csums(*terms):
        """Compensated row means of ``term(x * sc)`` for each term, in one pass."""

        def body(k, carry):
            _, v, valid, _ = load(k)
            xs = v * sc
            out = []
            for (s, c), term in zip(carry, terms, strict=True):
                out.append(_common.neumaier_add(s, c, jnp.where(valid, term(xs), 0.0).astype(acc)))
            return tuple(out)

        acc_sc = lax.fori_loop(0, nk, body, tuple((zeros, zeros) for _ in terms))
        means = []
        for s, c in acc_sc:
            s, c = _common.lane_combine(s, c)
            means.append((s + c) / n_cols)
        return means

    if kind == "layer":
        (mean,) = csums(lambda xs: xs)
        sd, sdd = csums(lambda xs: xs - mean, lambda xs: (xs - mean) * (xs - mean))
        inv = reference.inv_std(jnp.maximum(sdd - sd * sd, 0.0) + eps_s, eps, sc)
    else:
        (ms,) = csums(lambda xs: xs * xs)
        inv = reference.inv_std(ms + eps_s, eps, sc)

    def store(k, carry):
        start, v, _, _ = load(k)
        xs = v * sc
        y = ((xs - mean) - sd) * inv if kind == "layer" else xs * inv
        if scale_ref is not None:
            y = y * scale_ref[:, pl.ds(start, lanes)].astype(acc)
        if bias_ref is not None:
            y = y + bias_ref[:, pl.ds(start, lanes)].astype(acc)
        y = jnp.where(bad > 0, jnp.nan, y)
        o_ref[:, pl.ds(start, lanes)] = y.astype(o_ref.dtype)
        return carry

    lax.fori_loop(0, nk, store, 0)
    n_ref[...] = bad


@functools.partial(
    jax.jit,
    static_argnames=("kind", "eps", "acc", "out_dtype", "interpret", "block_rows", "lanes"),
)
def norm_rows(
    x2d: jax.Array,
    scale: jax.Array | None,
    bias: jax.Array | None,
    *,
    kind: str,
    eps: float,
    acc: jnp.dtype,
    out_dtype: jnp.dtype,
    interpret: bool,
    block_rows: int | None = None,
    lanes: int | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Safe layer norm (``kind="layer"``) or RMS norm (``"rms"``) of the rows of ``x2d``;
    ``scale``/``bias`` are ``[cols]`` or None. Returns ``(y[out_dtype], counts[rows])``."""
    if kind not in ("layer", "rms"):
        raise ValueError(f"kind must be 'layer' or 'rms', got {kind!r}")
    rows, cols = x2d.shape
    bm, lanes, cols_pad, rows_pad = _common.row_blocks(rows, cols, interpret, block_rows, lanes)
    args = [_common.pad2d(x2d, rows_pad, cols_pad)]
    in_specs = [pl.BlockSpec((bm, cols_pad), lambda i: (i, 0))]
    for p in (scale, bias):
        if p is not None:
            args.append(_common.pad2d(p.reshape(1, cols), 1, cols_pad))
            in_specs.append(pl.BlockSpec((1, cols_pad), lambda i: (0, 0)))
    kernel = functools.partial(
        _norm_kernel,
        kind=kind,
        has_scale=scale is not None,
        has_bias=bias is not None,
        lanes=lanes,
        n_cols=cols,
        eps=float(eps),
        acc=acc,
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
        name=f"nan2safe_safe_{kind}_norm",
    )
    return y[:rows, :cols], n[:rows, 0]
