"""Ops with FAST, STABLE and SAFE paths, selected by a gear that may be traced.

The write-up's three NaN sources live in a handful of ops: the q·k logits and softmax of
attention, the MoE router's two softmaxes, the statistics of LayerNorm / RMSNorm, and the log of
the cross-entropy. Each op here has three paths (SPEC.md, "Three gears"):

- **FAST** (``Gear.FAST == 0``): the input dtype and the ordinary formulation; it costs what
  the plain op costs, and it has the plain op's faults (the adversarial tests show each one).
- **STABLE** (1): every reduction and matmul accumulates in f32 (``preferred_element_type``);
  elementwise math runs in f32 (so fp16 inputs are computed as f32 and never overflow inside).
  Degenerate cases (a fully-masked row, a zero variance with ``eps=0``) are *not* handled here:
  STABLE guards against overflow, SAFE against degenerate cases.
- **SAFE** (2): f32 inputs; compensated (Neumaier) sums from ``nan2safe_jax.kernels``; dynamic
  range compression by an exact power of two chosen from ``max_abs`` (undone after); degenerate
  cases defined instead of NaN (a fully-masked softmax row gives zeros, a zero-variance row
  gives 0, the log of a zero probability never happens or is clamped, an empty masked mean is
  0); gradients finite wherever the output is (double-``where``); casts back to a narrower dtype
  saturate at the dtype's largest finite value instead of overflowing to inf.

The gear is data. A Python int dispatches directly (no ``cond`` in the program); anything
else, notably a traced int32 scalar inside ``jit``, goes through ``lax.switch``: one compile
serves all three gears, and switching the gear never retraces or recompiles. ``lax.switch`` on
an unbatched scalar executes one branch only.

vmap behaviour: under ``jax.vmap`` with an *unbatched* gear (``in_axes=None``, or a gear closed
over), the switch stays a switch and still runs one branch. With a *batched* gear (one gear per
vmapped element), JAX turns ``lax.switch`` into a ``select`` over the outputs of all three
branches: the result is still the per-element gear's result, but every branch is computed.
``nan2safe_jax.nn`` therefore never vmaps a gear: under ``nnx.scan`` over layers each layer's
gear is sliced to a scalar before the op sees it.

All branches return the input's float dtype (``cross_entropy`` returns f32).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import operator
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from nan2safe_jax import detector
from nan2safe_jax.site import site_scope

__all__ = [
    "FAST",
    "STABLE",
    "SAFE",
    "Routing",
    "attention",
    "cross_entropy",
    "layer_norm",
    "linear",
    "logsumexp",
    "branch_site",
    "rms_norm",
    "router",
    "softmax",
    "switch",
]

FAST, STABLE, SAFE = 0, 1, 2
NUM_GEARS = 3

_F32 = jnp.float32
_HIGHEST = lax.Precision.HIGHEST

# ---------------------------------------------------------------------------------------------
# gear dispatch


def _static_gear(gear: Any) -> int | None:
    """The gear as a Python int when it is known at trace time, else None."""
    if isinstance(gear, jax.core.Tracer):
        return None
    try:
        g = operator.index(gear)
    except TypeError:
        return None
    return g


_BRANCH_SITE: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "nan2safe_branch_site", default=None
)


@contextlib.contextmanager
def branch_site(name: str | None):
    """Re-enters ``site_scope(name)`` inside every ``lax.switch`` branch traced in this block.

    Equations inside a ``cond`` branch carry a name stack *relative to the branch*, so without
    this the site would only be named on the ``cond`` equation itself. ``nan2safe_jax.nn``
    sites wrap their computation in ``site_scope(name)`` and ``branch_site(name)``, so every
    equation of every gear's path names its site directly.
    """
    token = _BRANCH_SITE.set(name)
    try:
        yield
    finally:
        _BRANCH_SITE.reset(token)


def _scoped(fn: Callable[..., Any], name: str) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapped(*args):
        with site_scope(name):
            return fn(*args)

    return wrapped


def switch(gear: Any, branches: Sequence[Callable[..., Any]], *operands: Any) -> Any:
    """Runs ``branches[gear](*operands)``.

    A Python int (or any concrete integer scalar) calls the branch directly; a traced gear goes
    through ``lax.switch`` (index clamped to ``[0, len(branches) - 1]``, as ``lax.switch`` does).

    Args:
      gear: ``Gear`` / int, or an int32 scalar array (may be traced).
      branches: one callable per gear (FAST, STABLE, SAFE).
      *operands: passed to the branch; pytrees (``None`` allowed).

    Raises:
      ValueError: a Python int outside the branches, or a gear that is not a scalar.
    """
    g = _static_gear(gear)
    if g is not None:
        if isinstance(gear, int) and not 0 <= g < len(branches):
            raise ValueError(
                f"gear must be one of Gear.FAST/STABLE/SAFE (0..{len(branches) - 1}), got {gear!r}"
            )
        return branches[min(max(g, 0), len(branches) - 1)](*operands)
    gear = jnp.asarray(gear)
    if gear.ndim != 0:
        raise ValueError(
            f"gear must be a scalar, got shape {gear.shape}; a stacked site's gear (shape [L]) is "
            "sliced per layer by nnx.scan, index it (gear[i]) when calling an op directly"
        )
    if not jnp.issubdtype(gear.dtype, jnp.integer):
        gear = gear.astype(jnp.int32)
    name = _BRANCH_SITE.get()
    if name is not None:
        branches = [_scoped(b, name) for b in branches]
    return lax.switch(gear.astype(jnp.int32), tuple(branches), *operands)


class _FastVJP(NamedTuple):
    """The FAST path with a hand-written backward (see ``_switch_fast_vjp``)."""

    fwd: Callable[..., Any]  # (*args) -> (out, residuals)
    bwd: Callable[..., Any]  # (args, residuals, out_cotangent) -> arg cotangents
    zeros: Callable[..., Any]  # (*args) -> residuals-shaped zeros


def _switch_fast_vjp(gear, branches, fast: _FastVJP, *args):
    """``switch`` whose backward does not pay for the paths it did not take.

    Under ``jax.grad`` a plain ``lax.switch`` saves the union of every branch's residuals, the
    untaken ones zero-filled: for a memory-bound op (a norm) that doubles the FAST step. Here
    the forward saves the inputs plus FAST's own (small) residuals; the backward runs FAST's
    hand-written VJP, or recomputes the STABLE / SAFE branch under ``jax.vjp`` (those gears can
    afford a second forward). A Python-int gear dispatches directly with ordinary autodiff.
    Not forward-mode differentiable (``custom_vjp``) with a traced gear.
    """
    g = _static_gear(gear)
    if g is not None:
        return switch(g, branches, *args)
    gear = jnp.asarray(gear)
    if gear.ndim != 0:
        return switch(gear, branches, *args)  # raises the scalar error
    gear = gear.astype(jnp.int32)
    name = _BRANCH_SITE.get()
    wrap = (lambda f: _scoped(f, name)) if name is not None else (lambda f: f)
    branches = [wrap(b) for b in branches]

    @jax.custom_vjp
    def run(gear, args):
        return lax.switch(gear, branches, *args)

    def run_fwd(gear, args):
        def others(i):
            return lambda *a: (branches[i](*a), fast.zeros(*a))

        out, res = lax.switch(gear, [wrap(fast.fwd), others(1), others(2)], *args)
        return out, (gear, args, res)

    def run_bwd(saved, ct):
        gear, args, res = saved

        def recompute(i):
            def bwd(args, res, ct):
                _, vjp = jax.vjp(branches[i], *args)
                return vjp(ct)

            return bwd

        fast_bwd = wrap(lambda args, res, ct: fast.bwd(args, res, ct))
        dargs = lax.switch(gear, [fast_bwd, recompute(1), recompute(2)], args, res, ct)
        return None, tuple(dargs)

    run.defvjp(run_fwd, run_bwd)
    return run(gear, tuple(args))


# ---------------------------------------------------------------------------------------------
# small helpers


def _float_dtype(x: jax.Array) -> jnp.dtype:
    dt = jnp.dtype(x.dtype)
    return dt if jnp.issubdtype(dt, jnp.floating) else jnp.dtype(_F32)


def _saturate(y: jax.Array, dtype) -> jax.Array:
    """Casts ``y`` to ``dtype``, clipping to the dtype's finite range (NaN stays NaN)."""
    dtype = jnp.dtype(dtype)
    if jnp.dtype(y.dtype) == dtype:
        return y
    if jnp.finfo(dtype).max < jnp.finfo(y.dtype).max:
        big = float(jnp.finfo(dtype).max)
        y = jnp.clip(y, -big, big)
    return y.astype(dtype)


