"""Gears as data: the ``GearState`` pytree and its pure transition functions.

A gear is an int32 that the step reads with ``ops.dispatch.switch``; the state that holds the
gears is a pytree carried through the jitted step. A downshift is therefore a change of
*values*, never of code: it takes effect on the very next step and never recompiles
(docs/design.md, "Gears").

The global ``level`` applies to every site; ``sites`` holds each site's own gear, so the
effective gear of a site is ``max(level, sites[name])``. Per-site gears have the shape of the
site's gear variable: a scalar for an ordinary module, ``[num_layers]`` for a module stacked by
``nnx.scan``, so one layer of a scanned stack can be put in SAFE alone.
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from nan2safe_jax.config import Config

MAX_I32 = 2**31 - 1


class Gear(enum.IntEnum):
    """The three gears (docs/design.md, "Gears"): ``FAST`` (0), ``STABLE`` (1), ``SAFE`` (2)."""

    FAST = 0
    STABLE = 1
    SAFE = 2


@functools.lru_cache(maxsize=64)
def _offsets(
    layout: tuple[tuple[str, tuple[int, ...]], ...],
) -> dict[str, tuple[int, int, tuple[int, ...]]]:
    """``name -> (start, stop, shape)`` of each site's values in a ``SiteValues`` vector."""
    out, at = {}, 0
    for name, shape in layout:
        size = int(np.prod(shape, dtype=np.int64))
        out[name] = (at, at + size, shape)
        at += size
    return out


@jax.tree_util.register_pytree_with_keys_class
class SiteValues(Mapping):
    """Every site's int32 values (its gear, SAFE stay or SAFE entries) held as one vector.

    A read-only mapping ``site name -> i32[*site_shape]``, stored as the sites' values
    raveled and concatenated in one ``i32[total]``. As a dict of one array per site, each of
    ``GearState``'s three per-site fields was 41 leaves on the demo model: 123 arrays into
    and out of every step, each a buffer the host hands over and takes back (and, unchanged,
    a copy on the device), ~1-2 ms of host time per step for nothing; the policy already
    worked on the sites as one vector (``decide``). One pytree leaf (``flat``); the names
    and shapes are static, so it passes through ``jit`` and ``jax.device_get`` (a read is
    then a NumPy slice).

    Args:
      layout: ``((name, shape), ...)`` in the vector's order.
      flat: ``i32[sum of the shapes' sizes]``.
    """

    def __init__(self, layout: tuple[tuple[str, tuple[int, ...]], ...], flat: jax.typing.ArrayLike):
        self.layout = layout
        self.flat = flat

    @classmethod
    def of(cls, values: Mapping[str, jax.typing.ArrayLike]) -> SiteValues:
        """``values`` (``name -> array``) packed in their order, as int32."""
        if isinstance(values, SiteValues):
            return values
        layout = tuple((k, tuple(int(d) for d in np.shape(v))) for k, v in values.items())
        return cls(layout, _flat(values))

    def with_flat(self, flat: jax.typing.ArrayLike) -> SiteValues:
        """The same sites with new values (``flat``, laid out as this one's)."""
        return SiteValues(self.layout, flat)

    def set(self, name: str, value: jax.typing.ArrayLike) -> SiteValues:
        """A copy with site ``name``'s values replaced by ``value`` (broadcast to its shape)."""
        start, stop, shape = _offsets(self.layout)[name]
        v = jnp.ravel(jnp.broadcast_to(jnp.asarray(value, jnp.int32), shape))
        return self.with_flat(jnp.asarray(self.flat).at[start:stop].set(v))

    def __getitem__(self, name: str):
        start, stop, shape = _offsets(self.layout)[name]
        return self.flat[start:stop].reshape(shape)

    def __iter__(self):
        return (name for name, _ in self.layout)

    def __len__(self) -> int:
        return len(self.layout)

    def __contains__(self, name) -> bool:
        return name in _offsets(self.layout)

    def __repr__(self) -> str:
        return f"SiteValues({dict(self.items())!r})"

    def tree_flatten_with_keys(self):
        return ((jax.tree_util.GetAttrKey("flat"), self.flat),), self.layout

    @classmethod
    def tree_unflatten(cls, layout, children):
        return cls(layout, children[0])


