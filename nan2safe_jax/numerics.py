"""Small numerics over pytrees, in one place: finiteness, norms, selection, saturating counters.

Device-side helpers (``all_finite``, ``nonfinite_kinds``, ``sum_of_squares``,
``global_norm``, ``select_tree``, ``saturating_add``, ``computed_once``) are traceable and run
inside the jitted step. Host-side helpers (``first_nonfinite``, ``first_huge``,
``tree_is_finite``) read concrete arrays back with NumPy: the Trainer uses them on a batch
before it blames the model, and the checkpointer before it saves.

A leaf is checked for finiteness when its dtype is inexact (float, bfloat16, float8, complex);
integer, bool and PRNG-key leaves are always finite.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from nan2safe_jax.replay import _jax_compat

MAX_I32 = 2**31 - 1


def _inexact(dtype) -> bool:
    return jnp.issubdtype(dtype, jnp.inexact)


def _is_key(x) -> bool:
    return hasattr(x, "dtype") and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def floating_leaves(tree) -> list:
    """The leaves of ``tree`` with a floating (or complex) dtype."""
    return [x for x in jax.tree_util.tree_leaves(tree) if _inexact(jnp.asarray(x).dtype)]


def all_finite(tree) -> jax.Array:
    """bool[]: every floating leaf of ``tree`` is finite (True for an empty tree).

    Args:
      tree: a pytree of arrays (traced or concrete).

    Returns:
      A bool scalar array.
    """
    leaves = [jnp.all(jnp.isfinite(x)) for x in floating_leaves(tree)]
    return jnp.all(jnp.stack(leaves)) if leaves else jnp.asarray(True)


# A batch value past this (2**64, ~1.8e19) squares past f32: a norm's variance, a sum of
# squares or an L2 norm of it overflows whatever the model's dtype. No feature a model trains on
# is that large (corrupted data: uninitialised memory, a failed decode, newuser52's batch of
# 1e30), so a batch holding one is the data's fault when its step went non-finite (the train
# step's ``polluted``); a batch that trains finite with one is left alone.
HUGE_DATA = 2.0**64
# ... except a value this negative or more: a mask fill at the bottom of the range (``finfo.min``,
# as flax fills; Gemma's -2.38e38), a value the data means, as ``-inf`` is.
MASK_FILL = -1e37


def huge_values(x):
    """Where ``x`` (a real array, NumPy or JAX) holds a finite value past ``HUGE_DATA`` in
    magnitude that is not a mask fill (``MASK_FILL`` or below); both bounds rounded to ``x``'s
    dtype, as the train step compares them, so the host's verdict is the device's."""
    xp = np if isinstance(x, np.ndarray) else jnp
    huge, fill = (xp.asarray(v, x.dtype) for v in (HUGE_DATA, MASK_FILL))
    return xp.isfinite(x) & (xp.abs(x) >= huge) & (x > fill)


def nonfinite_kinds(tree) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(bool[], bool[], bool[])``: some floating leaf of ``tree`` holds a NaN or ``+inf``;
    some holds a ``-inf``; some holds a finite value of magnitude ``HUGE_DATA`` or more, not a
    mask fill (``huge_values``; real leaves only). One pass over each leaf.

    A batch's verdict (the train step's ``polluted``): ``-inf`` is the conventional mask fill
    (an additive attention bias), a value the data means, as the probes read it
    (``probe.nonfinite_count``); a NaN or ``+inf`` is not. A complex value that is not finite
    counts as the first kind. A leaf whose dtype cannot hold ``HUGE_DATA`` (fp16, float8) is
    never huge.

    Args:
      tree: a pytree of arrays (traced or concrete).
    """
    bad, minus, huge = [], [], []
    for x in floating_leaves(tree):
        x = jnp.asarray(x)  # a Python float leaf too
        wide = float(jnp.finfo(x.dtype).max) > HUGE_DATA
        if jnp.iscomplexobj(x):
            bad.append(jnp.any(~jnp.isfinite(x)))
            continue
        bad.append(jnp.any(jnp.isnan(x) | jnp.isposinf(x)))
        minus.append(jnp.any(jnp.isneginf(x)))
        if wide:
            huge.append(jnp.any(huge_values(x)))
    some = lambda flags: jnp.any(jnp.stack(flags)) if flags else jnp.asarray(False)  # noqa: E731
    return some(bad), some(minus), some(huge)


def device_view(a: np.ndarray) -> np.ndarray:
    """``a`` in the dtype the step reads it in (a float64 batch leaf is float32 there unless
    x64 is on): a host check of it then agrees with the step's."""
    return np.asarray(a, jax.dtypes.canonicalize_dtype(a.dtype))


