"""The train step's two compiled programs, and which one runs a step.

A site dispatches on its gear with one ``cond`` per op: FAST's value passes through at FAST, the
STABLE or SAFE path runs otherwise. Those branches are most of what XLA compiles for the step,
and on the CPU each ``cond`` is a fusion boundary that a FAST step pays for (docs/design.md). Yet
almost every step of a run has every gear at FAST. So ``make_train_step`` compiles the same step
function twice:

* **FAST-only**: ``train_step(fast_only=True)``, traced with every site's gear a constant FAST:
  no switch is traced, so XLA compiles and runs what the FAST paths are (flax's own layers, with
  probes). The gear logic still runs on the state's gears and decides the next ones.
* **general**: the state's gears traced as data: every gear's path compiled once; changing gear
  never retraces or recompiles.

A state whose gears are all FAST runs the FAST-only program, any other the general one. The
choice needs the gears on the host: the previous step's ``metrics["next_all_fast"]`` (one bool;
reading it waits for that step, which a loop that reads its loss does anyway), or the gears
themselves for a state the last step did not return (gears set by hand or by the trainer).

The program not needed first is compiled in a background thread as soon as the first one has
run, so the first downshift (or the first recovery to FAST) finds it ready: a gear change waits
for a compile only when it comes before that compile has finished. A script that ends while that
compile runs waits for it (XLA cannot be stopped mid-compile; a daemon thread would crash the
exit). ``NAN2SAFE_BACKGROUND_COMPILE=0`` turns it off: the other program then compiles when it is
first needed (the test suite does this: its runs are short).
"""

from __future__ import annotations

import concurrent.futures
import os
import threading
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from nan2safe_jax import gear as gear_lib

__all__ = ["StepPrograms", "all_fast", "background_default"]


def background_default() -> bool:
    """Whether steps compile their other program in the background (``NAN2SAFE_BACKGROUND_COMPILE``,
    default on)."""
    return os.environ.get("NAN2SAFE_BACKGROUND_COMPILE", "1").strip().lower() not in (
        "0",
        "false",
        "no",
        "off",
    )


def all_fast(gs: gear_lib.GearState) -> bool:
    """Whether every gear of ``gs`` (the level and each site's) is FAST, read on the host."""
    leaves = jax.device_get(jax.tree_util.tree_leaves((gs.level, gs.sites)))
    return all(not np.any(np.asarray(x) > int(gear_lib.Gear.FAST)) for x in leaves)


def _abstract(tree: Any) -> Any:
    """``tree`` with each array replaced by its shape, dtype, weak type and sharding."""

    def one(x):
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            return x
        sharding = getattr(x, "sharding", None) if isinstance(x, jax.Array) else None
        weak = bool(getattr(x, "weak_type", False))
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding, weak_type=weak)

    return jax.tree_util.tree_map(one, tree)


class StepPrograms:
    """Runs a step with the FAST-only or the general program (see the module docstring).

    Args:
      fast: the jitted FAST-only step ``(state, batch) -> (state, metrics)``.
      general: the jitted general step, same signature.
      background: compile the other program in a background thread after the first step
        (default: ``background_default()``).
    """

    def __init__(self, fast: Callable, general: Callable, background: bool | None = None):
        self._jit = {True: fast, False: general}
        self._aot: dict[bool, concurrent.futures.Future] = {}
        self._ran: set[bool] = set()  # programs that have run (compiled by their jit)
        self._background = background_default() if background is None else background
        self._last: tuple[Any, Any] | None = None  # (gears the last step returned, next_all_fast)
        self.last_program: str | None = None  # "fast" or "general": what ran the last step

    def is_fast(self, state: Any) -> bool:
        """Whether ``state`` runs the FAST-only program."""
        last = self._last
        if last is not None and state.gear is last[0]:
            return bool(last[1])
        return all_fast(state.gear)

    def __call__(self, state: Any, batch: Any) -> tuple[Any, dict]:
        fast = self.is_fast(state)
        other = None
        if self._background and not ({not fast} & (self._ran | set(self._aot))):
            other = _abstract((state, batch))  # before the call: it may donate the state
        new_state, metrics = self._run(fast, state, batch)
        self._ran.add(fast)
        self.last_program = "fast" if fast else "general"
        if other is not None:
            self._compile_later(not fast, other)
        self._last = (new_state.gear, metrics["next_all_fast"])
        return new_state, metrics

    def _run(self, fast: bool, state: Any, batch: Any) -> tuple[Any, dict]:
        future = self._aot.get(fast)
        exe = future.result() if future is not None else None  # waits if still compiling
        if exe is not None:
            try:
                return exe(state, batch)
            except (TypeError, ValueError):  # other shapes or structure than it was built for
                self._aot.pop(fast, None)
        return self._jit[fast](state, batch)

    def _compile_later(self, fast: bool, args: tuple) -> None:
        future: concurrent.futures.Future = concurrent.futures.Future()

        def build():
            try:
                future.set_result(self._jit[fast].lower(*args).compile())
            except Exception:  # noqa: BLE001 - the jit path compiles it when it is needed
                future.set_result(None)

        self._aot[fast] = future
        threading.Thread(target=build, name="nan2safe-compile").start()

    def wait(self) -> None:
        """Blocks until the background compiles are done (benchmarks time steps after it)."""
        for future in list(self._aot.values()):
            future.result()
