"""The train step's two compiled programs, and which one runs a step.

A site dispatches on its gear with one ``cond`` per op: FAST's value passes through at FAST, the
STABLE or SAFE path runs otherwise. Those branches are most of what XLA compiles for the step,
and on the CPU each ``cond`` is a fusion boundary that a FAST step pays for (docs/design.md). Yet
almost every step of a run has every gear at FAST. So ``make_train_step`` compiles the same step
function twice:

* **FAST-only**: ``train_step(fast_only=True)``, traced with every site's gear a constant FAST:
  no switch is traced, so XLA compiles and runs what the FAST paths are (flax's own layers, with
  probes). The gear logic still runs (on FAST gears, known at trace time) and decides the
  next ones.
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

After an incident one site sits in SAFE, then STABLE (``safe_max_steps`` plus at least
``recovery_window`` steps: 72 by default) while every other gear is FAST. The general program
would run all those steps with a switch per op of every site. So, with the background compile
on, such a state also starts a **partial program** in the background: ``train_step`` with the
FAST sites' gears FAST at trace time (``fast_sites``) and a switch only in the sites that are
not FAST. Its key is the set of FAST sites; the general program runs the steps until it is
ready (a step never waits for it), and the set's gear changes (SAFE -> STABLE) run in it
without a recompile. At most ``max_partial`` (4) are built per step function; a state whose level
is not FAST, or with no FAST site, runs the general program.
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

__all__ = [
    "MAX_KNOWN",
    "StepPrograms",
    "all_fast",
    "background_default",
    "compiled_programs",
    "fast_sites",
    "known_gears",
    "program_for",
    "replay_programs",
]


# The most gear sets that get a replay program of their own (``replay_programs``). A cold
# replay of one cost 5.8-7.4 s on the demo rows against 9.6-38.9 s for the general program,
# whose later replays, for any gear set, are warm (0.2-0.5 s): past four, the general one.
MAX_KNOWN = 4


def background_default() -> bool:
    """Whether steps compile their other program in the background (``NAN2SAFE_BACKGROUND_COMPILE``,
    default on)."""
    return os.environ.get("NAN2SAFE_BACKGROUND_COMPILE", "1").strip().lower() not in (
        "0",
        "false",
        "no",
        "off",
    )


def program_for(step: Any, state: Any) -> Any:
    """The compiled program a ``make_train_step`` step runs for ``state``: its FAST-only one
    for an all-FAST state, else its general one (what tier 2 replays; the step itself commits
    its state on the host, so it cannot be traced). Anything else is returned as it is.

    Args:
      step: a ``make_train_step`` result, or any function.
      state: the ``TrainState`` the step is called with.

    Returns:
      A jitted function of ``(state, batch)``, or ``step``.
    """
    jitted = getattr(step, "jitted", None)
    if jitted is None:
        return step
    fast = getattr(step, "jitted_fast", None)
    gear = getattr(state, "gear", None)
    return fast if fast is not None and gear is not None and all_fast(gear) else jitted


def _host_gears(gs: gear_lib.GearState) -> tuple[np.ndarray, gear_lib.SiteValues]:
    """The level and the sites' gears of ``gs`` on the host, in one read."""
    return jax.device_get((gs.level, gear_lib.SiteValues.of(gs.sites)))


def known_gears(gs: gear_lib.GearState) -> tuple[tuple[str, int], ...]:
    """``((site, gear), ...)``: each site's effective gear (``gear.effective``), read on the host,
    for the sites whose layers all share one; a stacked site whose layers differ is left out.
    The key of a replay program (``replay_programs``)."""
    level, sites = _host_gears(gs)
    level = int(np.max(np.asarray(level)))
    out = []
    for name, g in sites.items():
        eff = np.unique(np.maximum(np.asarray(g), level))
        if eff.size == 1:
            out.append((name, int(eff[0])))
    return tuple(out)


def replay_programs(step: Any, state: Any) -> list[Any]:
    """The programs tier 2 replays a ``make_train_step`` step's failing ``state`` in, in order:
    the FAST-only one for an all-FAST state; else one traced with the state's own gears as
    constants (``step.jitted_known``: one path per op, as the FAST-only program has), then the
    general one (which ran the step, or computes what the partial program that ran it did), if
    the first does not reproduce the failure. A step built with ``jit=False`` has no
    known-gear program; past ``MAX_KNOWN`` gear sets, the general program alone is replayed.

    The general program computes FAST at every gear and drops it, and a replay instruments each
    path it holds: on a 2-layer fp16 decoder after tier 1's downshift, its first (cold) locate
    took 91 s, against 15 s at FAST. Anything else than such a step is returned alone.

    Args:
      step: a ``make_train_step`` result, or any function.
      state: the ``TrainState`` the step failed on.

    Returns:
      One to two functions of ``(state, batch)``.
    """
    program = program_for(step, state)
    known = getattr(step, "jitted_known", None)
    if program is getattr(step, "jitted_fast", None) or known is None:
        return [program]
    gear = getattr(state, "gear", None)
    if gear is None:
        return [program]
    first = known(known_gears(gear))
    return [program] if first is None or first is program else [first, program]