def first_huge(tree) -> str | None:
    """Host-side scan: the key path of the first real floating leaf holding a finite value of
    magnitude ``HUGE_DATA`` or more, not a mask fill (``nonfinite_kinds``'s third verdict), or
    None."""
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if _is_key(leaf):
            continue
        a = np.asarray(leaf)
        if not _inexact(a.dtype) or np.iscomplexobj(a) or jnp.finfo(a.dtype).max <= HUGE_DATA:
            continue
        if np.any(huge_values(device_view(a))):
            return jax.tree_util.keystr(path)
    return None


# Leaves below this many elements are summed as one concatenated vector (see sum_of_squares).
SMALL_LEAF = 4096


def _unpermuted(x: jax.Array) -> jax.Array:
    """The array ``x`` is a permutation of, when the trace shows ``x`` made by a ``transpose``:
    the same values, so the same sum of squares; else ``x``.

    A kernel's gradient leaves the backward pass as ``transpose(dot_general(dy, x))``. XLA
    folds the transpose into the dot's output layout, so a reduction of the gradient reads a
    non-row-major array: on the CPU that reduction is a transposed copy (3-D kernels), a
    partial and a final reduction, where the same sum of the dot's own output is one XNNPACK
    kernel. The optimizer still reads the transposed gradient; only the sum reads around it.
    Only an f32 transpose is read through: XLA:CPU sums a bfloat16 dot's output cast to f32
    at about bfloat16's precision (5e-5 relative, measured), the transposed one at f32's.
    """
    made = _jax_compat.traced_producer(x) if x.dtype == jnp.float32 else None
    return made[1][0] if made is not None and made[0] == "transpose" else x


def sum_of_squares(tree, minus=None, large_sum=None, replicated=None) -> jax.Array:
    """f32[] sum of the squares of every leaf, in f32 (non-finite when any leaf is).

    Leaves under ``SMALL_LEAF`` elements (biases, norm scales) are concatenated and reduced
    once. A reduction is a kernel of its own, compiled separately; one per small leaf was a
    sixth of the train step's kernels (on the CPU a small reduction compiles as three: the
    squares, a partial reduction, the final one), each costing compile time, and
    concatenating a few thousand values costs nothing at run time.

    Args:
      tree: a pytree of arrays.
      minus: optional, a tree like ``tree``: the sum is of the squares of ``tree - minus``
        (both in f32), e.g. the change a step made to the parameters. The small leaves of each
        are concatenated before the subtraction, which then fuses into the one reduction (a
        subtraction per leaf ahead of the concatenation was a kernel each).
      large_sum: optional, ``(xs, ys) -> f32[]`` the sum of the large leaves' squares
        (``ys``: their ``minus`` leaves, or None), e.g. ``sharding.Rules.sum_of_squares``,
        which sums a replicated leaf a slice per device.
      replicated: optional, ``x -> bool``: whether the step keeps leaf ``x`` whole on every
        device (``sharding.Rules.replicates``). Only the small leaves it keeps whole are
        concatenated; a small leaf split over devices is summed with the large ones. One split
        leaf in the concatenation made XLA's partitioner split it all, and with it every
        replicated small leaf's update: a ZeRO-3 step of the demo model computed each bias's
        update a slice per device and gathered it back, 176 all-gathers and 80 kernels the
        plain step does not have (its 31 all-gathers are the parameters').

    Without ``minus`` or ``large_sum``, a large leaf that the trace shows is a transpose is
    summed from the transpose's operand (``_unpermuted``: one kernel instead of three or
    four on the CPU). ``large_sum`` gets the leaves as they are: it places each by its shape.
    (A data-parallel step's slices of the same leaves compiled to the same kernels either way.)

    Returns:
      f32[].
    """
    f32 = lambda t: [jnp.asarray(x, jnp.float32) for x in jax.tree_util.tree_leaves(t)]
    leaves = f32(tree)
    others = [None] * len(leaves) if minus is None else f32(minus)
    if len(others) != len(leaves):
        raise ValueError(f"sum_of_squares: minus has {len(others)} leaves, tree {len(leaves)}")
    diff = lambda x, y: x if y is None else x - y
    is_small = [x.size < SMALL_LEAF and (replicated is None or replicated(x)) for x in leaves]
    large = [(x, y) for x, y, s in zip(leaves, others, is_small, strict=True) if not s]
    if large_sum is None:
        parts = [jnp.sum(jnp.square(_unpermuted(x) if y is None else x - y)) for x, y in large]
    elif large:
        xs, ys = zip(*large, strict=True)
        parts = [large_sum(list(xs), None if minus is None else list(ys))]
    else:
        parts = []
    small = [i for i, s in enumerate(is_small) if s]
    if small:
        cat = lambda vs: jnp.concatenate([vs[i].ravel() for i in small])
        parts.append(jnp.sum(jnp.square(diff(cat(leaves), None if minus is None else cat(others)))))
    return sum(parts, jnp.zeros([], jnp.float32))


