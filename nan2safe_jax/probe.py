"""The probe vector: five statistics of one tensor, their names, and every producer of them.

A probe is ``f32[NUM_STATS]``: ``max_abs``, ``mean``, ``var``, ``nonfinite``, ``headroom``
(``max_abs / finfo(dtype).max``; 1 once a ``+inf`` is present; a ``-inf`` mask fill is
neither non-finite nor an overflow). The detector scores ``max_abs``
against its EMA baseline and ``headroom`` against ``headroom_limit`` (docs/design.md, "Tier 1").
Index a probe (or a stack of probes, ``[..., NUM_STATS]``) with the named indices below, never
with bare integers.

Producers, from most to least thorough:

- ``stats``: every statistic of every element (one fused sweep); the reference.
- ``op_stats``: ``stats`` behind ``stop_gradient``, for the probes the ops return.
- ``sampled_stats``: ``stats`` of evenly strided rows (``sample_rows``), for large activations.
- ``cheap_stats``: one ``max(|y|)`` reduction, for Linear / Embed outputs.
- ``scalar_stats``: a scalar (a norm) laid out as a probe.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math
from collections.abc import Iterator, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

STATS = ("max_abs", "mean", "var", "nonfinite", "headroom")
NUM_STATS = len(STATS)
MAX_ABS, MEAN, VAR, NONFINITE, HEADROOM = range(NUM_STATS)

PROBE_SAMPLE = 8192  # elements read by a sampled probe

# The probe kinds a site can write, by what they watch (``Config.probes`` selects among them):
PROBE_KINDS = (
    "attn_logits",  # MultiHeadAttention.probe_logits: each query row's max logit (the row max
    # the softmax computes anyway)
    "attn_probs",  # MultiHeadAttention.probe_probs: each row's max probability (an extra
    # reduction over [b, h, q, k])
    "norm_inv_std",  # LayerNorm / RMSNorm.probe_inv_std: every row's 1/sqrt(var + eps)
    "norm_output",  # LayerNorm / RMSNorm.probe_output: row-sampled output statistics
    "norm_input",  # LayerNorm / RMSNorm.probe_input: every row's RMS sqrt(E[x^2]) in the
    # input's dtype, from the statistics the norm takes anyway (the residual stream's scale)
    "router_logits",  # Router.probe_logits: the scores ([tokens, experts], small)
    "loss_logits",  # CrossEntropy.probe_logits: row-sampled logits entering the loss
    "linear_output",  # Linear / Embed.probe_output, only where built with probe=True
)
# The default, chosen by measurement (benchmarks/probe_set.py, docs/probe_set.json): every kind
# but ``attn_probs`` (a full extra pass over the attention weights; ``attn_logits`` watches the
# same rows) and ``norm_output``. ``attn_logits`` and ``router_logits`` give the default its 10
# steps of lead on the zoo's q·k and router growth; only ``norm_input`` sees a growing residual
# stream (10 steps of lead there) and only ``loss_logits`` growing LM-head logits (14 steps).
# ``norm_output`` added no lead on any scenario (a normalised output is bounded by
# construction) and was the costliest norm probe (a sampled output and a full statistics
# sweep); ``norm_inv_std`` stays: it is what sees a variance collapse. The number of probes is
# unchanged by the swap (one per norm either way), so the thresholds (Bonferroni over probes)
# are the same; benchmarks/false_alarms.py was re-run with this set.
DEFAULT_PROBES = tuple(k for k in PROBE_KINDS if k not in ("attn_probs", "norm_output"))

# The name scope every probe statistic is traced under. What a statistic computes is monitoring:
# an inf it makes inside (the sum of squares of finite values past ~1.2e24, saturated to a
# finite statistic) is never a fault of the model, and tier 2 does not name it
# (``replay.interpret``). An inf it reads is flagged where it was made, outside the scope.
MONITOR_SCOPE = "nan2safe_monitor"


def monitoring(fn):
    """``fn``, traced under ``MONITOR_SCOPE``."""

    @functools.wraps(fn)
    def scoped(*args, **kwargs):
        with jax.named_scope(MONITOR_SCOPE):
            return fn(*args, **kwargs)

    return scoped


_ENABLED: contextvars.ContextVar[frozenset[str] | None] = contextvars.ContextVar(
    "nan2safe_probes", default=None
)


@contextlib.contextmanager
def probe_set(kinds):
    """Sites traced inside this block compute only the probe kinds in ``kinds``.

    The train step enters it with ``Config.probes``; outside any block every kind is on, so a
    module called directly writes all its probes. A kind that is off is not traced at all (its
    ``Probe`` variable keeps the value it had: in the train step, which rebuilds the site
    variables each step (``site.SiteTemplate``), zeros; the step leaves it out of the detector).
    """
    token = _ENABLED.set(frozenset(kinds))
    try:
        yield
    finally:
        _ENABLED.reset(token)


_PARTITIONED: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "nan2safe_partitioned", default=False
)


@contextlib.contextmanager
def partitioned(on: bool = True):
    """Probes traced inside this block reduce in the form XLA partitions over devices (plain
    sums and maxima, see ``stats``); a sharded step (``train_step(partitioned=True)``, which
    ``make_train_step`` passes with a mesh or rules) traces inside one. A ``jax.jit``'s trace
    cache does not key on it: a function jitted inside the model and traced outside the block
    first keeps its one-reduction probes (correct values, gathered under sharding)."""
    token = _PARTITIONED.set(on)
    try:
        yield
    finally:
        _PARTITIONED.reset(token)


def probe_enabled(kind: str) -> bool:
    """Whether probe kind ``kind`` (one of ``PROBE_KINDS``) is computed in the current trace."""
    on = _ENABLED.get()
    return on is None or kind in on


@jax.tree_util.register_pytree_node_class
class NamedValues(Mapping):
    """One value per name, held as one array: a read-only mapping ``name -> values[i]``.

    A step's ``metrics["probe_risk"]``: as a dict of scalars it was one output buffer per probe,
    each a kernel of its own (XLA copies a slice of a vector into each, and fused each probe's
    risk computation into its slice: 26 kernels in the demo step); as one vector it is one.
    A pytree with the names as static data, so it passes through ``jit`` and
    ``jax.device_get`` (which turns ``values`` into a NumPy array: reads are then free).

    Args:
      names: the names, in the order of ``values``.
      values: ``[len(names), ...]``.
    """

    def __init__(self, names: tuple[str, ...], values: Any):
        self.names = tuple(names)
        self.values = values
        self._index = {n: i for i, n in enumerate(self.names)}

    def __getitem__(self, name: str) -> Any:
        return self.values[self._index[name]]

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)

    def __repr__(self) -> str:
        return f"NamedValues({dict(self)!r})"

    def tree_flatten(self):
        return (self.values,), self.names

    @classmethod
    def tree_unflatten(cls, names, children):
        return cls(names, children[0])


class ProbeStats(NamedTuple):
    """A named view of ``f32[..., NUM_STATS]``: each field is ``f32[...]``."""

    max_abs: jax.Array
    mean: jax.Array
    var: jax.Array
    nonfinite: jax.Array
    headroom: jax.Array

    @classmethod
    def of(cls, s: jax.typing.ArrayLike) -> ProbeStats:
        """Splits the last axis of ``s`` (``[..., NUM_STATS]``) into named fields."""
        s = jnp.asarray(s)
        return cls(*(s[..., i] for i in range(NUM_STATS)))


def _finfo_max(dtype) -> float:
    dtype = jnp.dtype(dtype)
    if jnp.issubdtype(dtype, jnp.floating):
        return float(jnp.finfo(dtype).max)
    return float(jnp.iinfo(dtype).max) if jnp.issubdtype(dtype, jnp.integer) else 1.0


def nonfinite_count(xf: jax.Array) -> jax.Array:
    """Elements that are NaN or ``+inf``; ``-inf`` is not counted.

    ``-inf`` is the conventional mask fill (attention scores of masked keys, ``exp(-inf) = 0``):
    an intentional value, not a fault. A real overflow toward ``-inf`` is seen coming through
    the headroom of the finite values, and its consequences (NaN, ``+inf``) are counted here
    and by the step's loss/gradient check.
    """
    bad = jnp.isnan(xf) | (xf == jnp.inf)
    return jnp.sum(bad, dtype=jnp.float32)


def rows_finite(s: jax.Array) -> jax.Array:
    """bool[...]: each probe row of ``s`` (``[..., NUM_STATS]``) read no NaN and no ``+inf``:
    its ``nonfinite`` count is 0 and its ``max_abs`` finite (a ``-inf`` mask fill is
    neither). What the detector scores, and what a step's ``finite`` asks of the model's
    probes (``train.model_probes_nonfinite``, ``decode``)."""
    return (s[..., NONFINITE] == 0) & jnp.isfinite(s[..., MAX_ABS])


def headroom(max_abs: jax.Array, overflow: jax.Array, dtype, limit: float | None = None):
    """``max_abs / finfo(dtype).max`` of the finite values (``max_abs / limit`` with a
    ``limit``); 1 when a ``+inf`` is present.

    Needs no baseline, so the detector uses it from the first step. ``-inf`` (a mask fill) does
    not count as headroom 1 (see ``nonfinite_count``).
    """
    big = _finfo_max(dtype) if limit is None else float(limit)
    return jnp.where(overflow, 1.0, _fraction_of(max_abs, big))


def _fraction_of(v: jax.Array, big: float) -> jax.Array:
    """``v / big`` for ``v >= 0`` and a constant ``big`` up to f32's max.

    XLA turns a division by a constant into a multiply by its reciprocal (and folds a chain of
    constant multiplies into one), and ``1 / 3.4e38`` (f32's or bf16's max) is subnormal,
    flushed to 0 on the CPU: under ``jit`` every f32 and bf16 probe's headroom read 0, whatever
    its value (eagerly it was right). So the quotient is taken by the normal ``2**64 / big``,
    then brought down by 2**64 in the exponent bits, where no constant can fold; a result
    below f32's smallest normal (a headroom under 1e-38) reads 0, as the CPU flushes it.
    ``jnp.ldexp`` did the same in 50 HLO instructions per probe, this in 13.
    """
    q = lax.bitcast_convert_type(jnp.asarray(v, jnp.float32) * (2.0**64 / big), jnp.int32)
    down = jnp.int32(64 << 23)
    fraction = lax.bitcast_convert_type(q - down, jnp.float32)
    return jnp.where(q >= jnp.int32(65 << 23), fraction, jnp.zeros_like(fraction))


# The sum of squares runs on ``|x| * 2**-16``: a power of two scales exactly, so the variance
# is the same bits wherever it was finite (and the scaled square is a normal f32: |x| above
# ~7e-15), and a probe makes no inf from finite values below |x| ~1.2e24, where f32's square
# overflowed at 1.8e19 (attention logits of 4e18: the probe's variance read inf, and tier 2
# named the probe's reduction, not the model, newuser42). One multiply per element: clipping
# too (no inf at all) cost each instrumented replay ~1.5 s of a demo-size locate.
_SUM_SCALE = 2.0**-16
_F32_MAX = float(jnp.finfo(jnp.float32).max)


def _sums(a, b):
    """The reducer of ``stats``: sums, except the max of each array's third operand (every
    sixth from the third: ``_stats_many`` reduces several arrays' parts at once)."""
    out = [u + v for u, v in zip(a, b, strict=True)]
    for i in range(2, len(out), 6):
        out[i] = jnp.maximum(a[i], b[i])
    return tuple(out)