def _pow2(e: jax.Array) -> jax.Array:
    """Exactly ``2.0**e`` in f32 for integer ``e`` (clipped to the normal range [-126, 127])."""
    e = jnp.clip(e.astype(jnp.int32), -126, 127)
    return lax.bitcast_convert_type(lax.shift_left(e + 127, jnp.int32(23)), _F32)


def _range_exponent(x: jax.Array, axis=None, keepdims=False) -> jax.Array:
    """``e`` with ``max|x| * 2**-e`` in [0.5, 1) (0 for an all-zero or non-finite max).

    Dynamic range compression: multiplying by ``_pow2(-e)`` (and later by ``_pow2(e)``) is exact
    in binary floating point, barring subnormals. Not differentiated (a constant factor).
    """
    amax = lax.stop_gradient(jnp.max(jnp.abs(x), axis=axis, keepdims=keepdims, initial=0.0))
    _, e = jnp.frexp(amax)
    return jnp.where(jnp.isfinite(amax), jnp.clip(e, -120, 120), 0).astype(jnp.int32)


def _stats(x: jax.Array) -> jax.Array:
    """Probe statistics: monitoring only, so no gradient flows through them."""
    return lax.stop_gradient(detector.stats(x))


def _kernels():
    from nan2safe_jax import kernels  # lazy: only the SAFE paths need it

    return kernels


def _check_rank(x: jax.Array, ndim: int, name: str, op: str) -> None:
    if x.ndim != ndim:
        raise ValueError(f"{op}: {name} must have rank {ndim}, got shape {x.shape}")


# ---------------------------------------------------------------------------------------------
# softmax / logsumexp


def _softmax_fast(x, where, axis):
    if where is not None:
        x = jnp.where(where, x, -jnp.inf)  # the write-up's masking: a full row is 0/0 = NaN
    return jax.nn.softmax(x, axis=axis)


def _softmax_stable(x, where, axis):
    return _softmax_fast(x.astype(_F32), where, axis).astype(x.dtype)


def _softmax_safe(x, where, axis):
    y = _kernels().safe_softmax(x.astype(_F32), axis=axis, where=where)
    return y.astype(x.dtype)


def softmax(
    x: jax.typing.ArrayLike,
    axis: int = -1,
    where: jax.typing.ArrayLike | None = None,
    gear: Any = 0,
) -> jax.Array:
    """Softmax along ``axis``; entries where ``where`` is False are 0.

    FAST: ``jax.nn.softmax`` in ``x.dtype`` after setting masked entries to -inf, so a
    fully-masked row is exp(-inf)/sum = 0/0 = NaN (the write-up's padding-mask fault).
    STABLE: the same in f32. SAFE: ``kernels.safe_softmax`` in f32 (compensated denominator; a
    fully-masked row gives zeros with finite gradients).

    Args:
      x: logits.
      axis: the softmax axis.
      where: optional bool mask broadcastable to ``x``; True = keep.
      gear: FAST/STABLE/SAFE, a Python int or a (traced) int32 scalar.

    Returns:
      Probabilities in ``x``'s float dtype.
    """
    x = jnp.asarray(x)
    x = x.astype(_float_dtype(x))
    if where is not None:
        where = jnp.broadcast_to(jnp.asarray(where, bool), x.shape)
    branches = [functools.partial(f, axis=axis) for f in (_softmax_fast, _softmax_stable)]
    branches.append(functools.partial(_softmax_safe, axis=axis))
    return switch(gear, branches, x, where)


