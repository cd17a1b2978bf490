"""Ops with FAST, STABLE and SAFE paths, selected by a gear that may be traced.

The write-up's three NaN sources live in a handful of ops: the q·k logits and softmax of
attention, the MoE router's two softmaxes, the statistics of LayerNorm / RMSNorm, and the log of
the cross-entropy. Each op here has three paths (docs/design.md, "Gears"):

- **FAST** (``Gear.FAST == 0``): exactly what the ``flax.nnx`` layer computes (for attention,
  norms and linear: flax's formulas and dtype promotion; its backward is JAX's autodiff of
  that formula); it costs what flax costs and has flax's faults, no more (the adversarial
  tests show each one).
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
else, notably a traced int32 scalar inside ``jit``, goes through ``dispatch.switch``: FAST as
plain step code (fused with its neighbours as the ``flax.nnx`` layer would be), then one
``cond`` that passes FAST's value through at FAST or runs the STABLE / SAFE path. One compile
serves all three gears, and switching the gear never retraces or recompiles. The ``cond`` on
an unbatched scalar executes one branch only.

vmap behaviour: under ``jax.vmap`` with an *unbatched* gear (``in_axes=None``, or a gear closed
over), the switch stays a switch and still runs one branch. With a *batched* gear (one gear per
vmapped element), JAX turns the ``cond`` into a ``select`` over the outputs of all three
branches: the result is still the per-element gear's result, but every branch is computed.
``nan2safe_jax.nn`` therefore never vmaps a gear: under ``nnx.scan`` over layers each layer's
gear is sliced to a scalar before the op sees it.

All branches return the input's float dtype (``cross_entropy`` returns f32): a ``cond``
needs one output type, and the dtype a caller sees must not depend on the gear. So for an fp16
site STABLE does not return bf16; its range comes from f32 computation and a *saturating*
cast back (an fp16 output past 65504 becomes ±65504, not inf), and bf16 sites accumulate in
f32.

Layout (mirrors ``nan2safe_jax.kernels``): one module per op family (``softmax`` with
``logsumexp``, ``attention``, ``norms``, ``linear``, ``conv``, ``router``, ``cross_entropy``), the
gear dispatch in ``dispatch`` and the SAFE paths' numerics in ``_numerics``.
"""

from nan2safe_jax.gear import Gear
from nan2safe_jax.ops._numerics import _pow2, _range_exponent, _saturate
from nan2safe_jax.ops.attention import attention
from nan2safe_jax.ops.conv import conv
from nan2safe_jax.ops.cross_entropy import cross_entropy
from nan2safe_jax.ops.dispatch import _FastVJP, _static_gear, _switch_fast_vjp, branch_site, switch
from nan2safe_jax.ops.linear import linear
from nan2safe_jax.ops.norms import batch_norm, layer_norm, rms_norm
from nan2safe_jax.ops.router import Routing, router
from nan2safe_jax.ops.softmax import logsumexp, softmax
from nan2safe_jax.probe import op_stats as _stats

__all__ = [
    "FAST",
    "STABLE",
    "SAFE",
    "Routing",
    "attention",
    "conv",
    "cross_entropy",
    "batch_norm",
    "layer_norm",
    "linear",
    "logsumexp",
    "branch_site",
    "rms_norm",
    "router",
    "softmax",
    "switch",
]

FAST, STABLE, SAFE = Gear.FAST, Gear.STABLE, Gear.SAFE
NUM_GEARS = len(Gear)

# Old private names of the single-module ops.py, kept importable.
_COMPAT = (_FastVJP, _pow2, _range_exponent, _saturate, _static_gear, _stats, _switch_fast_vjp)