@monitoring
def stats(x: jax.typing.ArrayLike, limit: float | None = None) -> jax.Array:
    """Probe statistics of one tensor, computed on device in one reduction.

    One pass in f32 over the finite values only, so a NaN element is counted, not averaged in.
    Every statistic comes from one variadic ``lax.reduce`` (sum, sum of squares, max, and the
    counts of NaN, ``+inf`` and ``-inf``): XLA compiles it as one fusion, where separate
    ``jnp`` reductions compiled as up to ten (the elementwise work ahead of each, then each
    reduction, on the CPU), and a site's probes were a third of the step's compile time. The
    variance is ``E[x^2] - E[x]^2`` clamped at 0, which is plenty for a monitoring statistic.
    No gradient flows through it (monitoring only).

    Inside ``partitioned()`` (a step sharded over devices) it is one plain sum (of the stacked
    sums and counts) and one plain max instead: XLA's SPMD partitioner turns those into
    all-reduces, which it merges across probes, but cannot split a variadic reduction over a
    sharded axis and gathered its six partial results per probe (138 all-gathers per
    data-parallel step of the demo model on 8 devices; none now). On the CPU the sum reads the
    stacked values and the max the tensor again: two kernels, where one device's form is one.

    Args:
      x: any array.
      limit: where ``x`` overflows, for the headroom (None: ``finfo(x.dtype).max``); a norm's
        input overflows its f32 statistics first (``ops.norms._stats_limit``).

    Returns:
      f32[NUM_STATS]: ``max_abs`` (of the finite values), ``mean``, ``var``, ``nonfinite``
      (count of NaN and ``+inf``; ``-inf`` mask fills excluded), ``headroom`` (``max_abs /
      limit``; a ``+inf`` counts as headroom 1, a ``-inf`` does not).
    """
    x = lax.stop_gradient(jnp.asarray(x))
    big = _finfo_max(x.dtype) if limit is None else float(limit)
    return _stats_over(x.astype(jnp.float32), tuple(range(x.ndim)), big)