def _lse_plain(x, where, axis, keepdims):
    return jax.nn.logsumexp(x, axis=axis, where=where, keepdims=keepdims)


def _lse_stable(x, where, axis, keepdims):
    return _lse_plain(x.astype(_F32), where, axis, keepdims).astype(x.dtype)


def _lse_safe(x, where, axis, keepdims):
    xf = x.astype(_F32)
    valid = jnp.ones(x.shape, bool) if where is None else where
    m = jnp.max(jnp.where(valid, xf, -jnp.inf), axis=axis, keepdims=True)
    m = lax.stop_gradient(jnp.where(jnp.isfinite(m), m, 0.0))
    z = jnp.where(valid, xf - m, 0.0)  # double-where: no exp of a masked (maybe huge) entry
    e = jnp.where(valid, jnp.exp(z), 0.0)
    s = _kernels().safe_sum(e, axis=axis)
    s = jnp.expand_dims(s, axis)
    tiny = jnp.finfo(_F32).tiny
    ok = s > tiny
    out = m + jnp.where(ok, jnp.log(jnp.where(ok, s, 1.0)), jnp.log(tiny))
    if not keepdims:
        out = jnp.squeeze(out, axis)
    return _saturate(out, x.dtype)


def logsumexp(
    x: jax.typing.ArrayLike,
    axis: int = -1,
    where: jax.typing.ArrayLike | None = None,
    gear: Any = 0,
    *,
    keepdims: bool = False,
) -> jax.Array:
    """``log(sum(exp(x)))`` along ``axis`` over the entries where ``where`` is True.

    FAST: ``jax.nn.logsumexp`` in ``x.dtype``: an fp16 sum of more than 65504 near-max terms
    overflows to inf, and a fully-masked row is -inf. STABLE: f32. SAFE: f32, compensated sum,
    log clamped at ``log(finfo(f32).tiny)`` (about -87.3) so a fully-masked row is finite, and
    finite gradients (zero on masked entries).

    Returns:
      ``x``'s float dtype, ``axis`` removed unless ``keepdims``.
    """
    x = jnp.asarray(x)
    x = x.astype(_float_dtype(x))
    if where is not None:
        where = jnp.broadcast_to(jnp.asarray(where, bool), x.shape)
    kw = dict(axis=axis, keepdims=keepdims)
    branches = [functools.partial(f, **kw) for f in (_lse_plain, _lse_stable, _lse_safe)]
    return switch(gear, branches, x, where)


# ---------------------------------------------------------------------------------------------
# attention


def _attention_mask(mask, causal: bool, q_len: int, k_len: int):
    """Combines a user mask and a causal mask (None when neither); True = attend."""
    m = None if mask is None else jnp.asarray(mask, bool)
    if causal:
        # query i sees keys j <= i + (k_len - q_len): aligned at the end, as in decoding
        qi = lax.broadcasted_iota(jnp.int32, (q_len, k_len), 0)
        kj = lax.broadcasted_iota(jnp.int32, (q_len, k_len), 1)
        c = kj <= qi + (k_len - q_len)
        m = c if m is None else jnp.logical_and(m, c)
    return m


def _softmax_parts(masked):
    """``(probs, row_max, row_sum)`` of a softmax over the last axis, in ``masked.dtype``.

    The ordinary max-shifted formulation (``jax.nn.softmax``'s math), spelled out so the row
    max and the denominator are available to the probes for free. A fully-masked row (all
    -inf) is exp(-inf - -inf) = NaN, as in the write-up.
    """
    m = jnp.max(masked, axis=-1, keepdims=True)
    e = jnp.exp(masked - lax.stop_gradient(m))
    den = jnp.sum(e, axis=-1, keepdims=True)
    return e / den, m, den


def _attn_stats(row_max, den):
    """Per-row probe statistics (cheap: ``[b, h, q]`` values, not ``[b, h, q, k]``).

    ``logits``: stats of each row's max logit (over attended keys; -inf for a fully-masked
    row, +inf for an overflowed one). ``probs``: stats of each row's max probability
    ``1/denominator`` (1 = attention collapsed onto one key; NaN for a 0/0 row).
    """
    return {"logits": _stats(row_max), "probs": _stats(1.0 / den)}


def _attn_fast(q, k, v, mask, scale, *, causal, stats):
    dt = q.dtype
    logits = jnp.einsum("bqhd,bkhd->bhqk", q * scale.astype(dt), k)  # in dt: fp16 can overflow
    m = _attention_mask(mask, causal, q.shape[1], k.shape[1])
    masked = logits if m is None else jnp.where(m, logits, -jnp.inf)
    probs, row_max, den = _softmax_parts(masked)
    out = jnp.einsum("bhqk,bkhd->bqhd", probs, v)
    return out, (_attn_stats(row_max, den) if stats else None)


def _attn_fast_vjp(causal):
    """FAST attention with flax's residual (the probabilities) and a hand-written backward."""

    def fwd(q, k, v, mask, scale):
        dt = q.dtype
        qs = q * scale.astype(dt)
        logits = jnp.einsum("bqhd,bkhd->bhqk", qs, k)
        m = _attention_mask(mask, causal, q.shape[1], k.shape[1])
        masked = logits if m is None else jnp.where(m, logits, -jnp.inf)
        probs, row_max, den = _softmax_parts(masked)
        out = jnp.einsum("bhqk,bkhd->bqhd", probs, v)
        return (out, _attn_stats(row_max, den)), (probs,)

    def bwd(args, res, ct):
        q, k, v, mask, scale = args
        (probs,) = res
        g = ct[0]
        dt = q.dtype
        qs = q * scale.astype(dt)
        dv = jnp.einsum("bhqk,bqhd->bkhd", probs, g)
        dp = jnp.einsum("bqhd,bkhd->bhqk", g, v)
        dlogits = probs * (dp - jnp.sum(dp * probs, axis=-1, keepdims=True))
        dqs = jnp.einsum("bhqk,bkhd->bqhd", dlogits, k)
        dk = jnp.einsum("bhqk,bqhd->bkhd", dlogits, qs)
        dq = dqs * scale.astype(dt)
        dscale = jnp.sum((dqs * q).astype(_F32)).astype(scale.dtype)
        dmask = None if mask is None else np.zeros(mask.shape, jax.dtypes.float0)
        return dq, dk, dv, dmask, dscale

    def zeros(q, k, v, mask, scale):
        shape = (q.shape[0], q.shape[2], q.shape[1], k.shape[1])
        return (jnp.zeros(shape, q.dtype),)

    return fwd, bwd, zeros