class GearState(struct.PyTreeNode):
    """Global and per-site gears, SAFE dwell counters, calm counter and event counters.

    Every field is an int32 array; the per-site fields are ``SiteValues`` (a mapping from
    site name, its module path, to the site's values, held as one vector).
    """

    level: jax.Array  # i32[] global gear, applies to every site
    level_safe_left: jax.Array  # i32[] steps left in a global SAFE stay
    sites: SiteValues  # name -> i32[*site_shape] each site's own gear
    safe_left: SiteValues  # name -> i32[*site_shape] steps left in SAFE
    safe_entries: SiteValues  # name -> i32[*site_shape] SAFE entries so far (back-off)
    calm: jax.Array  # i32[] consecutive calm, finite steps run in STABLE (nothing in SAFE)
    downshifts: jax.Array  # i32[] FAST -> STABLE transitions so far
    recoveries: jax.Array  # i32[] returns to FAST so far

    @classmethod
    def create(cls, sites: Mapping[str, tuple[int, ...]] | None = None) -> GearState:
        """A state with every gear FAST.

        Args:
          sites: site name -> shape of its gear (``()`` for one module, ``(L,)`` for a stack).
        """
        layout = tuple((k, tuple(int(d) for d in s)) for k, s in dict(sites or {}).items())
        size = sum(int(np.prod(s, dtype=np.int64)) for _, s in layout)
        zeros = lambda: SiteValues(layout, jnp.zeros([size], jnp.int32))  # noqa: E731
        # One array per field: a state whose leaves share an array cannot be donated.
        z = lambda: jnp.zeros([], jnp.int32)  # noqa: E731
        return cls(
            level=z(),
            level_safe_left=z(),
            sites=zeros(),
            safe_left=zeros(),
            safe_entries=zeros(),
            calm=z(),
            downshifts=z(),
            recoveries=z(),
        )


def known_fast(gs: GearState) -> GearState:
    """``gs`` with the level and every site's gear FAST as trace-time constants.

    For a program that only runs states whose gears are all FAST (the train step's FAST-only
    program, ``programs.all_fast``): the gears it reads are then what it knows, and every flag
    over the sites (any in SAFE, any below FAST) folds away instead of compiling a reduction
    and a kernel per flag. The counters (SAFE stays, entries, calm, transitions) are kept.
    """
    sites = gs.sites.with_flat(jnp.zeros(jnp.shape(gs.sites.flat), jnp.int32))
    return gs.replace(level=jnp.zeros([], jnp.int32), sites=sites)


def _check_gear(gear) -> int:
    """``gear`` as an int 0-2; a float, a bool or any other value is a ``ValueError`` (``int``
    would truncate ``1.5`` to STABLE and take ``True`` for 1; ``ops.switch`` refuses them)."""
    said = f"gear must be one of Gear.FAST/STABLE/SAFE (0, 1, 2), got {gear!r}"
    if isinstance(gear, jax.core.Tracer):
        raise ValueError(f"{said}: a traced value (gears are set on the host, between steps)")
    if not _integer(gear):
        raise ValueError(said)
    g = int(gear)
    if g not in (0, 1, 2):
        raise ValueError(said)
    return g


def _integer(value) -> bool:
    """``value`` is one integer: a Python or NumPy int (``Gear`` included) or a 0-d integer
    array, not a bool, a float or an array of several."""
    dtype = getattr(value, "dtype", None)
    if dtype is not None:
        return np.ndim(value) == 0 and jnp.issubdtype(dtype, jnp.integer)
    return isinstance(value, int) and not isinstance(value, bool)


def _check_index(name: str, index, size: int) -> None:
    """Refuses an index into a stack of ``size`` layers that is not an integer in range.

    ``.at[i].set`` drops an out-of-range write, so such a call changed nothing, silently. An
    integer array of one element is an index; a bool is not (it would select every layer).
    A traced index (``set_site`` inside a jitted function of the user's) is taken as given.
    """
    if isinstance(index, jax.core.Tracer):
        return
    if not _integer(index) or not -size <= int(index) < size:
        raise ValueError(
            f"site {name!r} stacks {size} layers; index must be an int in [{-size}, {size}), "
            f"got {index!r}"
        )


def _inc(x: jax.Array, by=1) -> jax.Array:
    """Saturating int32 increment."""
    return jnp.where(x >= MAX_I32 - by, MAX_I32, x + by).astype(jnp.int32)