def _stats_over(xf: jax.Array, axes: tuple[int, ...], big) -> jax.Array:
    """``stats`` of ``xf`` (f32) reduced over ``axes``: ``[*kept axes, NUM_STATS]``; ``big``
    (a float, or an array over the kept axes) is the headroom's limit."""
    if _PARTITIONED.get() and axes:
        parts = _parts(xf)
        stacked = jnp.stack([parts[i] for i in (0, 1, 3, 4, 5)])
        sums = jnp.sum(stacked, tuple(a + 1 for a in axes))
        (total, total_sq, n_nan, n_pos, n_neg), max_abs = sums, jnp.max(parts[2], axes)
        sums = (total, total_sq, max_abs, n_nan, n_pos, n_neg)
        return _finish(sums, math.prod(xf.shape[a] for a in axes), big)
    return _stats_many([xf], axes, [big])[0]


def _parts(xf: jax.Array) -> tuple[jax.Array, ...]:
    """What ``_sums`` reduces for ``xf``: the sum and the sum of squares of its finite values
    (scaled), their largest magnitude, and its NaN, ``+inf`` and ``-inf`` counts."""
    nan, pos, neg = jnp.isnan(xf), xf == jnp.inf, xf == -jnp.inf
    xz = jnp.where(nan | pos | neg, 0.0, xf)
    one = lambda b: b.astype(jnp.float32)  # noqa: E731
    # The sums of x * 2**-16 and of its squares: no inf below |x| ~1.2e24 in the squares (f32's
    # square overflowed at 1.8e19), none in the sum of under 65536 values whatever they are
    # (the mean of 100 values of 1e37 was inf; past that, the mean saturates); a power of two
    # scales exactly.
    xs = xz * _SUM_SCALE
    return (xs, jnp.square(xs), jnp.abs(xz), one(nan), one(pos), one(neg))