def _attn_stable(q, k, v, mask, scale, *, causal, stats):
    dt = q.dtype
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=_F32) * scale
    m = _attention_mask(mask, causal, q.shape[1], k.shape[1])
    masked = logits if m is None else jnp.where(m, logits, -jnp.inf)
    probs, row_max, den = _softmax_parts(masked)
    out = jnp.einsum("bhqk,bkhd->bqhd", probs.astype(v.dtype), v, preferred_element_type=_F32)
    return out.astype(dt), (_attn_stats(row_max, den) if stats else None)


def _attn_safe(q, k, v, mask, scale, *, causal, stats):
    dt = q.dtype
    qf, kf, vf = q.astype(_F32), k.astype(_F32), v.astype(_F32)
    # dynamic range compression: |q'|, |k'| < 1 per (batch, head), so |q'·k'| <= head_dim
    eq = _range_exponent(qf, axis=(1, 3), keepdims=True)  # [b, 1, h, 1]
    ek = _range_exponent(kf, axis=(1, 3), keepdims=True)
    lc = jnp.einsum(
        "bqhd,bkhd->bhqk", qf * _pow2(-eq), kf * _pow2(-ek), precision=_HIGHEST
    )  # compressed logits
    m = _attention_mask(mask, causal, q.shape[1], k.shape[1])
    valid = jnp.ones(lc.shape, bool) if m is None else jnp.broadcast_to(m, lc.shape)
    mx = jnp.max(jnp.where(valid, lc, -jnp.inf), axis=-1, keepdims=True)
    mx = lax.stop_gradient(jnp.where(jnp.isfinite(mx), mx, 0.0))  # softmax is shift-invariant
    d = jnp.where(valid, lc - mx, 0.0)  # <= 0 on valid entries; masked entries kept finite
    # undo the compression on the shifted logits, one exact power of two at a time: the max
    # entry stays exactly 0, an entry far below it may go to -inf (exp -> 0, gradient 0)
    eqt = jnp.transpose(eq, (0, 2, 1, 3))  # [b, h, 1, 1]
    ekt = jnp.transpose(ek, (0, 2, 1, 3))
    sc = jnp.asarray(scale, _F32)
    d = d * _pow2(eqt) * _pow2(ekt) * sc
    probs = _kernels().safe_softmax(d, axis=-1, where=valid)
    out = jnp.einsum("bhqk,bkhd->bqhd", probs, vf, precision=_HIGHEST)
    st = None
    if stats:
        row_max = mx * _pow2(eqt) * _pow2(ekt) * sc  # the true max logit (f32)
        pmax = jnp.max(probs, axis=-1, keepdims=True)
        den = jnp.where(pmax > 0, 1.0 / jnp.where(pmax > 0, pmax, 1.0), jnp.inf)  # row: 0 -> inf
        st = _attn_stats(row_max, den)
    return _saturate(out, dt), st


def attention(
    q: jax.typing.ArrayLike,
    k: jax.typing.ArrayLike,
    v: jax.typing.ArrayLike,
    mask: jax.typing.ArrayLike | None = None,
    causal: bool = False,
    gear: Any = 0,
    *,
    scale: jax.typing.ArrayLike | None = None,
    return_stats: bool = False,
):
    """Dot-product attention: ``softmax(scale · q·kᵀ, masked) · v``.

    FAST: logits ``einsum`` in the input dtype (q scaled first, as ``flax.nnx`` does), masked
    entries set to -inf, ``jax.nn.softmax`` and the weighted sum in the input dtype: fp16 logits
    past 65504 overflow to inf (then inf - inf = NaN), a fully-masked row is 0/0 = NaN.
    STABLE: both matmuls accumulate in f32 (``preferred_element_type``), the scale and the
    softmax in f32; probabilities cast to ``v.dtype`` for the second matmul.
    SAFE: f32 inputs; q and k compressed by exact powers of two per (batch, head) so the logits
    matmul cannot overflow, the softmax taken on the max-shifted logits with the compression
    undone after the shift (so even logits beyond f32 range give the right probabilities);
    ``kernels.safe_softmax`` (compensated denominator, fully-masked row -> zeros, finite
    gradients); output cast with saturation.

    Args:
      q: ``[batch, q_len, heads, head_dim]``.
      k: ``[batch, k_len, heads, head_dim]``.
      v: ``[batch, k_len, heads, v_dim]``.
      mask: bool, broadcastable to ``[batch, heads, q_len, k_len]``; True = attend.
      causal: also mask keys after the query (aligned at the end when ``q_len < k_len``).
      gear: FAST/STABLE/SAFE, a Python int or a (traced) int32 scalar.
      scale: logit multiplier (may be traced); default ``1/sqrt(head_dim)``.
      return_stats: also return ``{"logits": stats, "probs": stats}``: ``detector.stats`` of
        each query row's max logit (over attended keys) and of each row's max probability, as
        the selected gear computed them. Per-row values keep the probes cheap (the logits
        are ``[b, h, q, k]``; these are ``[b, h, q]``) while still showing logit growth toward
        the dtype's max (headroom), attention collapse (max probability -> 1), and 0/0 rows
        (non-finite; in SAFE a fully-masked row reports max logit 0 and max probability 0).

    Returns:
      ``[batch, q_len, heads, v_dim]`` in q's float dtype; with ``return_stats`` a tuple
      ``(out, stats)``.
    """
    q, k, v = jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)
    dt = jnp.result_type(_float_dtype(q), _float_dtype(k), _float_dtype(v))
    q, k, v = q.astype(dt), k.astype(dt), v.astype(dt)
    for name, a in (("q", q), ("k", k), ("v", v)):
        _check_rank(a, 4, name, "attention")
    if k.shape[:3] != v.shape[:3] or q.shape[0] != k.shape[0] or q.shape[2:] != k.shape[2:]:
        raise ValueError(
            "attention: expected q [b, q_len, h, d], k [b, k_len, h, d], v [b, k_len, h, dv]; "
            f"got q {q.shape}, k {k.shape}, v {v.shape}"
        )
    if scale is None:
        scale = 1.0 / float(q.shape[-1]) ** 0.5
    scale = jnp.asarray(scale, _F32)
    if mask is not None:
        mask = jnp.asarray(mask, bool)
        if mask.ndim > 4:
            raise ValueError(f"attention: mask must broadcast to [b, h, q, k], got {mask.shape}")
    kw = dict(causal=bool(causal), stats=True)
    branches = [functools.partial(f, **kw) for f in (_attn_fast, _attn_stable, _attn_safe)]
    fast = _FastVJP(*_attn_fast_vjp(bool(causal)))
    out, st = _switch_fast_vjp(gear, branches, fast, q, k, v, mask, scale)
    return (out, st) if return_stats else out


