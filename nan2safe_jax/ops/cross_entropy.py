"""Masked-mean softmax cross-entropy with FAST / STABLE / SAFE paths (returns f32)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax import lax

from nan2safe_jax.ops._numerics import (
    _F32,
    _float_dtype,
    _kernels,
)
from nan2safe_jax.ops.dispatch import switch


def _masked_mean_plain(nll, mask):
    nll = nll.astype(_F32)
    if mask is None:
        return jnp.mean(nll)
    return jnp.sum(jnp.where(mask, nll, 0.0)) / jnp.sum(mask, dtype=_F32)  # no tokens: 0/0


def _ce_fast(logits, labels, mask):
    # optax's ``softmax_cross_entropy_with_integer_labels`` in the logits' dtype: the loss a
    # flax user writes, bit for bit (a logsumexp, so huge logits are no fault; in fp16 its sum
    # of exponentials overflows past 65504 near-equal logits: a large vocabulary at init)
    nll = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
    return _masked_mean_plain(nll, mask)


def _ce_stable(logits, labels, mask):
    logp = jax.nn.log_softmax(logits.astype(_F32), axis=-1)
    nll = -jnp.take_along_axis(logp, labels[..., None], axis=-1)[..., 0]
    return _masked_mean_plain(nll, mask)


def _ce_safe(logits, labels, mask):
    kern = _kernels()
    xf = logits.astype(_F32)
    m = lax.stop_gradient(jnp.max(xf, axis=-1, keepdims=True))
    # A row of -inf only (every class excluded) shifts by 0; a NaN or +inf max stays, so that
    # row's loss is not finite: SAFE never hides a non-finite logit (nor an out-of-range
    # label's NaN fill) behind a plausible number.
    m = jnp.where(m == -jnp.inf, 0.0, m)
    z = xf - m  # <= 0; the max entry is exactly 0 so the sum below is >= 1 (never log 0)
    s = kern.safe_sum(jnp.exp(z), axis=-1)
    zl = jnp.take_along_axis(z, labels[..., None], axis=-1)[..., 0]
    # where, not maximum: no split gradient; a NaN sum stays NaN
    logp = zl - jnp.log(jnp.where(s < 1.0, 1.0, s))
    # clamp: a -inf label logit (log of an exactly-zero probability) counts as a finite loss,
    # at most f32's max over the token count, so that their sum (and mean) stays finite too
    lo = -float(jnp.finfo(_F32).max) / max(logp.size, 1)
    logp = jnp.where(logp < lo, lo, logp)
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

    FAST: what the loss a flax user writes computes, bit for bit:
    ``optax.softmax_cross_entropy_with_integer_labels`` in the logits' dtype, then its mean (over
    the masked tokens) in f32. Its faults are optax's: in fp16 the logsumexp's sum of
    ``exp(logit - max)`` overflows past 65504 (a vocabulary of more than 65504 near-equal
    logits, as at initialisation), and an all-False mask is 0/0 = NaN.
    (The write-up's FAST took probabilities, then their log: a probability that underflowed
    gave ``log 0``; it made a run whose logits grow go non-finite 20 steps before the stock
    model did.) STABLE: ``log_softmax`` in f32. SAFE: f32 log-space with
    a compensated denominator (>= 1, so never log 0), the loss of a -inf target logit clamped to
    finite (f32's max over the token count: any number of them sums to a finite loss), a
    compensated masked mean, and 0 when no token is selected; a NaN or +inf logit,
    or a label past the classes (``>= num_classes`` or ``< -num_classes``), makes its token's
    loss non-finite, as at FAST (propagated, never hidden). A label in ``[-num_classes, 0)``
    wraps around, in every gear, as optax's does (NumPy indexing): a PyTorch-style ignore index
    (``-100``) is a real class whenever there are more than 100; leave such tokens out with
    ``mask``.

    Args:
      logits: ``[..., num_classes]``.
      labels: integer ``[...]`` (see above for negative values).
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