def _stats_many(xfs, axes: tuple[int, ...], bigs) -> list[jax.Array]:
    """``_stats_over`` of several f32 arrays of one shape, from one variadic reduction of
    every array's six parts: XLA fuses each array's elementwise producer into it (a norm's
    per-row ``inv_std`` and ``input_rms``, from the row statistics), where stacking the arrays
    first was a kernel of its own, and the stacked result's rows two more (a slice each)."""
    parts = [p for xf in xfs for p in _parts(xf)]
    zero = jnp.zeros((), jnp.float32)
    sums = lax.reduce(tuple(parts), (zero,) * len(parts), _sums, axes)
    size = math.prod(xfs[0].shape[a] for a in axes)
    return [_finish(sums[6 * i : 6 * i + 6], size, big) for i, big in enumerate(bigs)]


def _finish(sums, size: int, big) -> jax.Array:
    """``[*, NUM_STATS]`` from one array's reduced parts (``_parts``) over ``size`` values."""
    total, total_sq, max_abs, n_nan, n_pos, n_neg = sums
    # One division: XLA does not copy a division into several consumers, so ``total / n`` and
    # ``total_sq / n`` were a kernel each; the products below fuse into what reads them.
    inv_n = 1.0 / jnp.maximum(float(size) - n_nan - n_pos - n_neg, 1.0)
    mean_s = total * inv_n
    mean = jnp.clip(mean_s, -_F32_MAX * _SUM_SCALE, _F32_MAX * _SUM_SCALE) * (1.0 / _SUM_SCALE)
    # the variance from the scaled squares: exact, saturating at f32's max; a scalar's is 0
    var = jnp.maximum(total_sq * inv_n - jnp.square(mean_s), 0.0)
    top = jnp.full_like(var, _F32_MAX * _SUM_SCALE**2)  # (a sum of squares past f32: inf, NaN)
    var = lax.min(lax.select(jnp.isnan(var), top, var), top) * (1.0 / _SUM_SCALE**2)
    if size <= 1:
        var = jnp.zeros_like(var)
    head = jnp.where(n_pos > 0, 1.0, _fraction_of(max_abs, big))
    return jnp.stack([max_abs, mean, var, n_nan + n_pos, head], -1).astype(jnp.float32)