# ---------------------------------------------------------------------------------------------
# norms


def _affine(y, scale, bias):
    if scale is not None:
        y = y * scale
    if bias is not None:
        y = y + bias
    return y


def _ln_fast(x, scale, bias, eps, *, stats):
    # flax.nnx.LayerNorm's formulation (fast variance E[x²] - E[x]², clamped at 0) in x.dtype:
    # a constant row with eps=0 is 0 * rsqrt(0) = 0 * inf = NaN; fp16 x² overflows past 256.
    mean = jnp.mean(x, -1, keepdims=True)
    mean2 = jnp.mean(jnp.square(x), -1, keepdims=True)
    var = jnp.maximum(0.0, mean2 - jnp.square(mean))
    inv = lax.rsqrt(var + jnp.asarray(eps, x.dtype))
    mul = inv if scale is None else inv * scale.astype(x.dtype)
    y = (x - mean) * mul
    if bias is not None:
        y = y + bias.astype(x.dtype)
    return y, ({"inv_std": _stats(inv)} if stats else None)


def _ln_fast_fwd(x, scale, bias, eps, *, stats):
    out = _ln_fast(x, scale, bias, eps, stats=stats)
    mean = jnp.mean(x, -1, keepdims=True)  # CSE'd with the forward's by XLA
    var = jnp.maximum(0.0, jnp.mean(jnp.square(x), -1, keepdims=True) - jnp.square(mean))
    return out, (mean, lax.rsqrt(var + jnp.asarray(eps, x.dtype)))


def _norm_bwd(x, scale, mean, inv, g, center):
    """VJP of ``y = (x - mean) * inv * scale + bias`` (mean = 0 for RMSNorm), in x.dtype."""
    xhat = (x - mean) * inv if center else x * inv
    dxhat = g if scale is None else g * scale.astype(x.dtype)
    proj = jnp.mean(dxhat * xhat, -1, keepdims=True)
    inner = dxhat - xhat * proj
    if center:
        inner = inner - jnp.mean(dxhat, -1, keepdims=True)
    dx = inv * inner
    lead = tuple(range(x.ndim - 1))
    dscale = None if scale is None else jnp.sum(g * xhat, lead).astype(scale.dtype)
    return dx.astype(x.dtype), dscale


def _ln_fast_vjp(eps):
    def fwd(x, scale, bias):
        (y, st), res = _ln_fast_fwd(x, scale, bias, eps, stats=True)
        return (y, st), res

    def bwd(args, res, ct):
        x, scale, bias = args
        mean, inv = res
        g = ct[0]
        dx, dscale = _norm_bwd(x, scale, mean, inv, g, center=True)
        dbias = None if bias is None else jnp.sum(g, tuple(range(x.ndim - 1))).astype(bias.dtype)
        return dx, dscale, dbias

    def zeros(x, scale, bias):
        z = jnp.zeros(x.shape[:-1] + (1,), x.dtype)
        return z, z

    return fwd, bwd, zeros


def _ln_stable(x, scale, bias, eps, *, stats):
    xf = x.astype(_F32)
    mean = jnp.mean(xf, -1, keepdims=True)
    xc = xf - mean
    var = jnp.mean(jnp.square(xc), -1, keepdims=True)  # two-pass, f32
    inv = lax.rsqrt(var + eps)
    y = _affine(xc * inv, _f32(scale), _f32(bias))
    return y.astype(x.dtype), ({"inv_std": _stats(inv)} if stats else None)


def _safe_inv_std(xc, eps):
    """Per-row ``1/sqrt(var + eps)`` of centred rows; 0 where ``var + eps`` is 0 (degenerate)."""
    var = jnp.mean(jnp.square(xc), -1, keepdims=True)
    d = var + eps
    ok = d > 0
    return jnp.where(ok, lax.rsqrt(jnp.where(ok, d, 1.0)), 0.0)


def _safe_probe_inv_std(xf, eps, center):
    """Probe of the per-row inverse std the SAFE path uses (0 on degenerate rows).

    Computed on power-of-two compressed rows (``x·s``, ``eps·s²``), then scaled back by ``s``.
    """
    e = _range_exponent(xf, axis=-1, keepdims=True)
    xs = xf * _pow2(-e)
    if center:
        xs = xs - jnp.mean(xs, -1, keepdims=True)
    return _stats(_safe_inv_std(xs, eps * _pow2(-2 * e)) * _pow2(-e))