def global_norm(tree) -> jax.Array:
    """f32[] L2 norm of all leaves, in f32, without overflow.

    One pass of f32 squares (``optax.global_norm`` squares in the leaf dtype: an fp16 gradient
    of 300 squares past 65504). Only when that overflows f32 (norms past ~1e19) is the norm
    recomputed with every leaf scaled by the largest magnitude; ``lax.cond`` runs that second
    pass only then.
    """
    leaves = [jnp.asarray(x, jnp.float32) for x in jax.tree_util.tree_leaves(tree)]
    if not leaves:
        return jnp.zeros([], jnp.float32)
    sq = sum(jnp.sum(jnp.square(x)) for x in leaves)

    def rescaled():
        m = jnp.max(jnp.stack([jnp.max(jnp.abs(x), initial=0.0) for x in leaves]))
        safe_m = jnp.where((m > 0) & jnp.isfinite(m), m, 1.0)
        sq_m = sum(jnp.sum(jnp.square(x / safe_m)) for x in leaves)
        return jnp.where(jnp.isfinite(m), safe_m * jnp.sqrt(sq_m), m)

    return jax.lax.cond(jnp.isfinite(sq), lambda: jnp.sqrt(sq), rescaled)


def select_tree(pred: jax.Array, on_true, on_false):
    """Leafwise ``jnp.where(pred, on_true, on_false)`` (bit-exact on the chosen side)."""
    return jax.tree_util.tree_map(lambda a, b: jnp.where(pred, a, b), on_true, on_false)


def computed_once(fn, pred: jax.Array, *operands):
    """``fn(*operands)``, traced as both branches of a ``lax.cond`` on ``pred``.

    XLA copies a cheap computation into every kernel that reads its result, and compile
    time follows the instructions it compiles: a probe's statistics (a chain of scalar
    operations after its reduction) went both into the kernel that writes the probe's
    variable and into the detector's stack of all probes, ~400 fused instructions of the
    demo's step. A conditional's operands are values XLA computes once, before it: both
    branches then read them. Both branches are ``fn``, so ``pred`` decides nothing; it must
    only be unknown until run time (a constant one is folded away, and so is a branch that
    returns an operand unchanged: ``fn`` must compute something). The cost at run time is one
    conditional.

    Args:
      fn: ``(*operands) -> result``.
      pred: any bool[] known only at run time.
      *operands: ``fn``'s arguments (pytrees of arrays).

    Returns:
      ``fn(*operands)``.
    """
    return jax.lax.cond(pred, fn, fn, *operands)


def saturating_add(x: jax.typing.ArrayLike, by: jax.typing.ArrayLike = 1) -> jax.Array:
    """``x + by`` in int32, clamped at ``MAX_I32`` instead of wrapping to a negative count.

    The comparison is made before the addition: ``jnp.minimum(x + 1, MAX_I32)`` would wrap
    first (``MAX_I32 + 1 == -2**31`` in int32) and then keep the wrapped value.

    Args:
      x: int32 counter(s).
      by: a non-negative int32 increment (scalar or broadcastable).

    Returns:
      int32, same shape as ``x``.
    """
    x = jnp.asarray(x, jnp.int32)
    by = jnp.asarray(by, jnp.int32)
    return jnp.where(x >= MAX_I32 - by, MAX_I32, x + by).astype(jnp.int32)


def first_nonfinite(tree, minus_inf: bool = True) -> str | None:
    """Host-side scan: the key path of the first leaf holding a NaN or inf, or None.

    Args:
      tree: a pytree of concrete arrays (NumPy or JAX; one device-to-host copy per leaf).
      minus_inf: count ``-inf``; False finds the first leaf holding a NaN or ``+inf`` (a
        batch's pollution, see ``nonfinite_kinds``).

    Returns:
      ``jax.tree_util.keystr`` of the first non-finite leaf, or None when all are finite.
    """
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if _is_key(leaf):
            continue
        a = np.asarray(leaf)
        if not _inexact(a.dtype):
            continue
        if np.iscomplexobj(a):
            bad = ~np.isfinite(a)
        else:
            a = a.astype(np.float32)
            bad = ~np.isfinite(a) if minus_inf else np.isnan(a) | np.isposinf(a)
        if np.any(bad):
            return jax.tree_util.keystr(path)
    return None


def tree_is_finite(tree) -> bool:
    """Host-side check: every floating leaf of ``tree`` is finite (see ``first_nonfinite``)."""
    return first_nonfinite(tree) is None