def effective(gs: GearState, site: str) -> jax.Array:
    """The gear a site runs in: the stricter of the global level and its own gear."""
    return jnp.maximum(gs.level, gs.sites[site]).astype(jnp.int32)


def _flat(tree: Mapping[str, jax.Array]) -> jax.Array:
    """Every site's gears (or counters) as one int32 vector, in ``tree``'s order.

    The policy works on this vector, not site by site: a flag over all sites (``recover``)
    is then one reduction, not a chain of scalar ``or``s that XLA copies into every site's
    output (on a model with ~90 sites that copy was most of the step's compile time).
    """
    if isinstance(tree, SiteValues):
        return jnp.asarray(tree.flat, jnp.int32)
    parts = [jnp.ravel(jnp.asarray(v, jnp.int32)) for v in tree.values()]
    return jnp.concatenate(parts) if parts else jnp.zeros([0], jnp.int32)


def _any_above(level: jax.Array, flat_sites: jax.Array, gear: Gear) -> jax.Array:
    """bool[]: the whole-model gear or any site's (``_flat``) is above ``gear``."""
    return (level > gear) | jnp.any(flat_sites > gear)


def any_safe(gs: GearState) -> jax.Array:
    """True when the whole model or any site is in SAFE (the learning-rate factor applies)."""
    return _any_above(gs.level, _flat(gs.sites), Gear.STABLE)


def any_below_fast(gs: GearState) -> jax.Array:
    """True when the whole model or any site runs below FAST (STABLE or SAFE)."""
    return _any_above(gs.level, _flat(gs.sites), Gear.FAST)


def safe_dwell(entries: jax.Array, cfg: Config) -> jax.Array:
    """SAFE stay for a site entering SAFE for the ``entries + 1``-th time: doubles per repeat."""
    doublings = jnp.minimum(entries, cfg.safe_backoff_max)
    return (cfg.safe_max_steps * jnp.left_shift(1, doublings)).astype(jnp.int32)


def set_level(gs: GearState, gear, cfg: Config | None = None) -> GearState:
    """Sets the global gear by hand (or from tier 2 when the culprit lies in no site).

    Entering SAFE starts a stay of ``cfg.safe_max_steps`` steps.
    """
    g = _check_gear(gear)
    cfg = cfg or Config()
    left = jnp.asarray(cfg.safe_max_steps if g == Gear.SAFE else 0, jnp.int32)
    return gs.replace(level=jnp.asarray(g, jnp.int32), level_safe_left=left, calm=gs.calm * 0)


def set_site(
    gs: GearState, name: str, gear, *, index: int | None = None, cfg: Config | None = None
) -> GearState:
    """Sets one site's gear (all of a stacked site, or layer ``index`` of it).

    Entering SAFE counts an entry for back-off and starts a stay of
    ``safe_max_steps * 2**previous_entries`` steps (capped by ``safe_backoff_max``), both read
    from ``cfg``: pass the run's (``state.cfg``); without it ``Config()``'s apply, as the
    ``GearState`` does not hold one.

    Raises:
      ValueError: unknown site name, bad gear, or an index into a scalar site.
    """
    g = _check_gear(gear)
    cfg = cfg or Config()
    if name not in gs.sites:
        raise ValueError(f"unknown site {name!r}; known sites: {sorted(gs.sites)}")
    cur = gs.sites[name]
    if index is None:
        sel = jnp.ones(cur.shape, bool)
    else:
        if cur.ndim == 0:
            raise ValueError(f"site {name!r} is not stacked; index must be None, got {index!r}")
        _check_index(name, index, len(cur))
        sel = jnp.zeros(cur.shape, bool).at[index].set(True)
    entries = gs.safe_entries[name]
    if g == Gear.SAFE:
        left = jnp.where(sel, safe_dwell(entries, cfg), gs.safe_left[name])
        entries = jnp.where(sel, _inc(entries), entries)
    else:
        left = jnp.where(sel, 0, gs.safe_left[name])
    return gs.replace(
        sites=gs.sites.set(name, jnp.where(sel, g, cur)),
        safe_left=gs.safe_left.set(name, left),
        safe_entries=gs.safe_entries.set(name, entries),
        calm=gs.calm * 0,
    )


