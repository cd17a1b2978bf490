"""``Site``: any function of yours as a site, with a FAST and a SAFE (and optional STABLE) path.

``nan2safe_jax.nn`` covers the standard layers; hand-written numerics (an attention with its own
masking, a custom loss, a router) are equations in no site, which tier 2 can name but no gear
can reach. ``Site`` fixes that: it holds a ``SiteGear`` like every ``nan2safe_jax.nn`` module,
and its call runs ``[fast, stable, safe][gear](*args)`` through ``ops.switch`` inside
``site_scope(name)`` / ``branch_site(name)``, so every equation of every path, forward and
backward, names the site, tier 2 blames it and ``incidents`` puts it (alone) in SAFE::

    def attend(q, k, v, mask):                  # the model's own code, unchanged
        logits = jnp.einsum("bqd,bkd->bqk", q, k)
        logits = jnp.where(mask, logits, -jnp.inf)
        return jax.nn.softmax(logits) @ v

    def attend_safe(q, k, v, mask):             # defined for a fully masked row
        logits = jnp.einsum("bqd,bkd->bqk", q, k).astype(jnp.float32)
        p = nan2safe.ops.softmax(logits, where=mask, gear=nan2safe.Gear.SAFE)
        return (p @ v.astype(jnp.float32)).astype(v.dtype)

    class Block(nnx.Module):
        def __init__(self, rngs):
            self.core = nan2safe.nn.Site(attend, safe=attend_safe)
        def __call__(self, q, k, v, mask):
            return self.core(q, k, v, mask)

Every path must return the same structure, shapes and dtypes (``lax.switch``). Array arguments
are operands of the switch; anything else (Python numbers, strings, ``None``, functions) is
passed to each path as a constant, so flags like ``causal=True`` stay static. Built inside an
``nnx.vmap`` stack the gear is ``[L]`` and ``nnx.scan`` slices it per layer, as for every site.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from nan2safe_jax import ops
from nan2safe_jax import probe as probe_lib
from nan2safe_jax.site import (
    Probe,
    SiteGear,
    branch_site,
    fill_default,
    site_scope,
    write_probe,
)

__all__ = ["Site"]


def _check_fn(name: str, fn) -> None:
    if not callable(fn):
        raise ValueError(f"Site: {name} must be callable, got {fn!r}")
    if inspect.ismethod(fn) and isinstance(fn.__self__, nnx.Module):
        raise ValueError(
            f"Site: {name} is a method bound to a module ({type(fn.__self__).__name__}); pass a "
            "plain function and give it the arrays it needs (a bound module would be a stale "
            "copy after nnx.split/merge)"
        )


def _is_operand(x) -> bool:
    return isinstance(x, (jax.Array, np.ndarray, np.generic))


class Site(nnx.Module):
    """A user function as a site: ``[fast, stable, safe][gear](*args, **kwargs)``.

    Args:
      fast: the function as the model has it (FAST: the gear every step starts in).
      safe: the same computation made finite where ``fast`` is not (f32, masked rows defined,
        clamped exponents...). Tier 2 puts the site in SAFE when it blames an equation inside.
      stable: the STABLE path (tier 1's global downshift); ``fast`` when not given.
      probe: declare a ``probe_output`` probe (``sampled_stats`` of the first floating output
        leaf) so tier 1 watches this site's output too.
      name: the site name until ``name_sites`` writes the module path (the Trainer does).

    Raises:
      ValueError: a path is not callable, or is a method bound to an ``nnx.Module``; on a
        call, the paths return different structures, shapes or dtypes (named per path).
    """

    def __init__(
        self,
        fast: Callable[..., Any],
        safe: Callable[..., Any],
        *,
        stable: Callable[..., Any] | None = None,
        probe: bool = False,
        name: str | None = None,
    ):
        stable = fast if stable is None else stable
        for n, f in (("fast", fast), ("safe", safe), ("stable", stable)):
            _check_fn(n, f)
        self.paths = (fast, stable, safe)
        self.gear = SiteGear(jnp.zeros((), jnp.int32))
        self.site_name = name or getattr(fast, "__name__", type(self).__name__)
        self.probe_output = Probe(probe_lib.zeros()) if probe else nnx.data(None)

    def _gear(self) -> jax.Array:
        fill_default(self.gear)  # built by nnx.eval_shape: FAST
        return self.gear[...]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Runs the path of the current gear on ``args``/``kwargs``; returns its output."""
        leaves, treedef = jax.tree_util.tree_flatten((args, kwargs))
        where = [i for i, x in enumerate(leaves) if _is_operand(x)]

        def path(fn):
            def run(*operands):
                full = list(leaves)
                for i, x in zip(where, operands, strict=True):
                    full[i] = x
                a, kw = jax.tree_util.tree_unflatten(treedef, full)
                return fn(*a, **kw)

            return run

        operands = [leaves[i] for i in where]
        _check_paths_agree(self.site_name, self.paths, [path(f) for f in self.paths], operands)
        with site_scope(self.site_name), branch_site(self.site_name):
            out = ops.switch(self._gear(), [path(f) for f in self.paths], *operands)
            if self.probe_output is not None:
                # not ``leaves``: the paths read that name when the backward recomputes them
                outs = jax.tree_util.tree_leaves(out)
                floats = [x for x in outs if jnp.issubdtype(x.dtype, jnp.floating)]
                if floats:
                    write_probe(self.probe_output, probe_lib.sampled_stats(floats[0]))
        return out


def _check_paths_agree(site: str, fns, runs, operands) -> None:
    """Raises ``ValueError`` naming the site and the path when the paths' outputs differ in
    structure, shape or dtype (``lax.switch`` would raise a ``TypeError`` about its own
    branches, naming neither). ``jax.eval_shape`` of each path, at every call: a trace, not a
    computation, and no cache to go stale (static arguments change what a path returns) or to
    keep the paths' closures alive."""
    specs = tuple(jax.ShapeDtypeStruct(np.shape(x), x.dtype) for x in operands)
    outs = [jax.eval_shape(run, *specs) for run in runs]

    def describe(out):
        leaves, tree = jax.tree_util.tree_flatten(out)
        return tree, [f"{jnp.dtype(x.dtype).name}{list(x.shape)}" for x in leaves]

    want_tree, want = describe(outs[0])
    for label, fn, out in zip(("stable", "safe"), fns[1:], outs[1:], strict=True):
        tree, got = describe(out)
        if tree != want_tree or got != want:
            name = getattr(fn, "__name__", repr(fn))
            shown = lambda t, g: g[0] if t.num_leaves == 1 else f"{t} of {', '.join(g)}"  # noqa: E731
            raise ValueError(
                f"Site {site!r}: the {label} path ({name}) returns {shown(tree, got)}, the fast "
                f"path returns {shown(want_tree, want)}; every path must return the same "
                "structure, shapes and dtypes"
            )