@monitoring
def stats_of_rows(xs, limits) -> list[jax.Array]:
    """``stats`` of several arrays of one shape in one reduction: a norm's two per-row probes
    were two reductions of a few hundred values each, their kernels most of what BatchNorm's
    probes cost. One variadic reduction of every array's parts (``_stats_many``); inside
    ``partitioned()``, the arrays stacked (``[R, ...]``) and reduced as ``stats`` does there.

    Args:
      xs: arrays of one shape, each in the dtype its statistics are of (cast to f32 here).
      limits: each array's headroom limit (``stats``'s ``limit``; None: its dtype's max).

    Returns:
      One ``f32[NUM_STATS]`` per array, as ``stats`` gives it (no gradient flows through).
    """
    xs = [lax.stop_gradient(jnp.asarray(x)) for x in xs]
    bigs = [
        _finfo_max(x.dtype) if lim is None else float(lim)
        for x, lim in zip(xs, limits, strict=True)
    ]
    xfs = [x.astype(jnp.float32) for x in xs]
    axes = tuple(range(xfs[0].ndim))
    if _PARTITIONED.get() and axes:
        stacked = jnp.stack(xfs)
        rows = _stats_over(stacked, tuple(a + 1 for a in axes), np.asarray(bigs, np.float32))
        return [rows[i] for i in range(len(xs))]
    return _stats_many(xfs, axes, bigs)


def op_stats(x: jax.Array, limit: float | None = None) -> jax.Array:
    """``stats`` for an op's probe: monitoring only, so no gradient flows through it."""
    return lax.stop_gradient(stats(x, limit))