def decide(
    gs: GearState,
    risk: jax.ArrayLike,
    nonfinite: jax.ArrayLike,
    cfg: Config,
    calm: jax.ArrayLike | None = None,
    sites_fast: bool = False,
) -> GearState:
    """The policy: next step's gears from this step's risk (docs/design.md, Tier 1, Recovery).

    Detection comes first and is separate: ``risk`` is already computed. Then:
      - downshift FAST -> STABLE when ``risk >= trigger_risk`` or anything was non-finite;
      - every SAFE stay counts down; at zero the site (or the whole model) returns to STABLE;
      - a calm, finite step that *ran in STABLE* (something below FAST, nothing in SAFE) adds
        one to the calm count; any other step resets it. After ``recovery_window`` such steps
        in a row every STABLE gear returns to FAST. Recovery is staged: SAFE -> STABLE after
        the SAFE stay, then a full ``recovery_window`` in STABLE, then FAST; steps spent in
        SAFE never count toward leaving STABLE.

    Args:
      gs: the gears this step ran with.
      risk: f32[] overall risk in [0, 1].
      nonfinite: bool[] (or count) whether the step saw any non-finite value.
      cfg: thresholds.
      calm: bool[] the detector's calm flag (``Risk.calm``); defaults to ``risk == 0``.
      sites_fast: the caller knows (statically) that every gear is FAST, the level and each
        site's, as in the train step's FAST-only program (``programs.all_fast``). A site then
        moves neither out of SAFE nor back from STABLE, so its gear stays FAST and its SAFE
        stay is 0; said so, no kernel computes each site's output (~130 on a 4-layer model,
        each compiled apart), and the flags over all sites (ran in STABLE, still in SAFE)
        are constants, not reductions (11 fewer kernels in the demo's FAST-only step).

    Returns:
      The gears for the next step.
    """
    risk = jnp.asarray(risk, jnp.float32)
    bad = jnp.asarray(nonfinite) > 0
    calm = (risk <= 0.0) if calm is None else jnp.asarray(calm, bool)
    trigger = (risk >= cfg.trigger_risk) | bad
    if sites_fast:
        gs = known_fast(gs)
    if gs.safe_left.layout != gs.sites.layout:
        raise ValueError("GearState: sites and safe_left must list the same sites in one order")
    downshift = trigger & (gs.level == Gear.FAST)
    g = _flat(gs.sites)
    ran_in_stable = _any_above(gs.level, g, Gear.FAST) & ~_any_above(gs.level, g, Gear.STABLE)
    level = jnp.where(downshift, Gear.STABLE, gs.level)

    # SAFE stays count down whatever happens; leaving SAFE lands in STABLE (staged).
    lvl_safe = level == Gear.SAFE
    lvl_left = jnp.where(lvl_safe, gs.level_safe_left - 1, 0)
    level = jnp.where(lvl_safe & (lvl_left <= 0), Gear.STABLE, level)
    in_safe = g == Gear.SAFE
    left = jnp.where(in_safe, _flat(gs.safe_left) - 1, 0)
    g = jnp.where(in_safe & (left <= 0), Gear.STABLE, g)

    calm_count = jnp.where(calm & ~trigger & ran_in_stable, _inc(gs.calm), 0)
    still_safe = _any_above(level, g, Gear.STABLE)
    ready = (calm_count >= cfg.recovery_window) & ~still_safe
    recover = ready & _any_above(level, g, Gear.FAST)
    level = jnp.where(recover, Gear.FAST, level)
    g = jnp.where(recover, Gear.FAST, g)
    calm_count = jnp.where(recover, 0, calm_count)
    if sites_fast:
        sites, safe_left = gs.sites, gs.safe_left.with_flat(jnp.zeros_like(g))
    else:
        sites = gs.sites.with_flat(g.astype(jnp.int32))
        safe_left = gs.safe_left.with_flat(jnp.maximum(left, 0).astype(jnp.int32))

    i32 = lambda x: jnp.asarray(x, jnp.int32)
    return gs.replace(
        level=i32(level),
        level_safe_left=i32(jnp.maximum(lvl_left, 0)),
        sites=sites,
        safe_left=safe_left,
        calm=i32(calm_count),
        downshifts=jnp.where(downshift, _inc(gs.downshifts), gs.downshifts),
        recoveries=jnp.where(recover, _inc(gs.recoveries), gs.recoveries),
    )