def _ln_safe(x, scale, bias, eps, *, stats):
    xf = x.astype(_F32)
    # the kernel compresses each row by a power of two (LN(x; eps) == LN(x·s; eps·s²)),
    # sums with compensation, and defines a zero-variance row with eps=0 as 0 (then + bias)
    y = _kernels().safe_layer_norm(xf, _f32(scale), _f32(bias), eps=eps)
    st = {"inv_std": _safe_probe_inv_std(xf, eps, True)} if stats else None
    return _saturate(y, x.dtype), st


def _f32(a):
    return None if a is None else a.astype(_F32)


def layer_norm(
    x: jax.typing.ArrayLike,
    scale: jax.typing.ArrayLike | None,
    bias: jax.typing.ArrayLike | None,
    eps: float = 1e-6,
    gear: Any = 0,
    *,
    return_stats: bool = False,
):
    """LayerNorm over the last axis: ``(x - mean) / sqrt(var + eps) * scale + bias``.

    FAST: ``flax.nnx.LayerNorm``'s math (fast variance ``E[x²] - E[x]²``) in ``x.dtype``; a
    constant row with ``eps=0`` gives 0·inf = NaN. STABLE: f32 two-pass statistics. SAFE:
    ``kernels.safe_layer_norm`` in f32 (per-row power-of-two range compression, compensated
    two-pass statistics; a zero-variance row with ``eps=0`` gives ``bias`` (0 before the
    affine) with finite gradients).

    Args:
      x: ``[..., features]``.
      scale: ``[features]`` or None.
      bias: ``[features]`` or None.
      eps: added to the variance (a Python float).
      gear: FAST/STABLE/SAFE.
      return_stats: also return ``{"inv_std": stats}``: ``detector.stats`` of the per-row
        ``1/sqrt(var + eps)``; its ``max_abs`` is ``1/sqrt(min var + eps)``, the precursor of a
        collapsing variance (inf when a row is degenerate in FAST/STABLE).

    Returns:
      ``x``'s float dtype, same shape; with ``return_stats`` a tuple ``(y, stats)``.
    """
    x = jnp.asarray(x)
    x = x.astype(_float_dtype(x))
    scale = None if scale is None else jnp.asarray(scale)
    bias = None if bias is None else jnp.asarray(bias)
    eps = float(eps)
    branches = [
        functools.partial(lambda f, x, s, b: f(x, s, b, eps, stats=True), f)
        for f in (_ln_fast, _ln_stable, _ln_safe)
    ]
    y, st = _switch_fast_vjp(gear, branches, _FastVJP(*_ln_fast_vjp(eps)), x, scale, bias)
    return (y, st) if return_stats else y


def _rms_fast(x, scale, eps, *, stats):
    # flax.nnx.RMSNorm's math in x.dtype: an all-zero row with eps=0 is 0 * inf = NaN.
    ms = jnp.mean(jnp.square(x), -1, keepdims=True)
    inv = lax.rsqrt(ms + jnp.asarray(eps, x.dtype))
    mul = inv if scale is None else inv * scale.astype(x.dtype)
    return x * mul, ({"inv_std": _stats(inv)} if stats else None)


def _rms_fast_vjp(eps):
    def fwd(x, scale):
        out = _rms_fast(x, scale, eps, stats=True)
        inv = lax.rsqrt(jnp.mean(jnp.square(x), -1, keepdims=True) + jnp.asarray(eps, x.dtype))
        return out, (inv,)

    def bwd(args, res, ct):
        x, scale = args
        (inv,) = res
        return _norm_bwd(x, scale, None, inv, ct[0], center=False)

    def zeros(x, scale):
        return (jnp.zeros(x.shape[:-1] + (1,), x.dtype),)

    return fwd, bwd, zeros


def _rms_stable(x, scale, eps, *, stats):
    xf = x.astype(_F32)
    inv = lax.rsqrt(jnp.mean(jnp.square(xf), -1, keepdims=True) + eps)
    y = _affine(xf * inv, _f32(scale), None)
    return y.astype(x.dtype), ({"inv_std": _stats(inv)} if stats else None)


def _rms_safe(x, scale, eps, *, stats):
    xf = x.astype(_F32)
    y = _kernels().safe_rms_norm(xf, _f32(scale), eps=eps)
    st = {"inv_std": _safe_probe_inv_std(xf, eps, False)} if stats else None
    return _saturate(y, x.dtype), st


def rms_norm(
    x: jax.typing.ArrayLike,
    scale: jax.typing.ArrayLike | None,
    eps: float = 1e-6,
    gear: Any = 0,
    *,
    return_stats: bool = False,
):
    """RMSNorm over the last axis: ``x / sqrt(mean(x²) + eps) * scale``.

    FAST: ``flax.nnx.RMSNorm``'s math in ``x.dtype`` (an all-zero row with ``eps=0`` gives NaN;
    fp16 ``x²`` overflows past 256, silently zeroing the row). STABLE: f32 statistics. SAFE:
    ``kernels.safe_rms_norm`` in f32 (per-row range compression, compensated sum of squares; a
    zero row gives 0, finite gradients).

    Returns:
      ``x``'s float dtype; with ``return_stats`` a tuple ``(y, {"inv_std": stats})`` (see
      ``layer_norm``).
    """
    x = jnp.asarray(x)
    x = x.astype(_float_dtype(x))
    scale = None if scale is None else jnp.asarray(scale)
    eps = float(eps)
    branches = [
        functools.partial(lambda f, x, s: f(x, s, eps, stats=True), f)
        for f in (_rms_fast, _rms_stable, _rms_safe)
    ]
    y, st = _switch_fast_vjp(gear, branches, _FastVJP(*_rms_fast_vjp(eps)), x, scale)
    return (y, st) if return_stats else y


# ---------------------------------------------------------------------------------------------
# linear


