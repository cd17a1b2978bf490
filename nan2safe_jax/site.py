"""Sites: the named places in a model that have their own gear and probes.

A site is any ``nnx.Module`` that holds a ``SiteGear`` variable. Its name is its module path in
the model graph, dotted (``"blocks.0.attn"``); ``name_sites`` writes that name onto each site so
the site can wrap its computation in ``site_scope(name)``. The scope puts ``nan2safe[<name>]``
into the name stack of every equation the site produces, forward and backward, and
``site_from_name_stack`` reads it back: that is how the localizer maps an equation to a site.

Probes are ``Probe`` variables holding the statistics of ``probe.stats`` (see
``nan2safe_jax.probe``): either declared in ``__init__`` (so they exist before the first call;
needed under ``nnx.scan``) or sown with ``module.sow(Probe, name, probe.stats(x))`` from any
module. ``collect_probes`` reads both; the train step calls it.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import os
import re
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from nan2safe_jax.probe import NUM_STATS

_SITE_RE = re.compile(r"nan2safe\[([^\]]+)\]")


class Probe(nnx.Variable):
    """Probe statistics of one tensor: ``f32[..., NUM_STATS]`` (``nan2safe_jax.probe.STATS``)."""

    default = 0  # every statistic, before the first write (``probe.zeros``)


class SiteGear(nnx.Variable):
    """A site's gear as an int32 array (scalar, or ``[L]`` for a stack made by ``nnx.vmap``)."""

    default = 0  # FAST


def fill_defaults(model: nnx.Module, lead: tuple[int, ...] = (), fallback=None) -> nnx.Module:
    """Gives every site variable that is still abstract its default value, in place.

    A model built with ``nnx.eval_shape`` and then given only its ``Param``s (a params-only
    checkpoint restored the orbax way) holds ``ShapeDtypeStruct``s in its gears, knobs and
    probes, which no ``jit`` or ``nnx.scan`` takes. ``TrainState.create`` calls this; a loop of
    your own (``nnx.jit``) calls it once after the restore. A layer called eagerly fills its own.

    Args:
      model: the module (changed in place).
      lead: axes put before each variable's own shape (a site built unstacked for a stack).
      fallback: the value of an abstract variable with no ``default`` class attribute (None:
        left abstract; a ``Param`` is always left, it is the user's to restore).

    Returns:
      ``model``.
    """
    for _, var in nnx.iter_graph(model):
        if isinstance(var, nnx.Variable) and not isinstance(var, nnx.Param):
            fill_default(var, lead, fallback)
    return model


def fill_default(var: nnx.Variable, lead: tuple[int, ...] = (), fallback=None) -> jax.Array:
    """``var``'s value, after giving it its class's ``default`` (or ``fallback``; None leaves
    it) if it is still abstract (see ``fill_defaults``), in ``lead + its shape``."""
    v = var.get_value()
    if isinstance(v, jax.ShapeDtypeStruct):
        value = getattr(type(var), "default", fallback)
        if value is not None:
            var.set_value(jnp.full(tuple(lead) + tuple(v.shape), value, v.dtype))
    return var.get_value()


def write_probe(var: nnx.Variable, value: jax.Array) -> None:
    """Overwrites a probe (replacing an abstract value whole: ``nn``'s ``_read``).

    The new value replaces the old one in the old one's shape and dtype: what ``var[...] =
    value`` stores, without tracing an indexed update (~15 ms of tracing per probe).

    A module called inside a plain JAX transform that closes over it (``jax.jit(lambda x:
    layer(x))``, ``jax.grad`` with respect to its inputs) cannot mutate its variables from that
    trace; a probe is only an observation, so it is left as it was there, and the layer runs
    as flax's own does.
    """
    if not getattr(var, "_can_update", True):
        return
    old = var.get_value()
    if isinstance(old, jax.ShapeDtypeStruct):
        var.set_value(value)
    else:
        var.set_value(jnp.broadcast_to(jnp.asarray(value, old.dtype), jnp.shape(old)))


def site_scope(name: str):
    """A ``jax.named_scope`` that marks every equation inside as belonging to site ``name``."""
    return jax.named_scope(f"nan2safe[{name}]")


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


