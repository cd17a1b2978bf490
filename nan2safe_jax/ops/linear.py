"""Dense layer matmul (``flax.nnx.Linear`` / ``LinearGeneral``) with FAST / STABLE / SAFE paths.

FAST is flax's math: ``lax.dot_general`` of the (already promoted) operands with the layer's
``precision`` and ``preferred_element_type``, then ``y += bias``. Every gear returns FAST's
output dtype (``preferred_element_type`` or the operands' dtype): ``lax.switch`` needs one
output type, and a site must not change the dtype its caller sees when the gear changes.
STABLE therefore gets its range from f32 accumulation and a *saturating* cast back (an fp16
output past 65504 becomes ±65504, not inf); SAFE adds power-of-two range compression and
``Precision.HIGHEST``. For f32 operands and output STABLE is FAST (decided at trace time):
the gears share one compiled path. Each path casts the kernel and bias itself: FAST and
STABLE to ``x``'s dtype (what flax's ``promote_dtype`` does), SAFE to f32 from the values
passed. A site passes its weights as stored (f32 master weights of an fp16 layer), so a weight
past fp16's 65504, inf once cast, is still computed by SAFE.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from nan2safe_jax.ops._numerics import (
    _F32,
    _HIGHEST,
    _float_dtype,
    _pow2,
    _range_exponent,
    _saturate,
)
from nan2safe_jax.ops.dispatch import hoisted, switch, switched_at_run_time


def _dims(x, n):
    """Contract the last ``n`` axes of ``x`` with the first ``n`` of the kernel."""
    return ((tuple(range(x.ndim - n, x.ndim)), tuple(range(n))), ((), ()))


def _add_bias(y, bias):
    if bias is None:
        return y
    return y + jnp.reshape(bias, (1,) * (y.ndim - bias.ndim) + bias.shape)


def _in_dtype(x, kernel, bias):
    """``kernel`` and ``bias`` cast to ``x``'s dtype: FAST's and STABLE's operands."""
    return kernel.astype(x.dtype), None if bias is None else bias.astype(x.dtype)


def _contract_last(x, kernel, *, n, **kw):
    """``lax.dot_general`` contracting the last ``n`` axes of ``x``: the branches' ``dot`` for
    a dense layer (``ops.conv`` passes a convolution)."""
    return lax.dot_general(x, kernel, _dims(x, n), **kw)


def _linear_fast(x, kernel, bias, *, dot, precision, pet, cdtype):
    x = x.astype(cdtype)
    kernel, bias = _in_dtype(x, kernel, bias)
    kw = {} if pet is None else {"preferred_element_type": pet}
    y = dot(x, kernel, precision=precision, **kw)
    return _add_bias(y, bias)


def _out_dtype(cdtype, pet):
    return jnp.dtype(cdtype if pet is None else pet)


def _linear_stable(x, kernel, bias, *, dot, precision, pet, cdtype):
    x = x.astype(cdtype)
    kernel, bias = _in_dtype(x, kernel, bias)
    y = dot(x, kernel, precision=precision, preferred_element_type=_F32)
    y = _add_bias(y, None if bias is None else bias.astype(_F32))
    return _saturate(y, _out_dtype(cdtype, pet))


def _linear_safe(x, kernel, bias, *, dot, precision, pet, cdtype):
    del precision
    xf, kf = x.astype(_F32), kernel.astype(_F32)
    ex, ek = _range_exponent(xf), _range_exponent(kf)
    y = dot(xf * _pow2(-ex), kf * _pow2(-ek), precision=_HIGHEST)
    y = y * _pow2(ex) * _pow2(ek)
    y = _add_bias(y, None if bias is None else bias.astype(_F32))
    return _saturate(y, _out_dtype(cdtype, pet))


def linear(
    x: jax.typing.ArrayLike,
    kernel: jax.typing.ArrayLike,
    bias: jax.typing.ArrayLike | None = None,
    gear: Any = 0,
    *,
    precision: Any = None,
    preferred_element_type: Any = None,
    contract: int = 1,
    dtype: Any = None,
) -> jax.Array:
    """``x @ kernel + bias``, contracting the last ``contract`` axes of ``x``.

    Args:
      x: ``[..., *in_shape]`` with ``len(in_shape) == contract``.
      kernel: ``[*in_shape, *out_shape]``, in any float dtype: FAST and STABLE cast it to
        ``x.dtype`` (flax's ``promote_dtype`` of the weights; the input's promotion is the
        module's job), SAFE to f32. Pass the weights as stored (f32 weights of an fp16 layer)
        so that SAFE computes from their values, not from their fp16 cast.
      bias: ``out_shape`` or None, cast like ``kernel``.
      gear: FAST/STABLE/SAFE.
      precision: ``lax.Precision`` for FAST/STABLE (SAFE always uses HIGHEST).
      preferred_element_type: FAST's accumulation and output dtype (flax's argument).
      contract: how many trailing axes of ``x`` are contracted (``LinearGeneral``'s axes).
      dtype: the dtype FAST and STABLE compute in (None: ``x``'s float dtype). ``x`` is cast
        to it inside those paths (flax's ``promote_dtype`` of the input), so SAFE reads ``x``
        as given, in f32: an fp16 layer's f32 input past 65504 stays finite there, where a
        cast before the gear is chosen made it inf at every gear.

    Returns:
      ``[..., *out_shape]`` in ``preferred_element_type`` or the compute dtype, every gear.
    """
    x, kernel = jnp.asarray(x), jnp.asarray(kernel)
    x = x.astype(_float_dtype(x))
    bias = None if bias is None else jnp.asarray(bias)
    n = int(contract)
    if kernel.ndim < n + 1 or x.shape[x.ndim - n :] != kernel.shape[:n]:
        raise ValueError(
            f"linear: x [..., {x.shape[x.ndim - n :]}] needs a kernel [{x.shape[x.ndim - n :]}, "
            f"out...], got {kernel.shape}"
        )
    pet = None if preferred_element_type is None else jnp.dtype(preferred_element_type)
    cdtype = x.dtype if dtype is None else jnp.dtype(dtype)
    dot = functools.partial(_contract_last, n=n)
    return geared_contraction(dot, x, kernel, bias, gear, precision, pet, cdtype)