@monitoring
def cheap_stats(y: jax.Array) -> jax.Array:
    """Probe statistics from one ``max(|y|)`` reduction: for Linear/Embed outputs.

    Returns ``f32[NUM_STATS]`` laid out like ``stats``: ``max_abs`` (the dtype's max when a
    non-finite value is present), ``mean = var = 0`` (not computed), ``nonfinite`` as a 0/1
    flag (not a count), ``headroom``. A ``-inf`` is a mask fill, as to ``stats``: it is read
    as 0, neither non-finite nor an overflow (a user's probe of masked logits would otherwise
    make every step an incident, ``train.model_probes_nonfinite``).
    """
    floating = jnp.issubdtype(y.dtype, jnp.floating)
    a = jnp.where(y == -jnp.inf, jnp.zeros_like(y), jnp.abs(y)) if floating else jnp.abs(y)
    m = jnp.max(a).astype(jnp.float32)  # NaN and +inf propagate through max
    finite = jnp.isfinite(m)
    big = float(jnp.finfo(y.dtype).max) if floating else 1.0
    max_abs = jnp.where(finite, m, big)
    z = jnp.zeros((), jnp.float32)
    head = jnp.where(finite, _fraction_of(m, big), 1.0)
    return jnp.stack([max_abs, z, z, jnp.where(finite, 0.0, 1.0), head]).astype(jnp.float32)


def sampled_stats(y: jax.Array, max_elements: int = PROBE_SAMPLE) -> jax.Array:
    """``stats`` of evenly strided rows of ``y`` (last axis = row), at most ``max_elements``
    values: a fixed, small cost whatever the batch. ``max_abs`` is a lower bound of the full
    tensor's; a non-finite value in an unsampled row is not seen (the per-row probes and the
    step's loss/gradient checks see those)."""
    return stats(sample_rows(y, max_elements))


def sample_rows(
    a: jax.Array, max_elements: int = PROBE_SAMPLE, stride: int | None = None
) -> jax.Array:
    """The rows ``sampled_stats`` reads: ``a`` as ``[rows, last axis]``, every ``stride``-th
    row, at most ``max_elements`` values (a 1-D or scalar ``a`` is one row). ``stride``: take
    another array's (``sample_stride`` of its shape), e.g. the same rows of an op's per-row
    statistics ``[..., 1]`` as of its output."""
    rows = a.reshape(math.prod(a.shape[:-1]), a.shape[-1]) if a.ndim > 1 else a.reshape(1, -1)
    return rows[:: sample_stride(a.shape, max_elements) if stride is None else stride]


def sample_stride(shape: tuple[int, ...], max_elements: int = PROBE_SAMPLE) -> int:
    """The row stride of ``sample_rows`` for an array of ``shape``: an op can take the same
    rows of its inputs (and of per-row statistics, ``[..., 1]``) to compute its output's
    sampled rows without reading the output."""
    return max(1, -(-math.prod(shape) // max_elements))


@monitoring
def scalar_stats(value: jax.Array, headroom: jax.Array, nonfinite: jax.Array) -> jax.Array:
    """A scalar (a gradient or update norm) as a probe: ``max_abs = |value|``, ``var = 0``.

    Args:
      value: the scalar; a non-finite value reads as 0 in ``max_abs`` / ``mean``.
      headroom: f32 scalar to report as the headroom.
      nonfinite: bool or count to report as ``nonfinite``.

    Returns:
      f32[NUM_STATS].
    """
    v = jnp.asarray(value, jnp.float32)
    vz = jnp.where(jnp.isfinite(v), v, 0.0)
    return jnp.stack(
        [jnp.abs(vz), vz, jnp.zeros_like(vz), jnp.asarray(nonfinite, jnp.float32), headroom]
    ).astype(jnp.float32)


def zeros() -> jax.Array:
    """An empty probe (all statistics 0): the value before the first write."""
    return jnp.zeros([NUM_STATS], jnp.float32)
