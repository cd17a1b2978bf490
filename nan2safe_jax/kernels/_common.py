"""Shared machinery of the safe kernels: error-free transforms, dispatch, fallback.

Everything here works on plain ``jax.Array`` values, so the same helpers run inside a Pallas
kernel body (interpret mode, Triton lowering) and in the pure-jnp references.

Compensation and the compiler. The two-sum expressions below (``(s - t) + v`` and friends)
are algebraically zero; a compiler allowed to reassociate floating-point arithmetic
("fast-math") may fold them away and silently turn the compensated sum back into the naive
one. XLA (CPU and GPU) and Triton do not reassociate floating-point adds by default, and
``tests/test_kernels.py`` checks numerically, on data where the naive sum is off by orders of
magnitude, that the compensated result is still within a few ulps of ``math.fsum``. Do not
run these kernels with ``--xla_cpu_enable_fast_math=true`` or similar flags.

References:
  Kahan, W. (1965). Further remarks on reducing truncation errors. CACM 8(1).
  Neumaier, A. (1974). Rundungsfehleranalyse einiger Verfahren zur Summation endlicher
    Summen. ZAMM 54(1).
  Knuth, D. E. (1969). The Art of Computer Programming, vol. 2 (TwoSum).
  Chan, T. F., Golub, G. H., LeVeque, R. J. (1983). Algorithms for computing the sample
    variance. The American Statistician 37(3) (corrected two-pass variance).
"""

from __future__ import annotations

import functools
import os
import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

IMPLEMENTATIONS = (None, "pallas", "reference")
INTERPRET_ENV = "NAN2SAFE_KERNEL_INTERPRET"

# ---------------------------------------------------------------------------------------------
# dtypes


def acc_dtype(backend: str | None = None) -> jnp.dtype:
    """Accumulation dtype: f64 when x64 is on and the backend has f64 (not TPU), else f32."""
    if jax.config.jax_enable_x64 and (backend or jax.default_backend()) != "tpu":
        return jnp.dtype(jnp.float64)
    return jnp.dtype(jnp.float32)


def check_float(x: jax.Array, name: str, op: str) -> None:
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(
            f"{op}: {name} must have a floating dtype, got {x.dtype}; "
            f"cast it first, e.g. {name}.astype(jnp.float32)"
        )