def _dot_last(x, kernel, **kw):
    return lax.dot_general(x, kernel, (((x.ndim - 1,), (0,)), ((), ())), **kw)


def _bias_shape(bias, ndim):
    return jnp.reshape(bias, (1,) * (ndim - 1) + (-1,))


def _linear_fast(x, kernel, bias, *, precision):
    y = _dot_last(x, kernel.astype(x.dtype), precision=precision)
    if bias is not None:
        y = y + _bias_shape(bias.astype(x.dtype), y.ndim)
    return y


def _linear_stable(x, kernel, bias, *, precision):
    y = _dot_last(x, kernel.astype(x.dtype), precision=precision, preferred_element_type=_F32)
    if bias is not None:
        y = y + _bias_shape(bias.astype(_F32), y.ndim)
    return y.astype(x.dtype)


def _linear_safe(x, kernel, bias, *, precision):
    del precision
    xf, kf = x.astype(_F32), kernel.astype(_F32)
    ex, ek = _range_exponent(xf), _range_exponent(kf)
    y = _dot_last(xf * _pow2(-ex), kf * _pow2(-ek), precision=_HIGHEST)
    y = y * _pow2(ex) * _pow2(ek)
    if bias is not None:
        y = y + _bias_shape(bias.astype(_F32), y.ndim)
    return _saturate(y, x.dtype)


def linear(
    x: jax.typing.ArrayLike,
    kernel: jax.typing.ArrayLike,
    bias: jax.typing.ArrayLike | None = None,
    gear: Any = 0,
    *,
    precision: Any = None,
) -> jax.Array:
    """``x @ kernel + bias`` over the last axis of ``x``.

    FAST: ``lax.dot_general`` in ``x.dtype`` (``flax.nnx.Linear``'s math). STABLE:
    ``preferred_element_type=f32`` and the bias added in f32. SAFE: f32 operands compressed by
    powers of two, ``Precision.HIGHEST``, and a saturating cast back (an fp16 output past 65504
    is clipped to ±65504 instead of becoming inf).

    Args:
      x: ``[..., in_features]``.
      kernel: ``[in_features, out_features]`` (cast to ``x.dtype``).
      bias: ``[out_features]`` or None.
      gear: FAST/STABLE/SAFE.
      precision: ``lax.Precision`` for FAST/STABLE (SAFE always uses HIGHEST).

    Returns:
      ``[..., out_features]`` in ``x``'s float dtype.
    """
    x, kernel = jnp.asarray(x), jnp.asarray(kernel)
    x = x.astype(_float_dtype(x))
    bias = None if bias is None else jnp.asarray(bias)
    if x.shape[-1] != kernel.shape[0] or kernel.ndim != 2:
        raise ValueError(
            f"linear: x [..., {x.shape[-1]}] needs a kernel [{x.shape[-1]}, out], "
            f"got {kernel.shape}"
        )
    kw = dict(precision=precision)
    branches = [functools.partial(f, **kw) for f in (_linear_fast, _linear_stable, _linear_safe)]
    return switch(gear, branches, x, kernel, bias)


# ---------------------------------------------------------------------------------------------
# router


class Routing(NamedTuple):
    """The output of ``router``."""

    gates: jax.Array  # [..., top_k] renormalised weights of the chosen experts (x.dtype)
    indices: jax.Array  # i32[..., top_k] chosen experts, best first
    probs: jax.Array  # [..., num_experts] the first softmax (for a load-balancing loss)


def _router_fast(x, kernel, *, top_k, stats):
    # the write-up's router in x.dtype: scores -> softmax -> top-k -> renormalise. In fp16 a
    # score past 65504 is inf, and the softmax turns it into inf - inf = NaN
    logits = _dot_last(x, kernel.astype(x.dtype))
    probs = jax.nn.softmax(logits, axis=-1)
    top_p, idx = lax.top_k(probs, top_k)
    gates = top_p / jnp.sum(top_p, axis=-1, keepdims=True)
    return Routing(gates, idx.astype(jnp.int32), probs), (
        {"logits": _stats(logits)} if stats else None
    )


def _router_stable(x, kernel, *, top_k, stats):
    dt = x.dtype
    logits = _dot_last(x, kernel.astype(dt), preferred_element_type=_F32)
    probs = jax.nn.softmax(logits, axis=-1)
    top_p, idx = lax.top_k(probs, top_k)
    gates = top_p / jnp.sum(top_p, axis=-1, keepdims=True)
    out = Routing(gates.astype(dt), idx.astype(jnp.int32), probs.astype(dt))
    return out, ({"logits": _stats(logits)} if stats else None)


def _router_safe(x, kernel, *, top_k, stats):
    dt = x.dtype
    xf, kf = x.astype(_F32), kernel.astype(_F32)
    ex = _range_exponent(xf, axis=-1, keepdims=True)  # per token
    ek = _range_exponent(kf)
    lc = _dot_last(xf * _pow2(-ex), kf * _pow2(-ek), precision=_HIGHEST)  # |lc| <= in_features
    mx = lax.stop_gradient(jnp.max(lc, axis=-1, keepdims=True))
    mx = jnp.where(jnp.isfinite(mx), mx, 0.0)
    d = (lc - mx) * _pow2(ex) * _pow2(ek)  # shifted true logits: max exactly 0, others may be -inf
    probs = _kernels().safe_softmax(d, axis=-1)
    top_p, idx = lax.top_k(probs, top_k)
    denom = jnp.sum(top_p, axis=-1, keepdims=True)  # >= the top-1 prob >= 1/num_experts
    ok = denom > 0
    gates = jnp.where(ok, top_p / jnp.where(ok, denom, 1.0), 1.0 / top_k)
    out = Routing(_saturate(gates, dt), idx.astype(jnp.int32), _saturate(probs, dt))
    st = {"logits": _stats(lc * _pow2(ex) * _pow2(ek))} if stats else None
    return out, st