@contextlib.contextmanager
def scope(module):
    """The computation of a site of your own, named to tier 2: ``with nan2safe.site.scope(self):``
    around the body of a module that holds a ``SiteGear`` and passes it as ``gear=`` to
    ``nan2safe.ops.*``.

    It enters ``site_scope(module.site_name)`` and re-enters it inside every gear branch the
    ops trace (``branch_site``), as ``nan2safe.nn``'s modules do: without it the module's gear
    switches the ops, but a fault in them is "outside every site" to tier 2, which then puts
    the whole model in SAFE instead of the module. ``module.site_name`` is its path in the
    model (``TrainState.create`` names it; the class name before that).
    """
    name = getattr(module, "site_name", None) or type(module).__name__
    with site_scope(name), branch_site(name):
        yield


def scoped(fn: Callable[..., Any], name: str) -> Callable[..., Any]:
    """``fn`` run inside ``site_scope(name)`` (a ``lax.switch`` branch of site ``name``)."""

    @functools.wraps(fn)
    def wrapped(*args):
        with site_scope(name):
            return fn(*args)

    return wrapped


def current_branch_site() -> str | None:
    """The site named by the innermost ``branch_site`` block, or None outside one."""
    return _BRANCH_SITE.get()


# Libraries whose lines are no user's: optax too, whose losses ``ops.cross_entropy`` (FAST) and
# users' loss functions call. (JAX's own frames JAX's tracebacks leave out already.)
LIBRARY_DIRS = tuple(
    os.path.dirname(m.__file__) + os.sep
    for m in (__import__("nan2safe_jax"), __import__("flax"), __import__("optax"))
    if getattr(m, "__file__", None)
)


def layer_name(site: str, index: Any = None) -> str:
    """``site``, or one layer of a stacked site as ``site[i]`` (``site[i][j]`` in a stack of
    stacks): how actions, the history's ``safe_sites`` and the dashboard name it."""
    if index is None:
        return site
    return site + "".join(f"[{int(i)}]" for i in np.atleast_1d(np.asarray(index)).reshape(-1))


def site_from_name_stack(name_stack: str) -> str | None:
    """The innermost site named in a name stack string, or None."""
    found = _SITE_RE.findall(str(name_stack))
    return found[-1] if found else None


def path_name(path) -> str:
    """A graph path as a dotted name: ``("blocks", 0, "attn")`` -> ``"blocks.0.attn"``."""
    return ".".join(str(p) for p in path)


_path_name = path_name  # the old private name


def param_name(key_path) -> str:
    """A pytree key path into a state's parameters as a dotted name, the ``Variable``'s own
    attribute left out: ``['blocks'][0]['up']['kernel'].value`` -> ``"blocks.0.up.kernel"``."""
    keys = (getattr(k, "key", getattr(k, "idx", None)) for k in key_path)
    return path_name([k for k in keys if k is not None])


def iter_sites(model: nnx.Module):
    """Yields ``(name, module)`` for every module of ``model`` that holds a ``SiteGear``."""
    for path, node in nnx.iter_graph(model):
        if isinstance(node, nnx.Module):
            for value in vars(node).values():
                if isinstance(value, SiteGear):
                    yield (path_name(path) or type(node).__name__), node
                    break


SITE_VARIABLES = (SiteGear, Probe)  # an nnx filter: every site's gear and probe variables


class SiteTemplate:
    """The shapes and dtypes of a model's site variables (``SITE_VARIABLES``), without values.

    A train step rebuilds those variables from it inside the trace (gears from the
    ``GearState``, probes written by the forward) instead of carrying them in the state: as
    state they were ~80 arrays on the demo model handed into and out of every step (each a
    buffer, and an ``nnx.Variable`` rebuilt in Python), the gears unchanged and copied, the
    probes already returned as metrics. Static: equal templates hash alike, so it can sit in
    a jitted pytree's static data.

    Args:
      state: an ``nnx.State`` of site variables (``nnx.split(model, ..., SITE_VARIABLES, ...)``).
    """

    def __init__(self, state: nnx.State):
        spec = lambda a: jax.ShapeDtypeStruct(jnp.shape(a), jnp.result_type(a))  # noqa: E731
        self.state = jax.tree_util.tree_map(spec, state)
        self._key = tuple(
            (jax.tree_util.keystr(path), s.shape, str(s.dtype))
            for path, s in jax.tree_util.tree_leaves_with_path(self.state)
        )

    def zeros(self) -> nnx.State:
        """The site variables, every value zeros (FAST gears, empty probes)."""
        return jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), self.state)

    def __len__(self) -> int:
        return len(self._key)

    def __hash__(self) -> int:
        return hash(self._key)

    def __eq__(self, other) -> bool:
        return isinstance(other, SiteTemplate) and self._key == other._key

    def __repr__(self) -> str:
        return f"SiteTemplate({len(self)} variables)"