def geared_contraction(
    dot, x, kernel, bias, gear, precision, pet, cdtype, *, hoist: bool = False
) -> jax.Array:
    """``dot(x, kernel) + bias`` in the gear's path: FAST (flax's), STABLE (f32 accumulation,
    saturating cast back), SAFE (f32 operands as given, power-of-two range compression,
    ``HIGHEST``); ``dot(x, kernel, precision=, [preferred_element_type=])`` is the
    contraction (``lax.dot_general``, ``lax.conv_general_dilated``).

    ``hoist`` (``ops.conv``): with a gear switched at run time on the CPU, inside the train
    step (``dispatch.hoisting``), STABLE's and SAFE's contraction runs outside the switch
    (``_hoisted``)."""
    kw = dict(dot=dot, precision=precision, pet=pet, cdtype=cdtype)
    branches = [functools.partial(f, **kw) for f in (_linear_fast, _linear_stable, _linear_safe)]
    if _stable_is_fast(cdtype, pet):
        branches[1] = branches[0]  # one path for both gears: XLA compiles it once
    if hoist and hoisted() and switched_at_run_time(gear) and jax.default_backend() == "cpu":
        return _hoisted(gear, x, kernel, bias, **kw)
    return switch(gear, branches, x, kernel, bias)


def _hoisted(gear, x, kernel, bias, *, dot, precision, pet, cdtype) -> jax.Array:
    """``geared_contraction`` with STABLE's and SAFE's contraction taken out of the switch.

    XLA:CPU gives a convolution inside a ``cond`` branch its slow generic loop when the
    convolution is one of autodiff's (the kernel's gradient reads the input as ``f01b``, a
    layout its fast convolution takes only once a pass outside the branch has transposed it):
    an fp16 ``Conv`` at STABLE or SAFE ran its forward+backward 20-35x slower than at FAST
    (newuser51: a CNN trained at 110-180 ms a step for the 64+ steps after an incident, 15 ms
    at FAST). Here both paths read one f32 contraction computed outside every ``cond``, at
    ``HIGHEST``: STABLE's of the operands cast up (exact: the same products, accumulated in
    f32, as ``preferred_element_type=f32``), SAFE's of the range-compressed ones; the switch
    picks only the operands and the scale back. FAST is as before; at FAST (the general
    program) the f32 contraction runs too, and is dropped.
    """
    stable_in = functools.partial(_stable_operands, cdtype=cdtype)
    xs, ks, ex, ek = switch(gear, [stable_in, stable_in, _safe_operands], x, kernel)
    yc = dot(xs, ks, precision=_HIGHEST)
    out = _out_dtype(cdtype, pet)
    fast = functools.partial(_linear_fast, dot=dot, precision=precision, pet=pet, cdtype=cdtype)
    branches = [
        lambda x, kernel, bias, yc, ex, ek: fast(x, kernel, bias),
        functools.partial(_stable_post, out=out, cdtype=cdtype),
        functools.partial(_safe_post, out=out),
    ]
    if _stable_is_fast(cdtype, pet):
        branches[1] = branches[0]
    return switch(gear, branches, x, kernel, bias, yc, ex, ek)


def _stable_operands(x, kernel, *, cdtype):
    """STABLE's operands (``_linear_stable``'s, in the compute dtype) cast up to f32, and zero
    exponents (the shape of ``_safe_operands``)."""
    x = x.astype(cdtype)
    kernel, _ = _in_dtype(x, kernel, None)
    zero = jnp.zeros((), jnp.int32)
    return x.astype(_F32), kernel.astype(_F32), zero, zero


def _safe_operands(x, kernel):
    """SAFE's operands (``_linear_safe``'s): f32, range-compressed, and their exponents."""
    xf, kf = x.astype(_F32), kernel.astype(_F32)
    ex, ek = _range_exponent(xf), _range_exponent(kf)
    return xf * _pow2(-ex), kf * _pow2(-ek), ex, ek


def _stable_post(x, kernel, bias, yc, ex, ek, *, out, cdtype):
    del x, kernel, ex, ek
    bias = None if bias is None else bias.astype(cdtype).astype(_F32)
    return _saturate(_add_bias(yc, bias), out)


def _safe_post(x, kernel, bias, yc, ex, ek, *, out):
    del x, kernel
    y = yc * _pow2(ex) * _pow2(ek)
    y = _add_bias(y, None if bias is None else bias.astype(_F32))
    return _saturate(y, out)


def _stable_is_fast(dtype, pet) -> bool:
    """STABLE (f32 accumulation, saturating cast back) is FAST itself for f32 operands with an
    f32 (or default) output: the same ``dot_general``, the same bias add, a no-op cast."""
    return jnp.dtype(dtype) == _F32 and (pet is None or jnp.dtype(pet) == _F32)


def _dot_last(x, kernel, **kw):
    """``x @ kernel`` over the last axis of ``x`` (the router's matmul)."""
    return lax.dot_general(x, kernel, _dims(x, 1), **kw)