def router(
    x: jax.typing.ArrayLike,
    kernel: jax.typing.ArrayLike,
    top_k: int,
    gear: Any = 0,
    *,
    return_stats: bool = False,
):
    """MoE top-k gate: scores ``x @ kernel`` → softmax → top-k → renormalise.

    FAST: the write-up's router, in ``x.dtype``: softmax, top-k, and the chosen probabilities
    renormalised (the write-up's "two softmaxes": the renormalisation is a softmax over the
    chosen scores; dividing by their sum is the same number). In fp16 a score past 65504 is
    inf, and the softmax turns it into NaN (inf - inf). STABLE: scores accumulated in f32, both
    steps in f32. SAFE: f32 operands compressed by powers
    of two (scores cannot overflow), the shift by the max applied before the compression is
    undone, ``kernels.safe_softmax``; gates and probabilities finite with finite gradients.

    Args:
      x: ``[..., in_features]`` token representations.
      kernel: ``[in_features, num_experts]``.
      top_k: experts per token (static).
      gear: FAST/STABLE/SAFE.
      return_stats: also return ``{"logits": detector.stats(scores)}``.

    Returns:
      ``Routing(gates [..., top_k], indices i32[..., top_k], probs [..., num_experts])``; with
      ``return_stats`` a tuple ``(routing, stats)``.
    """
    x, kernel = jnp.asarray(x), jnp.asarray(kernel)
    x = x.astype(_float_dtype(x))
    if kernel.ndim != 2 or kernel.shape[0] != x.shape[-1]:
        raise ValueError(
            f"router: x [..., {x.shape[-1]}] needs a kernel [{x.shape[-1]}, num_experts], "
            f"got {kernel.shape}"
        )
    top_k = operator.index(top_k)
    if not 1 <= top_k <= kernel.shape[1]:
        raise ValueError(f"router: top_k must be in [1, {kernel.shape[1]}], got {top_k}")
    kw = dict(top_k=top_k, stats=bool(return_stats))
    branches = [functools.partial(f, **kw) for f in (_router_fast, _router_stable, _router_safe)]
    out, st = switch(gear, branches, x, kernel)
    return (out, st) if return_stats else out


# ---------------------------------------------------------------------------------------------
# cross-entropy


def _masked_mean_plain(nll, mask):
    nll = nll.astype(_F32)
    if mask is None:
        return jnp.mean(nll)
    return jnp.sum(jnp.where(mask, nll, 0.0)) / jnp.sum(mask, dtype=_F32)  # no tokens: 0/0


def _ce_fast(logits, labels, mask):
    # probabilities, then log: a probability that underflows to 0 gives log 0 = -inf, and its
    # gradient 0 · inf = NaN (the write-up's "log of 0"); all in the logits' dtype
    probs = jax.nn.softmax(logits, axis=-1)
    p = jnp.take_along_axis(probs, labels[..., None], axis=-1)[..., 0]
    return _masked_mean_plain(-jnp.log(p), mask)


def _ce_stable(logits, labels, mask):
    logp = jax.nn.log_softmax(logits.astype(_F32), axis=-1)
    nll = -jnp.take_along_axis(logp, labels[..., None], axis=-1)[..., 0]
    return _masked_mean_plain(nll, mask)


def _ce_safe(logits, labels, mask):
    kern = _kernels()
    xf = logits.astype(_F32)
    m = lax.stop_gradient(jnp.max(xf, axis=-1, keepdims=True))
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    z = xf - m  # <= 0; the max entry is exactly 0 so the sum below is >= 1 (never log 0)
    s = kern.safe_sum(jnp.exp(z), axis=-1)
    zl = jnp.take_along_axis(z, labels[..., None], axis=-1)[..., 0]
    logp = zl - jnp.log(jnp.where(s >= 1.0, s, 1.0))  # where, not maximum: no split gradient
    # clamp: a -inf label logit (log of an exactly-zero probability) counts as a finite loss
    lo = -jnp.finfo(_F32).max
    logp = jnp.where(logp > lo, logp, lo)
    nll = -logp
    valid = jnp.ones(nll.shape, bool) if mask is None else mask
    nll = jnp.where(valid, nll, 0.0)
    total = kern.safe_sum(nll)
    count = jnp.sum(valid, dtype=_F32)
    return jnp.where(count > 0, total / jnp.maximum(count, 1.0), 0.0)


def cross_entropy(
    logits: jax.typing.ArrayLike,
    labels: jax.typing.ArrayLike,
    gear: Any = 0,
    mask: jax.typing.ArrayLike | None = None,
) -> jax.Array:
    """Mean softmax cross-entropy with integer labels, over the tokens where ``mask`` is True.

    FAST: probabilities then log, in the logits' dtype (the write-up's "log of 0"): with logits
    of ±1e5 the target's probability underflows to 0 and the loss is inf with NaN gradients;
    an all-False mask is 0/0 = NaN. STABLE: ``log_softmax`` in f32. SAFE: f32 log-space with
    a compensated denominator (>= 1, so never log 0), the loss of a -inf target logit clamped to
    finite, a compensated masked mean, and 0 when no token is selected.

    Args:
      logits: ``[..., num_classes]``.
      labels: integer ``[...]``.
      gear: FAST/STABLE/SAFE.
      mask: optional bool ``[...]``; True = count this token.

    Returns:
      f32 scalar.
    """
    logits, labels = jnp.asarray(logits), jnp.asarray(labels)
    logits = logits.astype(_float_dtype(logits))
    if not jnp.issubdtype(labels.dtype, jnp.integer):
        raise TypeError(f"cross_entropy: labels must be integers, got {labels.dtype}")
    if labels.shape != logits.shape[:-1]:
        raise ValueError(
            f"cross_entropy: labels {labels.shape} must match logits {logits.shape} without "
            "the class axis"
        )
    if mask is not None:
        mask = jnp.broadcast_to(jnp.asarray(mask, bool), labels.shape)
    return switch(gear, (_ce_fast, _ce_stable, _ce_safe), logits, labels.astype(jnp.int32), mask)