def compiled_programs(step: Any, program: Any) -> list[Any]:
    """The executables a ``make_train_step`` step compiled in the background for ``program``
    (its ``jitted`` or ``jitted_fast``), one per sharding layout that has one: what ran the
    step when the background compile built it first. Calling ``program`` itself would compile
    it once more (its jit never ran), which at the GPT-2-small shape costs as much as the
    step's first compile. Empty for anything else."""
    fast = program is getattr(step, "jitted_fast", None)
    if not fast and program is not getattr(step, "jitted", None):
        return []
    out = []
    for runner in getattr(step, "programs", None) or ():
        exe = runner.executable(fast)
        if exe is not None:
            out.append(exe)
    return out


def all_fast(gs: gear_lib.GearState) -> bool:
    """Whether every gear of ``gs`` (the level and each site's) is FAST, read on the host."""
    fast = fast_sites(gs)
    return fast is not None and len(fast) == len(gs.sites)


def fast_sites(gs: gear_lib.GearState) -> frozenset[str] | None:
    """The sites whose gear is FAST (every layer of a stacked one), read on the host; None when
    the level is not FAST (then every site's effective gear is above FAST)."""
    level, sites = _host_gears(gs)
    if np.any(np.asarray(level) > int(gear_lib.Gear.FAST)):
        return None
    fast = int(gear_lib.Gear.FAST)
    if not np.any(np.asarray(sites.flat) > fast):  # the usual case: one read of one vector
        return frozenset(sites)
    return frozenset(k for k, g in sites.items() if not np.any(np.asarray(g) > fast))


def _done(result: Any) -> concurrent.futures.Future:
    future: concurrent.futures.Future = concurrent.futures.Future()
    future.set_result(result)
    return future


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
    """Runs a step with the FAST-only, a partial or the general program (see the module doc).

    Args:
      fast: the jitted FAST-only step ``(state, batch) -> (state, metrics)``.
      general: the jitted general step, same signature.
      background: compile the other program in a background thread after the first step
        (default: ``background_default()``), and the partial programs.
      partial: ``sites -> `` the jitted partial step with ``sites`` FAST at trace time; None
        builds none.
      max_partial: the most partial programs built.
    """

    def __init__(
        self,
        fast: Callable,
        general: Callable,
        background: bool | None = None,
        partial: Callable[[frozenset[str]], Callable] | None = None,
        max_partial: int = 4,
    ):
        self._jit: dict[Any, Callable] = {True: fast, False: general}
        self._aot: dict[Any, concurrent.futures.Future] = {}
        self._ran: set[bool] = set()  # programs that have run (compiled by their jit)
        self._background = background_default() if background is None else background
        self._partial = partial
        self._max_partial = max_partial
        self._last: tuple[Any, Any] | None = None  # (gears the last step returned, next_all_fast)
        self.last_program: str | None = None  # "fast", "partial" or "general": the last step's

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
        key = self._partial_key(state) if not fast else None
        if key is not None and key not in self._aot:
            self._compile_later(key, other or _abstract((state, batch)))
        new_state, metrics = self._run(fast, state, batch, key)
        if self.last_program != "partial":
            self._ran.add(fast)
        if other is not None:
            self._compile_later(not fast, other)
        self._last = (new_state.gear, metrics["next_all_fast"])
        return new_state, metrics

    def _partial_key(self, state: Any) -> frozenset[str] | None:
        """The partial program for a state that is not all FAST: its FAST sites, or None (the
        general program: no partial programs, a level above FAST, no FAST site, or
        ``max_partial`` built already for other sets)."""
        if self._partial is None or not self._background:
            return None
        key = fast_sites(state.gear)
        if not key:
            return None
        built = sum(isinstance(k, frozenset) for k in self._aot)
        return key if key in self._aot or built < self._max_partial else None

    def _run(self, fast: bool, state: Any, batch: Any, partial=None) -> tuple[Any, dict]:
        future = self._aot.get(partial) if partial is not None else None
        if future is not None and future.done() and future.result() is not None:
            try:  # a partial program is used once built, never waited for
                out = future.result()(state, batch)
                self.last_program = "partial"
                return out
            except (TypeError, ValueError):  # other shapes than it was built for: never again
                self._aot[partial] = _done(None)
        self.last_program = "fast" if fast else "general"
        future = self._aot.get(fast)
        exe = future.result() if future is not None else None  # waits if still compiling
        if exe is not None:
            try:
                return exe(state, batch)
            except (TypeError, ValueError):  # other shapes or structure than it was built for
                self._aot.pop(fast, None)
        return self._jit[fast](state, batch)

    def _compile_later(self, key: Any, args: tuple) -> None:
        future: concurrent.futures.Future = concurrent.futures.Future()
        if isinstance(key, frozenset):
            self._jit[key] = self._partial(key)

        def build():
            try:
                future.set_result(self._jit[key].lower(*args).compile())
            except Exception:  # noqa: BLE001 - the jit path compiles it when it is needed
                future.set_result(None)

        self._aot[key] = future
        threading.Thread(target=build, name="nan2safe-compile").start()

    def executable(self, fast: bool) -> Any:
        """The FAST-only (or general) program's background-compiled executable, or None (not
        built, still compiling, or failed)."""
        future = self._aot.get(fast)
        return future.result() if future is not None and future.done() else None

    def lower(self, state: Any, batch: Any, fast: bool = True) -> Any:
        """``jax.stages.Lowered`` of the FAST-only (or general) program for these arguments:
        its compiled text shows what the step runs (e.g. a sharded step's collectives)."""
        return self._jit[fast].lower(state, batch)

    def wait(self) -> None:
        """Blocks until the background compiles are done (benchmarks time steps after it)."""
        for future in list(self._aot.values()):
            future.result()
