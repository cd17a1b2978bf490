"""Sites: the named places in a model that have their own gear and probes.

A site is any ``nnx.Module`` that holds a ``SiteGear`` variable. Its name is its module path in
the model graph, dotted (``"blocks.0.attn"``); ``name_sites`` writes that name onto each site so
the site can wrap its computation in ``site_scope(name)``. The scope puts ``nan2safe[<name>]``
into the name stack of every equation the site produces, forward and backward, and
``site_from_name_stack`` reads it back: that is how the localizer maps an equation to a site.

Probes are ``Probe`` variables holding the statistics of ``detector.stats``: either declared in
``__init__`` (so they exist before the first call; needed under ``nnx.scan``) or sown with
``module.sow(Probe, name, detector.stats(x))`` from any module. The train step reads both.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
from flax import nnx

_SITE_RE = re.compile(r"nan2safe\[([^\]]+)\]")


class Probe(nnx.Variable):
    """Probe statistics of one tensor: ``f32[..., NUM_STATS]`` (see ``detector.STATS``)."""


class SiteGear(nnx.Variable):
    """A site's gear as an int32 array (scalar, or ``[L]`` for a stack made by ``nnx.vmap``)."""


def site_scope(name: str):
    """A ``jax.named_scope`` that marks every equation inside as belonging to site ``name``."""
    return jax.named_scope(f"nan2safe[{name}]")


def site_from_name_stack(name_stack: str) -> str | None:
    """The innermost site named in a name stack string, or None."""
    found = _SITE_RE.findall(str(name_stack))
    return found[-1] if found else None


def _path_name(path) -> str:
    return ".".join(str(p) for p in path)


def iter_sites(model: nnx.Module):
    """Yields ``(name, module)`` for every module of ``model`` that holds a ``SiteGear``."""
    for path, node in nnx.iter_graph(model):
        if isinstance(node, nnx.Module):
            for value in vars(node).values():
                if isinstance(value, SiteGear):
                    yield (_path_name(path) or type(node).__name__), node
                    break


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
