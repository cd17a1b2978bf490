"""Public safe layer norm / RMS norm: dispatch between the Pallas kernels and the references."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from nan2safe_jax.kernels import _common
from nan2safe_jax.kernels.norms import pallas, reference
from nan2safe_jax.manual_axes import cotangents_like


def _forward(x, scale, bias, eps, kind, impl, interpret):
    acc = _common.acc_dtype()
    op = f"safe_{'layer' if kind == 'layer' else 'rms'}_norm"
    x2d = x.reshape(-1, x.shape[-1])
    if impl == "auto":
        fn = functools.partial(
            pallas.norm_rows, kind=kind, eps=eps, acc=acc, out_dtype=x.dtype, interpret=interpret
        )
        key = (x2d.shape, x2d.dtype, scale is None, bias is None, eps, acc, interpret)
        ok = _common.pallas_compiles(op, key, fn, x2d, scale, bias)
        impl = "pallas" if ok else "reference"
    if impl == "pallas":
        y2d, counts = pallas.norm_rows(
            x2d,
            scale,
            bias,
            kind=kind,
            eps=eps,
            acc=acc,
            out_dtype=x.dtype,
            interpret=interpret,
        )
    elif kind == "layer":
        y2d, counts = reference.layer_norm_rows(x2d, scale, bias, eps, acc)
    else:
        y2d, counts = reference.rms_norm_rows(x2d, scale, eps, acc)
    return y2d.astype(x.dtype).reshape(x.shape), jnp.sum(counts, dtype=jnp.int32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _safe_norm(x, scale, bias, eps, kind, impl, interpret):
    return _forward(x, scale, bias, eps, kind, impl, interpret)


def _fwd(x, scale, bias, eps, kind, impl, interpret):
    out = _forward(x, scale, bias, eps, kind, impl, interpret)
    return out, (x, scale, bias)


def _bwd(eps, kind, impl, interpret, res, cts):
    # Recomputes the normalised rows with the reference (compensated, range-compressed) and
    # applies the textbook backward in f32/f64. Degenerate rows (inv == 0) get dx = 0, which
    # is finite by construction (no division by the zero variance ever happens).
    del impl, interpret
    x, scale, bias = res
    g, _ = cts
    acc = _common.acc_dtype()
    x2d = x.reshape(-1, x.shape[-1])
    g2d = g.reshape(x2d.shape).astype(acc)
    stats = reference.layer_norm_stats if kind == "layer" else reference.rms_norm_stats
    xhat, inv, _ = stats(x2d, eps, acc)
    dxhat = g2d * scale.astype(acc) if scale is not None else g2d
    proj = jnp.mean(dxhat * xhat, axis=-1, keepdims=True)
    if kind == "layer":
        bracket = dxhat - jnp.mean(dxhat, axis=-1, keepdims=True) - xhat * proj
    else:
        bracket = dxhat - xhat * proj
    dx = jnp.where(inv > 0, inv * bracket, 0).astype(x.dtype).reshape(x.shape)
    dscale = None if scale is None else jnp.sum(g2d * xhat, axis=0).astype(scale.dtype)
    dbias = None if bias is None else jnp.sum(g2d, axis=0).astype(bias.dtype)
    return cotangents_like((dx, dscale, dbias), (x, scale, bias))


_safe_norm.defvjp(_fwd, _bwd)
# One executable per static configuration: eager calls dispatch once, jit callers inline it.
_safe_norm_jit = jax.jit(_safe_norm, static_argnums=(3, 4, 5, 6))


def _param(p, n: int, name: str, op: str) -> jax.Array | None:
    if p is None:
        return None
    p = jnp.asarray(p)
    _common.check_float(p, name, op)
    if p.ndim > 1 or p.shape not in ((n,), (1,), ()):
        raise ValueError(
            f"{op}: {name} must have shape ({n},) (the normalised axis), got {p.shape}"
        )
    return jnp.broadcast_to(p, (n,))


def _call(x, scale, bias, eps, kind, implementation, with_count):
    op = f"safe_{kind}_norm"
    x = jnp.asarray(x)
    _common.check_float(x, "x", op)
    if x.ndim == 0:
        raise ValueError(f"{op}: x must have rank >= 1 (the last axis is normalised)")
    if isinstance(eps, jax.Array) or not float(eps) >= 0:
        raise ValueError(f"{op}: eps must be a Python float >= 0, got {eps!r}")
    n = x.shape[-1]
    scale = _param(scale, n, "scale", op)
    bias = _param(bias, n, "bias", op)
    if x.size == 0:  # no row to normalise (an empty axis): nothing to compute
        return (x, jnp.zeros([], jnp.int32)) if with_count else x
    impl, interpret = _common.resolve(implementation, op)
    y, count = _safe_norm_jit(x, scale, bias, float(eps), kind, impl, interpret)
    return (y, count) if with_count else y


def safe_layer_norm(
    x: ArrayLike,
    scale: ArrayLike | None,
    bias: ArrayLike | None,
    eps: float = 1e-6,
    *,
    implementation: str | None = None,
    with_count: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Layer norm over the last axis with statistics that cannot overflow or go negative.

    ``y = (x - mean) / sqrt(var + eps) * scale + bias``, computed in f32 (f64 under x64)
    with a power-of-two range compression per row, compensated sums and the corrected
    two-pass variance clamped at 0; cast to ``x.dtype`` on store.

    Degenerate rows: when ``var + eps == 0`` (a constant row with ``eps=0``) the normalised
    value is defined as 0, so the row's output is ``bias`` (0 without bias) and its gradient
    is 0 -- finite, never 0/0. A row with a non-finite input is NaN (propagated, counted).

    Args:
      x: float array; the last axis is normalised.
      scale, bias: ``[x.shape[-1]]`` arrays or None.
      eps: Python float >= 0 (static).
      implementation: None | "pallas" | "reference" (see ``safe_sum``).
      with_count: also return the int32 number of non-finite inputs.

    Gradient: ``custom_vjp``; the backward recomputes the statistics with the reference.
    """
    return _call(x, scale, bias, eps, "layer", implementation, with_count)


def safe_rms_norm(
    x: ArrayLike,
    scale: ArrayLike | None,
    eps: float = 1e-6,
    *,
    implementation: str | None = None,
    with_count: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """RMS norm over the last axis: ``x / sqrt(mean(x**2) + eps) * scale``, overflow-free.

    Same machinery as ``safe_layer_norm`` (range compression, compensated sum of squares).
    An all-zero row with ``eps=0`` gives 0 (and a 0 gradient) instead of 0/0; a row with a
    non-finite input is NaN (propagated, counted).
    """
    return _call(x, scale, None, eps, "rms", implementation, with_count)
