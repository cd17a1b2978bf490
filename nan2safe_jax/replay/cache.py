"""Compiled replays, kept across incidents of the same step.

The supervisor traces the step afresh for every incident and may replay several ring-buffer steps
of one traced step; the structure of the program is the same each time, only the values differ.
So compiled replays are kept per *program fingerprint* and, inside it, per structural key of the
replay (which level, which pass, which target equations): a second incident on a step of the same
shapes compiles nothing.

Replays are compiled with XLA's default pipeline (its passes and fusion as the production
step's), and on the CPU with LLVM's own optimisation off (``xla_backend_optimization_level``
0): a replay runs once or twice, and LLVM at -O3 was a third of a demo-size locate (13-17 s
cold, 9-11 s with it off, the same culprit). The values are the step's to the last bits or
so; ``locate_step`` checks the replays on the step's outputs (``Report.reproducible``) and,
should they not reproduce them, replays again compiled exactly as production
(``production_options``).
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from nan2safe_jax.replay import _jax_compat as jc

__all__ = ["CACHE", "ReplayCache", "fingerprint"]


def fingerprint(closed: Any) -> str:
    """Structural identity of a program: its printed jaxpr (equations, parameters, literals,
    shapes) plus its constants' shapes and dtypes (constants are replay arguments, so their values
    may differ). A jaxpr whose printout holds an object address simply never matches."""
    jaxpr, consts = jc.open_jaxpr(closed)
    avals = [(np.shape(c), str(jnp.result_type(c))) for c in consts]
    return f"{jaxpr}\n{avals}"


class ReplayCache:
    """``{fingerprint: {replay key: jitted function}}`` for the ``size`` most recent programs.

    The fingerprint of a program object seen before is found by identity (a jitted step traced
    again returns the same inner jaxpr object), else by printing it.
    """

    def __init__(self, size: int = 4):
        self.size = size
        self._tables: collections.OrderedDict[str, dict[Any, Any]] = collections.OrderedDict()
        self._by_id: dict[int, tuple[Any, str]] = {}

    def _fingerprint(self, closed: Any) -> str:
        jaxpr, _ = jc.open_jaxpr(closed)
        # A jitted step traces to one call equation whose body jaxpr is cached by JAX: use it,
        # when it is the whole program (a function around the jitted step that passes it a
        # closed-over array calls the same body with other operands: another program).
        inner = None
        if len(jaxpr.eqns) == 1 and not jaxpr.constvars:
            eqn = jaxpr.eqns[0]
            if list(eqn.invars) == list(jaxpr.invars) and list(eqn.outvars) == list(jaxpr.outvars):
                inner = eqn.params.get("jaxpr")
        anchor = inner if inner is not None else jaxpr
        hit = self._by_id.get(id(anchor))
        if hit is not None and hit[0] is anchor:
            return hit[1]
        fp = fingerprint(closed)
        self._by_id[id(anchor)] = (anchor, fp)
        return fp

    def table(self, closed: Any) -> dict[Any, Any]:
        """The replay table of ``closed``'s structure (created empty on first sight)."""
        fp = self._fingerprint(closed)
        hit = self._tables.get(fp)
        if hit is not None:
            self._tables.move_to_end(fp)
            return hit
        while len(self._tables) >= self.size:
            old, _ = self._tables.popitem(last=False)
            self._by_id = {k: v for k, v in self._by_id.items() if v[1] != old}
        table: dict[Any, Any] = {}
        self._tables[fp] = table
        return table

    def clear(self) -> None:
        self._tables.clear()
        self._by_id.clear()


CACHE = ReplayCache()


def compiled_stats(jitted: Any, *args: Any) -> dict[str, int]:
    """Sizes XLA reports for the compiled replay (``output``, ``temp``, ``argument`` bytes)."""
    m = jitted.lower(*args).compile().memory_analysis()
    if m is None:  # pragma: no cover - a backend without memory analysis
        return {}
    return {
        "output_bytes": int(m.output_size_in_bytes),
        "temp_bytes": int(m.temp_size_in_bytes),
        "argument_bytes": int(m.argument_size_in_bytes),
    }


_QUICK: contextvars.ContextVar[bool] = contextvars.ContextVar("nan2safe_quick", default=True)
_QUICK_OPTIONS = {"xla_backend_optimization_level": 0}


def quick() -> bool:
    """Whether replays compile with LLVM's optimisation off (the CPU, outside
    ``production_options``)."""
    return _QUICK.get() and jax.default_backend() == "cpu"


@contextlib.contextmanager
def production_options():
    """Replays traced inside compile exactly as the production step: plain ``jax.jit``."""
    token = _QUICK.set(False)
    try:
        yield
    finally:
        _QUICK.reset(token)


def jit(fn: Any) -> Any:
    """A replay's ``jax.jit``: XLA's defaults, LLVM's optimisation off while ``quick``."""
    return jax.jit(fn, compiler_options=_QUICK_OPTIONS) if quick() else jax.jit(fn)
