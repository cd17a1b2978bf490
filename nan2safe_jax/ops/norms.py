"""LayerNorm and RMSNorm with FAST / STABLE / SAFE paths and ``inv_std`` / ``input_rms`` probes.

FAST is ``flax.nnx.LayerNorm`` / ``RMSNorm``'s math (flax's ``_compute_stats`` and
``_normalize``): statistics taken in ``promote(dtype, f32)`` (fast variance ``E[x²] - E[x]²``
clamped at 0, or two-pass with ``use_fast_variance=False``), an optional ``mask`` of the
positions that enter the statistics, ``(x - mean) * (rsqrt(var + eps) * scale) + bias`` with
``x`` in its own dtype promoted against the f32 statistics, cast back to ``x.dtype``. Its
faults are flax's: a constant row (LayerNorm) or a zero row (RMSNorm) with ``eps=0`` is
``0 * inf = NaN``; a fully-masked row is ``0/0``.

STABLE: f32 two-pass statistics, f32 elementwise math, a saturating cast back; it widens
half-precision inputs only: an f32 (or bf16) row past ~1e19 has a variance that overflows
f32, and STABLE returns that row as zeros (finite, but wrong), or as NaN once its mean
overflows too (rows near 1e38), which SAFE's range compression gets right. SAFE: f32, rows
compressed by a power of two (``LN(x; eps) == LN(x·s; eps·s²)``), compensated statistics from
``kernels.safe_layer_norm`` / ``safe_rms_norm``; a degenerate row (zero variance with
``eps=0``, or no position in the mask) normalises to 0 with finite gradients. With a mask,
SAFE uses plain (not compensated) masked sums: the kernels take no mask.

Every gear returns ``x``'s dtype.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from nan2safe_jax import probe
from nan2safe_jax.ops._numerics import (
    _F32,
    _float_dtype,
    _kernels,
    _pow2,
    _range_exponent,
    _saturate,
    _times_pow2_saturated,
)
from nan2safe_jax.ops.dispatch import switch


def _affine(y, scale, bias):
    if scale is not None:
        y = y * scale
    if bias is not None:
        y = y + bias
    return y


def _flax_stats(x, mask, *, center, fast_var, axes=None):
    """flax's ``_compute_stats`` over ``axes`` (None: the last): ``(mean, var)`` in
    ``promote(x, f32)``."""
    xs = jnp.asarray(x, jnp.promote_types(x.dtype, _F32))
    axes = (x.ndim - 1,) if axes is None else axes
    if not center:
        var = lax.square(xs).mean(axes, where=mask)
        return jnp.zeros_like(var), var
    if fast_var:
        sq = lax.square(xs)  # before the means, as flax: the order fixes the gradient's sums
        mu = xs.mean(axes, where=mask)
        mu2 = sq.mean(axes, where=mask)
        return mu, jnp.maximum(0.0, mu2 - lax.square(mu))
    mu = xs.mean(axes, where=mask)
    return mu, lax.square(xs - jnp.expand_dims(mu, axes)).mean(axes, where=mask)


def _operands(x, scale, bias, dtype):
    """FAST's and STABLE's operands: ``x``, ``scale`` and ``bias`` in the compute ``dtype``
    (flax's ``promote_dtype``; no-ops when they are in it already)."""
    cast = lambda a: None if a is None else a.astype(dtype)  # noqa: E731
    return cast(x), cast(scale), cast(bias)


def _norm_fast(x, scale, bias, mask, *, eps, center, fast_var, want, dtype):
    """flax's ``_normalize`` after ``_compute_stats``; the probe is ``rsqrt(var + eps)``."""
    x, scale, bias = _operands(x, scale, bias, dtype)
    mean, var = _flax_stats(x, mask, center=center, fast_var=fast_var)
    stats_shape = x.shape[:-1] + (1,)
    mean, var = mean.reshape(stats_shape), var.reshape(stats_shape)
    inv = lax.rsqrt(var + eps)
    st = _probes(inv, mean, var, x.dtype, want, center, _stats_limit(x.dtype))
    if "output" in want:  # the output's sampled rows, from the same rows of x
        rows = functools.partial(probe.sample_rows, stride=probe.sample_stride(x.shape))
        st["output"] = probe.op_stats(_flax_affine(rows(x), rows(mean), rows(inv), scale, bias))
    return _flax_affine(x, mean, inv, scale, bias), st


def _flax_affine(x, mean, inv, scale, bias):
    """flax's ``_normalize`` from the per-row ``mean`` and ``inv`` (``[..., 1]``), in x's dtype."""
    y = x - mean
    mul = inv
    if scale is not None:
        mul = mul * scale.reshape((1,) * (x.ndim - 1) + scale.shape)
    y = y * mul
    if bias is not None:
        y = y + bias.reshape((1,) * (x.ndim - 1) + bias.shape)
    return jnp.asarray(y, x.dtype)


def _stats_limit(dtype) -> float:
    """Where FAST's and STABLE's statistics overflow: a row whose scale passes ``sqrt(f32
    max)`` = 2**64 (~1.8e19) squares past f32 (the variance inf, the output zeros or NaN),
    below a bf16 or f32 input's own max; an fp16 input overflows at 65504 first. The input
    probe's headroom is taken against it: a bf16 activation growing toward 1.8e19 read a
    headroom of 1e-19 against bf16's 3.4e38, so only a z-score could see it coming."""
    return min(float(jnp.finfo(dtype).max), 2.0**64)


def _probes(inv, mean, var, dtype, want, center, limit=None):
    """The op's probes from the statistics it takes anyway: ``inv_std`` (every row's
    ``1/sqrt(var + eps)``) and ``input_rms`` (every row's ``sqrt(E[x²])``: ``hypot(std,
    mean)``, or ``sqrt(var)`` for an uncentred norm, whose ``var`` is ``E[x²]``), in the
    input's dtype, so it overflows where the input would: the residual stream's scale; its
    headroom against ``limit`` (FAST's and STABLE's ``_stats_limit``; None: the dtype's max,
    SAFE's, whose compressed statistics do not overflow).
    ``hypot`` rather than ``sqrt(var + mean²)``: a row's mean past ~1.8e19 squares past f32
    while the norm's own (two-pass) variance is finite, and a probe reading an inf the model
    never computed is an incident (``train.model_probes_nonfinite``). Only those in
    ``want``; both in one reduction (``probe.stats_of_rows``)."""
    rows = {}
    if "inv_std" in want:
        rows["inv_std"] = (inv, None)
    if "input_rms" in want:
        rms = jnp.hypot(jnp.sqrt(var), mean) if center else jnp.sqrt(var)
        rows["input_rms"] = (rms.astype(dtype), limit)
    if not rows:
        return {}
    xs, limits = zip(*rows.values(), strict=True)
    return dict(zip(rows, probe.stats_of_rows(xs, limits), strict=True))


def _with_output(y, st, want):
    """``(y, st)`` with ``st["output"]`` (``sampled_stats`` of ``y``) when ``want`` has it."""
    if "output" in want:
        st = {**st, "output": probe.op_stats(probe.sample_rows(y))}
    return y, st


def _norm_stable(x, scale, bias, mask, *, eps, center, fast_var, want, dtype):
    del fast_var  # STABLE always takes the two-pass variance
    x, scale, bias = _operands(x, scale, bias, dtype)
    xf = x.astype(_F32)
    mean, var = _flax_stats(xf, mask, center=center, fast_var=False)
    mean, var = mean[..., None], var[..., None]
    inv = lax.rsqrt(var + eps)
    y = _affine((xf - mean) * inv, _f32(scale), _f32(bias))
    st = _probes(inv, mean, var, x.dtype, want, center, _stats_limit(x.dtype))
    return _with_output(_saturate(y, x.dtype), st, want)


def _row_mean(v, mask=None):
    """Per-row mean over the last axis, of the masked positions only (at least one counted)."""
    return _masked_mean(v, -1, mask)


def _safe_inv_std(xc, eps, mask=None):
    """Per-row ``1/sqrt(var + eps)`` of centred rows; 0 where ``var + eps`` is 0 (degenerate)."""
    d = _row_mean(jnp.square(xc), mask) + eps
    ok = d > 0
    return jnp.where(ok, lax.rsqrt(jnp.where(ok, d, 1.0)), 0.0)


def _safe_probes(xf, eps, center, dtype, want, mask=None):
    """The SAFE path's probes, from one set of power-of-two compressed rows (``x·s``,
    ``eps·s²``, scaled back by ``s``): ``inv_std`` (0 on degenerate rows) and ``input_rms``
    (every row's ``sqrt(E[x²])``, whose squares cannot overflow there, then in ``dtype``, the
    input's, as FAST's); only those in ``want``. Returns the probes and the centred compressed
    rows and their ``inv_std``."""
    e = _range_exponent(xf, axis=-1, keepdims=True)
    xs = xf * _pow2(-e)
    # Saturated: an f32 input past an fp16 layer's range reads as its max (full headroom risk),
    # not inf (the rms of values in ``dtype`` never passes its max).
    rms = _saturate(jnp.sqrt(_row_mean(jnp.square(xs), mask)) * _pow2(e), dtype)
    xc = xs - _row_mean(xs, mask) if center else xs
    inv = _safe_inv_std(xc, eps * _pow2(-2 * e), mask)
    st = {
        "inv_std": probe.op_stats(_times_pow2_saturated(inv, -e)),
        "input_rms": probe.op_stats(rms),
    }
    return {k: v for k, v in st.items() if k in want}, xc, inv


def _norm_safe_masked(xf, scale, bias, mask, eps, center, dtype, want):
    """SAFE with a mask: compressed rows, masked mean / variance, degenerate rows -> 0."""
    mask = jnp.broadcast_to(mask, xf.shape)
    st, xc, inv = _safe_probes(xf, eps, center, dtype, want, mask)
    return _affine(xc * inv, _f32(scale), _f32(bias)), st


def _norm_safe(x, scale, bias, mask, *, eps, center, fast_var, want, dtype):
    """SAFE reads ``x``, ``scale`` and ``bias`` as given, in f32 (an fp16 layer's f32 input
    past 65504 stays finite here; FAST's cast to ``dtype`` made it inf at every gear), and
    returns ``dtype``, saturated."""
    del fast_var
    xf = x.astype(_F32)
    if mask is not None:
        y, st = _norm_safe_masked(xf, scale, bias, mask, eps, center, dtype, want)
        return _with_output(_saturate(y, dtype), st, want)
    if center:
        y = _kernels().safe_layer_norm(xf, _f32(scale), _f32(bias), eps=eps)
    else:
        y = _kernels().safe_rms_norm(xf, _f32(scale), eps=eps)
    st = _safe_probes(xf, eps, center, dtype, want)[0] if {"inv_std", "input_rms"} & want else {}
    return _with_output(_saturate(y, dtype), st, want)


def _f32(a):
    return None if a is None else a.astype(_F32)


NORM_STATS = ("output", "inv_std", "input_rms")


def _norm(x, scale, bias, eps, gear, mask, use_fast_variance, center, stats, dtype=None):
    if set(stats) - set(NORM_STATS):
        raise ValueError(f"norm: stats must be among {NORM_STATS}, got {stats!r}")
    x = jnp.asarray(x)
    scale = None if scale is None else jnp.asarray(scale)
    bias = None if bias is None else jnp.asarray(bias)
    if dtype is None:
        x = x.astype(_float_dtype(x))
        scale = None if scale is None else scale.astype(x.dtype)
        bias = None if bias is None else bias.astype(x.dtype)
    dtype = x.dtype if dtype is None else jnp.dtype(dtype)
    mask = None if mask is None else jnp.broadcast_to(jnp.asarray(mask, bool), x.shape)
    kw = dict(eps=float(eps), center=center, fast_var=bool(use_fast_variance), dtype=dtype)
    kw["want"] = frozenset(stats)
    branches = [functools.partial(f, **kw) for f in (_norm_fast, _norm_stable, _norm_safe)]
    return switch(gear, branches, x, scale, bias, mask)


def layer_norm(
    x: jax.typing.ArrayLike,
    scale: jax.typing.ArrayLike | None,
    bias: jax.typing.ArrayLike | None,
    eps: float = 1e-6,
    gear: Any = 0,
    *,
    mask: jax.typing.ArrayLike | None = None,
    use_fast_variance: bool = True,
    return_stats: bool = False,
    stats: tuple[str, ...] = NORM_STATS,
    dtype: Any = None,
):
    """LayerNorm over the last axis: ``(x - mean) / sqrt(var + eps) * scale + bias``.

    Args:
      x: ``[..., features]``.
      scale: ``[features]`` or None (cast to ``x.dtype``, as flax's ``promote_dtype`` does).
      bias: ``[features]`` or None (cast to ``x.dtype``).
      eps: added to the variance (a Python float).
      gear: FAST/STABLE/SAFE.
      mask: bool, broadcastable to ``x``: the positions that enter the statistics (flax's
        ``mask=``); every position is normalised.
      use_fast_variance: FAST's variance as ``E[x²] - E[x]²`` (flax's default) or two-pass.
      return_stats: also return ``{"output": stats, "inv_std": stats, "input_rms": stats}``:
        ``probe.sampled_stats`` of the output (FAST computes its sampled rows from the same
        rows of ``x``, so the statistic does not make XLA write the output out for it: a loss
        that only sums the output then never materialises it, as with flax's), and
        ``detector.stats`` of the per-row ``1/sqrt(var + eps)`` (its ``max_abs`` is
        ``1/sqrt(min var + eps)``, the precursor of a collapsing variance; inf when a row is
        degenerate in FAST/STABLE) and of the per-row ``sqrt(E[x²])`` in ``x``'s dtype (its
        ``max_abs`` is the largest row's scale: the precursor of activations that grow until
        they overflow).
      stats: which of ``NORM_STATS`` ``return_stats`` computes (one left out is not traced).
      dtype: the dtype FAST and STABLE compute in (None: ``x``'s float dtype, with ``scale``
        and ``bias`` cast to it first). ``x``, ``scale`` and ``bias`` are cast to it inside
        those paths (flax's ``promote_dtype``), so SAFE reads them as given, in f32: an fp16
        layer's f32 input past 65504 stays finite there, where a cast before the gear is
        chosen made it inf at every gear.

    Returns:
      ``dtype`` (or ``x``'s float dtype), same shape; with ``return_stats`` a tuple
      ``(y, stats)``.
    """
    y, st = _norm(x, scale, bias, eps, gear, mask, use_fast_variance, True, stats, dtype)
    return (y, st) if return_stats else y


def rms_norm(
    x: jax.typing.ArrayLike,
    scale: jax.typing.ArrayLike | None,
    eps: float = 1e-6,
    gear: Any = 0,
    *,
    mask: jax.typing.ArrayLike | None = None,
    use_fast_variance: bool = True,
    return_stats: bool = False,
    stats: tuple[str, ...] = NORM_STATS,
    dtype: Any = None,
):
    """RMSNorm over the last axis: ``x / sqrt(mean(x²) + eps) * scale``.

    FAST is flax's (an all-zero row with ``eps=0`` gives NaN); ``use_fast_variance`` is
    accepted as flax does (RMSNorm takes no mean, so it changes nothing). Arguments and
    returns as ``layer_norm``.
    """
    y, st = _norm(x, scale, None, eps, gear, mask, use_fast_variance, False, stats, dtype)
    return (y, st) if return_stats else y


# --- BatchNorm: statistics over every axis but the features', running averages ------------

BATCH_NORM_STATS = ("inv_std", "input_rms")


def _bn_shapes(x, axis):
    """``(reduction axes, feature axes, the features' broadcast shape)`` for ``axis``."""
    feat = tuple(sorted({a % x.ndim for a in ((axis,) if isinstance(axis, int) else axis)}))
    red = tuple(a for a in range(x.ndim) if a not in feat)
    shape = tuple(x.shape[a] if a in feat else 1 for a in range(x.ndim))
    return red, feat, shape


def _bn_probes(mean, var, inv, dtype, want, limit=None):
    """A BatchNorm's probes, per feature, from the statistics it takes anyway (``_probes``'s,
    with features for rows): ``inv_std`` and ``input_rms`` (``hypot(std, mean)`` in the
    input's dtype, its headroom against ``limit``)."""
    return _probes(inv, mean, var, dtype, want, True, limit)


def _bn_running(ra_mean, ra_var, mean, var, momentum):
    """flax's running averages, in the variables' own dtype (not differentiated)."""
    new = lambda ra, s: lax.stop_gradient(momentum * ra + (1 - momentum) * s)  # noqa: E731
    return new(ra_mean, mean), new(ra_var, var)


def _bn_fast(
    x, scale, bias, ra_mean, ra_var, mask, *, eps, momentum, axis, running, fast_var, want, dtype
):
    """flax's ``BatchNorm.__call__``, in its order of operations (which fixes the gradient's
    sums): ``promote_dtype`` of the input, the running statistics and the affine parameters to
    ``dtype``; in training, ``_compute_stats`` over the reduction axes (in ``promote(dtype,
    f32)``) and the running averages of the variables as stored; ``_normalize``."""
    red, _, shape = _bn_shapes(x, axis)
    cast = lambda a: None if a is None else a.astype(dtype)  # noqa: E731
    xc, mean, var, scale_c, bias_c = map(cast, (x, ra_mean, ra_var, scale, bias))
    if not running:
        mean, var = _flax_stats(xc, mask, center=True, fast_var=fast_var, axes=red)
        ra_mean, ra_var = _bn_running(ra_mean, ra_var, mean, var, momentum)
    y = xc - mean.reshape(shape)
    mul = lax.rsqrt(var.reshape(shape) + eps)
    st = _bn_probes(mean, var, mul.reshape(-1), xc.dtype, want, _stats_limit(xc.dtype))
    if scale_c is not None:
        mul = mul * scale_c.reshape(shape)
    y = y * mul
    if bias_c is not None:
        y = y + bias_c.reshape(shape)
    return jnp.asarray(y, dtype), ra_mean, ra_var, st


def _masked_mean(v, red, mask=None):
    """The mean over ``red`` of the masked positions only (at least one counted), keepdims."""
    if mask is None:
        return jnp.mean(v, red, keepdims=True)
    n = jnp.maximum(jnp.sum(mask, red, keepdims=True), 1).astype(_F32)
    return jnp.sum(jnp.where(mask, v, 0.0), red, keepdims=True) / n


def _bn_stable(
    x, scale, bias, ra_mean, ra_var, mask, *, eps, momentum, axis, running, fast_var, want, dtype
):
    """f32 two-pass statistics and f32 math (operands cast to ``dtype`` first, as FAST),
    saturated back to ``dtype``."""
    del fast_var
    red, _, shape = _bn_shapes(x, axis)
    xf = x.astype(dtype).astype(_F32)
    scale, bias = (
        None if a is None else a.astype(dtype).astype(_F32).reshape(shape) for a in (scale, bias)
    )
    if running:
        mean, var = ra_mean.astype(_F32).reshape(shape), ra_var.astype(_F32).reshape(shape)
    else:
        mean = _masked_mean(xf, red, mask)
        var = _masked_mean(jnp.square(xf - mean), red, mask)
        ra_mean, ra_var = _bn_running(ra_mean, ra_var, mean.reshape(-1), var.reshape(-1), momentum)
    inv = lax.rsqrt(var + eps)
    y = _affine((xf - mean) * inv, scale, bias)
    st = _bn_probes(
        mean.reshape(-1), var.reshape(-1), inv.reshape(-1), dtype, want, _stats_limit(dtype)
    )
    return _saturate(y, dtype), ra_mean, ra_var, st


def _bn_safe_probes(mean_s, var_s, inv_s, e, dtype, want):
    """SAFE's probes from its range-compressed statistics (``x·2^-e``), scaled back saturating:
    ``inv_std``, and ``input_rms`` saturated at ``dtype``'s max, as LayerNorm's SAFE
    (``_safe_probes``): an fp16 layer's f32 input past 65504, which SAFE computes, must not
    read as an inf the step takes for an incident."""
    rms = _times_pow2_saturated(jnp.hypot(jnp.sqrt(var_s), mean_s), e)
    st = {
        "inv_std": probe.op_stats(_times_pow2_saturated(inv_s, -e).reshape(-1)),
        "input_rms": probe.op_stats(_saturate(rms.reshape(-1), dtype)),
    }
    return {k: v for k, v in st.items() if k in want}


def _bn_safe(
    x, scale, bias, ra_mean, ra_var, mask, *, eps, momentum, axis, running, fast_var, want, dtype
):
    """f32 from the operands as given (an fp16 layer's f32 input past 65504 stays finite),
    every feature compressed by a power of two (``BN(x; eps) == BN(x·s; eps·s²)``), two-pass
    statistics; a feature whose ``var + eps`` is 0 (zero variance with ``eps=0``; no position
    in the mask, where ``eps > 0`` leaves ``x/sqrt(eps)``, as LayerNorm's SAFE) normalises to 0
    with finite gradients. The running averages take the statistics scaled back, saturated at
    f32's max (in FAST's dtype); in inference a running ``var + eps`` of 0 gives 0."""
    del fast_var
    red, _, shape = _bn_shapes(x, axis)
    xf = x.astype(_F32)
    scale, bias = (None if a is None else a.astype(_F32).reshape(shape) for a in (scale, bias))
    if running:
        mean, var = ra_mean.astype(_F32).reshape(shape), ra_var.astype(_F32).reshape(shape)
        d = var + eps
        inv = jnp.where(d > 0, lax.rsqrt(jnp.where(d > 0, d, 1.0)), 0.0)
        y = _affine((xf - mean) * inv, scale, bias)
        st = _bn_safe_probes(mean, var, inv, jnp.zeros(shape, jnp.int32), dtype, want)
        return _saturate(y, dtype), ra_mean, ra_var, st
    e = _range_exponent(xf, axis=red, keepdims=True)
    xs = xf * _pow2(-e)
    mean_s = _masked_mean(xs, red, mask)
    xc = xs - mean_s
    var_s = _masked_mean(jnp.square(xc), red, mask)
    d = var_s + eps * _pow2(-2 * e)
    inv = jnp.where(d > 0, lax.rsqrt(jnp.where(d > 0, d, 1.0)), 0.0)
    y = _affine(xc * inv, scale, bias)
    mean = (mean_s * _pow2(e)).reshape(-1)
    var = _times_pow2_saturated(var_s, 2 * e).reshape(-1)
    new_mean, new_var = _bn_running(ra_mean, ra_var, mean, var, momentum)
    big = jnp.finfo(new_var.dtype).max
    new_mean, new_var = jnp.clip(new_mean, -big, big), jnp.minimum(new_var, big)
    st = _bn_safe_probes(mean_s, var_s, inv, e, dtype, want)
    return _saturate(y, dtype), new_mean, new_var, st


def batch_norm(
    x: jax.typing.ArrayLike,
    scale: jax.typing.ArrayLike | None,
    bias: jax.typing.ArrayLike | None,
    mean: jax.typing.ArrayLike,
    var: jax.typing.ArrayLike,
    eps: float = 1e-5,
    gear: Any = 0,
    *,
    axis: int | tuple[int, ...] = -1,
    momentum: float = 0.99,
    use_running_average: bool = False,
    mask: jax.typing.ArrayLike | None = None,
    use_fast_variance: bool = True,
    return_stats: bool = False,
    stats: tuple[str, ...] = BATCH_NORM_STATS,
    dtype: Any = None,
):
    """BatchNorm: statistics over every axis of ``x`` but ``axis`` (the features').

    FAST is ``flax.nnx.BatchNorm``'s math; STABLE takes f32 two-pass statistics and f32 math;
    SAFE adds a power-of-two range compression per feature and degenerate features to 0 (see
    ``_bn_safe``). In training (``use_running_average=False``) the batch's statistics
    normalise and update the running averages ``momentum * running + (1 - momentum) * batch``;
    in inference the running averages normalise.

    Args:
      x: the input.
      scale, bias: ``[features]`` or None.
      mean, var: the running averages, ``[features]`` (flax's ``BatchStat`` values).
      eps: added to the variance (a Python float).
      gear: FAST/STABLE/SAFE.
      axis: the feature axis or axes.
      momentum: of the running averages.
      use_running_average: inference (normalise with ``mean`` and ``var``).
      mask: bool, broadcastable to ``x``: the positions that enter the statistics.
      use_fast_variance: FAST's variance as ``E[x²] - E[x]²`` (flax's default) or two-pass.
      return_stats: also return ``{"inv_std": stats, "input_rms": stats}``: ``probe.op_stats``
        of every feature's ``1/sqrt(var + eps)`` and ``sqrt(E[x²])`` (in inference, of the
        running averages'), the norms' precursors (``layer_norm``).
      stats: which of ``BATCH_NORM_STATS`` ``return_stats`` computes.
      dtype: the dtype FAST and STABLE compute in (None: ``x``'s float dtype); as
        ``layer_norm``'s.

    Returns:
      ``(y, (new_mean, new_var))`` (the running averages as given in inference), with
      ``return_stats`` ``(y, (new_mean, new_var), stats)``.
    """
    if set(stats) - set(BATCH_NORM_STATS):
        raise ValueError(f"batch_norm: stats must be among {BATCH_NORM_STATS}, got {stats!r}")
    x = jnp.asarray(x)
    if dtype is None:
        x = x.astype(_float_dtype(x))
    dtype = x.dtype if dtype is None else jnp.dtype(dtype)
    scale = None if scale is None else jnp.asarray(scale)
    bias = None if bias is None else jnp.asarray(bias)
    mean, var = jnp.asarray(mean), jnp.asarray(var)
    mask = None if mask is None else jnp.broadcast_to(jnp.asarray(mask, bool), x.shape)
    kw = dict(
        eps=float(eps),
        momentum=float(momentum),
        axis=axis,
        running=bool(use_running_average),
        fast_var=bool(use_fast_variance),
        want=frozenset(stats),
        dtype=dtype,
    )
    branches = [functools.partial(f, **kw) for f in (_bn_fast, _bn_stable, _bn_safe)]
    y, new_mean, new_var, st = switch(gear, branches, x, scale, bias, mean, var, mask)
    return (y, (new_mean, new_var), st) if return_stats else (y, (new_mean, new_var))