def next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def round_up(n: int, m: int) -> int:
    return -(-n // m) * m


# ---------------------------------------------------------------------------------------------
# error-free transforms (elementwise; valid inside Pallas kernels)


def isfinite(x: jax.Array) -> jax.Array:
    return jnp.isfinite(x)


def neumaier_add(s: jax.Array, c: jax.Array, v: jax.Array) -> tuple[jax.Array, jax.Array]:
    """One Neumaier step, elementwise: ``s + c`` absorbs ``v`` with its rounding error.

    The error term is dropped (0) when the new partial sum is not finite, so an inf input
    gives an inf sum (not the NaN of ``inf - inf`` in the compensation).
    """
    t = s + v
    err = jnp.where(jnp.abs(s) >= jnp.abs(v), (s - t) + v, (v - t) + s)
    err = jnp.where(isfinite(t), err, jnp.zeros_like(err))
    return t, c + err


def two_sum(a: jax.Array, b: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Knuth's branch-free TwoSum: ``a + b == s + e`` exactly (finite case)."""
    s = a + b
    bb = s - a
    e = (a - (s - bb)) + (b - bb)
    return s, jnp.where(isfinite(s), e, jnp.zeros_like(e))


def lane_combine(s: jax.Array, c: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Compensated pairwise combine along the last axis (a power of two wide) -> width 1.

    Uses ``jnp.split`` into halves (lowered by Triton as ``tt.split``) and a TwoSum per pair;
    the rounding errors go into the compensation, which is summed alongside.
    """
    width = s.shape[-1]
    if width & (width - 1):
        raise ValueError(f"lane_combine needs a power-of-two width, got {width}")
    while s.shape[-1] > 1:
        sa, sb = jnp.split(s, 2, axis=-1)
        ca, cb = jnp.split(c, 2, axis=-1)
        s, e = two_sum(sa, sb)
        c = (ca + cb) + e
    return s, c


def tree_sum(s: jax.Array, c: jax.Array | None = None) -> jax.Array:
    """Compensated sum over the last axis of any width (pads to a power of two with 0)."""
    if c is None:
        c = jnp.zeros_like(s)
    n = s.shape[-1]
    width = next_pow2(n)
    if width != n:
        pad = [(0, 0)] * (s.ndim - 1) + [(0, width - n)]
        s = jnp.pad(s, pad)
        c = jnp.pad(c, pad)
    s, c = lane_combine(s, c)
    return (s + c)[..., 0]


def pow2_scale(amax: jax.Array) -> jax.Array:
    """An exact power of two ``sc`` with ``amax * sc`` in [1, 4) (dynamic range compression).

    Built from the exponent bits, so it is exact on every backend (no exp2/log2 rounding).
    ``amax`` must be >= 0; zero, subnormal, inf and NaN give a finite power of two.
    """
    dt = jnp.dtype(amax.dtype)
    if dt == jnp.float64:
        ity, mant, bias, emax = jnp.int64, 52, 1023, 2046
    elif dt == jnp.float32:
        ity, mant, bias, emax = jnp.int32, 23, 127, 254
    else:
        raise TypeError(f"pow2_scale expects f32 or f64, got {dt}")
    bits = lax.bitcast_convert_type(amax, ity)
    biased = lax.shift_right_logical(bits, jnp.asarray(mant, ity)) & jnp.asarray(2 * bias + 1, ity)
    # amax = 1.m * 2**(biased - bias); want sc = 2**(bias - biased) -> biased exponent of sc is
    # 2*bias - biased, clamped to the normal range [1, emax].
    sc_biased = jnp.clip(jnp.asarray(2 * bias, ity) - biased, 1, emax)
    return lax.bitcast_convert_type(lax.shift_left(sc_biased, jnp.asarray(mant, ity)), dt)


# ---------------------------------------------------------------------------------------------
# dispatch


def _default_backend() -> str:
    return jax.default_backend()


def interpret_default(backend: str | None = None) -> bool:
    """Interpret mode unless compiled Pallas is possible; ``NAN2SAFE_KERNEL_INTERPRET`` overrides.

    ``NAN2SAFE_KERNEL_INTERPRET=0`` forces compiled kernels (GPU check), ``=1`` forces
    interpret mode; unset: interpret on CPU only.
    """
    env = os.environ.get(INTERPRET_ENV, "").strip().lower()
    if env in ("0", "false", "no"):
        return False
    if env in ("1", "true", "yes"):
        return True
    return (backend or _default_backend()) == "cpu"


def resolve(implementation: str | None, op: str) -> tuple[str, bool]:
    """Maps ``implementation`` to ``("pallas" | "reference", interpret)``.

    None picks compiled Pallas on GPU/TPU and the jnp reference on CPU (where Pallas only
    interprets, which is slow); "pallas" on CPU runs the kernel in interpret mode.
    """
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(
            f"{op}: implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}"
        )
    backend = _default_backend()
    if implementation == "reference":
        return "reference", False
    if implementation == "pallas":
        return "pallas", interpret_default(backend)
    if backend in ("gpu", "cuda", "rocm", "tpu"):
        return "auto", interpret_default(backend)
    return "reference", False


_PROBED: dict[Any, bool] = {}
_WARNED: set[str] = set()


def pallas_compiles(op: str, key: Any, fn: Callable[..., Any], *avals: Any) -> bool:
    """True when ``fn`` (a Pallas entry point) lowers and compiles for these avals.

    Cached per ``(op, key)``; on failure warns once per op. Used by ``implementation=None``
    so that a kernel the installed backend cannot lower falls back to the reference instead
    of failing the whole jitted step at compile time.
    """
    full_key = (op, key, _default_backend())
    if full_key not in _PROBED:
        structs = [None if a is None else jax.ShapeDtypeStruct(a.shape, a.dtype) for a in avals]
        try:
            jax.jit(fn).lower(*structs).compile()
            ok = True
        except Exception as exc:  # noqa: BLE001 - any lowering/compile error means "fall back"
            ok = False
            if op not in _WARNED:
                _WARNED.add(op)
                warnings.warn(
                    f"nan2safe_jax.kernels.{op}: the Pallas kernel did not lower/compile on "
                    f"backend {_default_backend()!r} ({type(exc).__name__}: "
                    f"{str(exc).splitlines()[0] if str(exc) else ''}); using the jnp reference "
                    "(same semantics, XLA speed). Pass implementation='pallas' to see the error.",
                    RuntimeWarning,
                    stacklevel=3,
                )
        _PROBED[full_key] = ok
    return _PROBED[full_key]


@functools.cache
def gpu_compiler_params() -> Any:
    """Compiler params for the GPU lowering, or None when no GPU Pallas backend is importable.

    We target the Triton lowering explicitly: the kernels need lane-wise ``jnp.split``
    (``tt.split``) and small-row reductions that the Mosaic GPU lowering of ``pl.pallas_call``
    does not accept for untiled layouts (and ``pl.pallas_call`` on Mosaic GPU is itself
    deprecated in favour of ``plgpu.kernel``). See kernels/README.md.
    """
    try:
        from jax.experimental.pallas import triton as pltriton
    except Exception:  # noqa: BLE001 - no GPU Pallas support in this jaxlib
        return None
    return pltriton.CompilerParams(num_warps=4, num_stages=1)


def compiler_params(interpret: bool) -> Any:
    if interpret:
        return None
    backend = _default_backend()
    if backend in ("gpu", "cuda", "rocm"):
        return gpu_compiler_params()
    return None


def row_blocks(
    rows: int, cols: int, interpret: bool, block_rows: int | None, lanes: int | None
) -> tuple[int, int, int, int]:
    """Tiles for the row kernels (softmax, norms): ``(block_rows, lanes, cols_pad, rows_pad)``.

    A grid step owns whole rows (``cols_pad`` = ``cols`` rounded up to a power of two, at
    least ``lanes``) and walks them ``lanes`` columns at a time, so row length is not limited
    by registers. Interpret mode uses wide lanes and up to ~2**20 elements per tile (few grid
    steps); compiled (GPU) uses 8 x 128 chunks.
    """
    if interpret:
        lanes = lanes or 1024
        cap_rows = 256
    else:
        lanes = lanes or 128
        cap_rows = 8
    cols_pad = next_pow2(max(cols, 1))
    lanes = min(lanes, cols_pad)
    if block_rows is None:
        budget = (1 << 20) // cols_pad if interpret else cap_rows
        block_rows = max(1, min(cap_rows, next_pow2(rows), 1 << (max(budget, 1).bit_length() - 1)))
    rows_pad = round_up(max(rows, 1), block_rows)
    return block_rows, lanes, cols_pad, rows_pad


def pad2d(x: jax.Array, rows_pad: int, cols_pad: int, value: Any = 0) -> jax.Array:
    r, c = x.shape
    if (r, c) == (rows_pad, cols_pad):
        return x
    return jnp.pad(x, ((0, rows_pad - r), (0, cols_pad - c)), constant_values=value)


def row_pallas_call(kernel, args, in_specs, *, rows_pad, cols_pad, bm, out_dtype, interpret, name):
    """Launches a row kernel over ``rows_pad // bm`` blocks of ``bm`` full rows.

    Returns the kernel's two outputs: the ``[rows_pad, cols_pad]`` result in ``out_dtype`` and
    the ``[rows_pad, 1]`` int32 count of non-finite inputs per row.
    """
    from jax.experimental import pallas as pl

    return pl.pallas_call(
        kernel,
        out_shape=(
            jax.ShapeDtypeStruct((rows_pad, cols_pad), out_dtype),
            jax.ShapeDtypeStruct((rows_pad, 1), jnp.int32),
        ),
        grid=(rows_pad // bm,),
        in_specs=in_specs,
        out_specs=(
            pl.BlockSpec((bm, cols_pad), lambda i: (i, 0)),
            pl.BlockSpec((bm, 1), lambda i: (i, 0)),
        ),
        interpret=interpret,
        compiler_params=compiler_params(interpret),
        name=name,
    )(*args)