def name_sites(model: nnx.Module) -> dict[str, tuple[int, ...]]:
    """Names every site of ``model`` by its module path and returns ``{name: gear shape}``.

    Idempotent; called by ``TrainState.create``. A site that is never named keeps its class name.
    """
    shapes = {}
    for name, module in iter_sites(model):
        object.__setattr__(module, "site_name", name)
        gear = next(v for v in vars(module).values() if isinstance(v, SiteGear))
        shapes[name] = tuple(jnp.shape(gear.get_value()))
    return shapes


def site_gears(model: nnx.Module) -> dict[str, SiteGear]:
    """``{site name: its SiteGear variable}`` (names as ``name_sites`` gives them)."""
    out = {}
    for name, module in iter_sites(model):
        out[name] = next(v for v in vars(module).values() if isinstance(v, SiteGear))
    return out


class ProbeBlock(NamedTuple):
    """One ``Probe`` variable's statistics as rows: ``names[i]`` is row ``i`` of ``stats``."""

    names: tuple[str, ...]
    stats: jax.Array  # f32[len(names), NUM_STATS]


def probe_blocks(model: nnx.Module) -> list[ProbeBlock]:
    """Every ``Probe`` variable of ``model`` as a ``ProbeBlock``, in graph order.

    A probe of one statistics vector is one row named by its path; a stacked probe
    (``[L, NUM_STATS]``, from ``nnx.scan``) is ``L`` rows, ``"path[i]"``, so a single layer's
    growth is not averaged away; sown probes (tuples) give one row per call. The train step
    stacks the blocks whole (``detector.stack_blocks``).

    Args:
      model: any ``nnx.Module``.

    Returns:
      ``[ProbeBlock]``; the name is the probe's path.
    """
    return blocks_of(probe_variables(model))


def probe_variables(model: nnx.Module) -> list[tuple[str, Probe]]:
    """``[(path name, Probe variable)]`` of ``model``, in graph order: kept, the variables are
    read again after each call without walking the graph (``blocks_of``)."""
    return [(path_name(p), n) for p, n in nnx.iter_graph(model) if isinstance(n, Probe)]


def _rows_of(value) -> tuple[list, list[jax.Array]]:
    """A probe variable's value as ``(leaves, rows)``: each leaf as ``f32[-1, NUM_STATS]``."""
    leaves = jax.tree_util.tree_leaves(value)
    return leaves, [jnp.reshape(jnp.asarray(v, jnp.float32), (-1, NUM_STATS)) for v in leaves]


def stacked_rows(values: list) -> jax.Array:
    """The rows of ``blocks_of``'s blocks stacked, ``f32[P, NUM_STATS]``, from the probe
    variables' values (traceable: a jitted caller reads the variables, then stacks inside)."""
    rows = [r for value in values for r in _rows_of(value)[1]]
    return jnp.concatenate(rows) if rows else jnp.zeros((0, NUM_STATS), jnp.float32)


def blocks_of(probes: list[tuple[str, Probe]]) -> list[ProbeBlock]:
    """``probe_blocks`` of the variables ``probe_variables`` listed, read now."""
    out = []
    for name, node in probes:
        leaves, rows = _rows_of(node.get_value())
        if len(rows) == 1 and jnp.ndim(leaves[0]) == 1:
            out.append(ProbeBlock((name,), rows[0]))
            continue
        if not sum(r.shape[0] for r in rows):  # a probe with no rows (sown by no call)
            continue
        flat = jnp.concatenate(rows)
        out.append(ProbeBlock(tuple(f"{name}[{i}]" for i in range(flat.shape[0])), flat))
    return out


def probe_rows(blocks: list[ProbeBlock]) -> dict[str, jax.Array]:
    """``{row name: f32[NUM_STATS]}`` of ``probe_blocks``' blocks."""
    return {n: b.stats[i] for b in blocks for i, n in enumerate(b.names)}


def collect_probes(model: nnx.Module) -> dict[str, jax.Array]:
    """Every ``Probe`` variable of ``model`` as ``{name: f32[NUM_STATS]}``.

    A stacked probe (``[L, NUM_STATS]``, from ``nnx.scan``) gives one probe per layer,
    ``"path[i]"``, so a single layer's growth is not averaged away; sown probes (tuples) give
    one per call (``probe_blocks``, row by row).

    Args:
      model: any ``nnx.Module``.

    Returns:
      ``{probe name: f32[NUM_STATS]}`` in graph order; the name is the probe's path.
    """
    return probe_rows(probe_blocks(model))
