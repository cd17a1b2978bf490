"""Convolution (``flax.nnx.Conv``'s ``lax.conv_general_dilated`` and bias) with FAST / STABLE /
SAFE paths: ``ops.linear``'s three paths (``linear.geared_contraction``) with the convolution as
the contraction. FAST is flax's math (the promoted operands, the layer's ``precision`` and
``preferred_element_type``, ``y += bias``); STABLE accumulates in f32 and casts back saturating
(an fp16 output past 65504 is ±65504, not inf); SAFE convolves the operands as given in f32,
range-compressed by powers of two, at ``Precision.HIGHEST``. Every gear returns FAST's dtype.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from nan2safe_jax.ops._numerics import _float_dtype
from nan2safe_jax.ops.linear import geared_contraction


def conv(
    x: jax.typing.ArrayLike,
    kernel: jax.typing.ArrayLike,
    bias: jax.typing.ArrayLike | None = None,
    gear: Any = 0,
    *,
    strides: Sequence[int],
    padding: str | Sequence[tuple[int, int]],
    lhs_dilation: Sequence[int] | None = None,
    rhs_dilation: Sequence[int] | None = None,
    dimension_numbers: Any = None,
    feature_group_count: int = 1,
    precision: Any = None,
    preferred_element_type: Any = None,
    dtype: Any = None,
) -> jax.Array:
    """``lax.conv_general_dilated(x, kernel, ...) + bias`` in the gear's path.

    Args:
      x: the input, laid out as ``dimension_numbers`` says (flax: ``NHWC``).
      kernel: in any float dtype; FAST and STABLE cast it to the compute dtype (flax's
        ``promote_dtype``), SAFE to f32: pass the weights as stored (a mask applied).
      bias: ``[out_features]`` or None, cast like ``kernel``.
      gear: FAST/STABLE/SAFE.
      strides, padding, lhs_dilation, rhs_dilation, dimension_numbers, feature_group_count:
        ``lax.conv_general_dilated``'s (padding as a string or explicit pairs).
      precision: for FAST/STABLE (SAFE always uses HIGHEST).
      preferred_element_type: FAST's accumulation and output dtype (flax's argument).
      dtype: the dtype FAST and STABLE compute in (None: ``x``'s float dtype); SAFE reads ``x``
        as given, in f32 (``ops.linear``).

    Returns:
      The convolution, in ``preferred_element_type`` or the compute dtype, every gear.
    """
    x, kernel = jnp.asarray(x), jnp.asarray(kernel)
    x = x.astype(_float_dtype(x))
    bias = None if bias is None else jnp.asarray(bias)
    pet = None if preferred_element_type is None else jnp.dtype(preferred_element_type)
    cdtype = x.dtype if dtype is None else jnp.dtype(dtype)
    dot = functools.partial(
        lax.conv_general_dilated,
        window_strides=tuple(strides),
        padding=padding,
        lhs_dilation=lhs_dilation,
        rhs_dilation=rhs_dilation,
        dimension_numbers=dimension_numbers,
        feature_group_count=feature_group_count,
    )
    return geared_contraction(dot, x, kernel, bias, gear, precision, pet, cdtype, hoist=True)
