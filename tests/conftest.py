"""Shared fixtures: a backend-compile counter for the "gear changes never recompile" tests."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile

# Test runs are short: the step's second program compiles when first needed, not in a
# background thread (nan2safe_jax.programs; tests/test_programs.py turns it on where it tests it).
os.environ.setdefault("NAN2SAFE_BACKGROUND_COMPILE", "0")

# One persistent XLA compilation cache for the whole run, shared by every xdist worker and every
# subprocess a test starts (they inherit the environment): the suite compiles the same tiny
# train steps and replays many times over. A fresh directory per run, removed at its end, so a
# run never reads what an earlier run compiled. Only programs that took 0.5 s or more to compile
# are written: the suite's eager single-op compiles are cheaper to redo than to key, serialise
# and write (tests/test_ops.py + tests/test_train.py, one run each: 2:15 with every program
# cached, 2:05 with this threshold; the runs' own spread is about 5%).
_OWN_CACHE = None
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _OWN_CACHE = os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="n2s-xla-")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

# LLVM at -O0 for every program the suite compiles (tests/tiny_models.py, LLVM_O0): XLA's HLO
# passes, fusion and numerics-relevant rewrites still run, LLVM's own optimisations do not, and
# the tiny programs here spend far longer compiling than running (the whole suite: 9:07 against
# 11:49, one run each on 2 cores, 2026-12-03). Bits can move between two differently fused
# programs at -O0, so a test that compares bits with flax compiles at XLA's default level
# (``tiny_models.jit_llvm_default``). Subprocesses inherit it; an explicit level in XLA_FLAGS
# is left alone.
#
# XLA:CPU's older (non-MLIR) fusion emitters too, where this jaxlib has the flag: they compile
# the suite's programs in about half the time (a Trainer tier-2 test alone: its replays 5.0 s
# -> 2.6 s of compiling, its train step 1.8 s -> 0.6 s, the test 10.8 s -> 6.7 s; 2026-12-07).
# A fused kernel is generated differently, so the last bit of a result can move between two
# differently fused programs: the tests that compare bits with flax compile with the default
# emitters (``tiny_models.BITS_OPTIONS``). XLA aborts on a flag it does not know, so a
# subprocess tries it first, once per run; the workers and the tests' subprocesses inherit the
# answer (``NAN2SAFE_TEST_XLA_FLAGS``, ``tiny_models.LLVM_O0``).
_OLD_EMITTERS = "--xla_cpu_use_fusion_emitters=false"


def _xla_accepts(flag: str) -> bool:
    env = dict(os.environ, XLA_FLAGS=flag, JAX_PLATFORMS="cpu")
    probe = [sys.executable, "-c", "import jax; jax.devices()"]
    try:
        return subprocess.run(probe, env=env, capture_output=True, timeout=300).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


if "NAN2SAFE_TEST_XLA_FLAGS" not in os.environ:
    _suite = "--xla_backend_optimization_level=0"
    if _xla_accepts(_OLD_EMITTERS):
        _suite += f" {_OLD_EMITTERS}"
    os.environ["NAN2SAFE_TEST_XLA_FLAGS"] = _suite
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    _flags = os.environ.get("XLA_FLAGS", "")
    os.environ["XLA_FLAGS"] = f"{_flags} {os.environ['NAN2SAFE_TEST_XLA_FLAGS']}".strip()

import jax  # noqa: E402
import pytest  # noqa: E402

# (also when a plugin imported jax before the variables above were set)
jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
jax.config.update(
    "jax_persistent_cache_min_compile_time_secs",
    float(os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"]),
)
jax.config.update(
    "jax_persistent_cache_min_entry_size_bytes",
    int(os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"]),
)

_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
# A program the persistent cache above serves is a compile all the same (the process asked
# for one), but XLA does not run: counted from the cache's own event.
_CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"
_counter = {"n": 0}


def _on_duration(event: str, duration: float, **kwargs) -> None:
    del duration, kwargs
    if event == _COMPILE_EVENT:
        _counter["n"] += 1


def _on_event(event: str, **kwargs) -> None:
    del kwargs
    if event == _CACHE_HIT_EVENT:
        _counter["n"] += 1


jax.monitoring.register_event_duration_secs_listener(_on_duration)
jax.monitoring.register_event_listener(_on_event)


class CompileCounter:
    """Counts the programs compiled inside ``with counter:`` blocks: XLA backend compiles and
    programs loaded from the persistent compilation cache instead."""

    def __init__(self):
        self.count = 0

    @contextlib.contextmanager
    def __call__(self):
        start = _counter["n"]
        try:
            yield self
        finally:
            self.count = _counter["n"] - start


@pytest.fixture
def count_compiles():
    """``with count_compiles() as c: ...`` then ``c.count`` is the number of programs compiled
    (or loaded from the compilation cache)."""
    return CompileCounter()


@pytest.fixture(scope="session", autouse=True)
def _one_program_unless_marked():
    """``make_train_step`` builds one general program in this suite (``fast_program=False``):
    a test that downshifts would otherwise compile the step twice, and ``make test`` must stay
    under 10 minutes on 2 cores. Tests marked ``two_programs`` (``tests/test_programs.py``, the
    Trainer's located-and-recovers test) run the default, both programs; ``make demo`` runs it
    end to end."""
    from nan2safe_jax import train

    defaults = train.make_train_step.__kwdefaults__
    before = defaults["fast_program"]
    defaults["fast_program"] = False
    yield
    defaults["fast_program"] = before


@pytest.fixture(autouse=True)
def _two_programs_when_marked(request):
    if request.node.get_closest_marker("two_programs") is None:
        yield
        return
    from nan2safe_jax import train

    defaults = train.make_train_step.__kwdefaults__
    defaults["fast_program"] = True
    yield
    defaults["fast_program"] = False


def load_benchmark(name: str):
    """The script ``benchmarks/<name>.py`` as the module ``name`` (registered in
    ``sys.modules``, so the scripts' imports of each other find it)."""
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="session")
def benchmark_module():
    """``benchmark_module("zoo")``: ``load_benchmark`` for tests."""
    return load_benchmark


def pytest_sessionfinish(session, exitstatus):
    """The process that made the run's compilation cache removes it (xdist workers inherit its
    path and leave it alone)."""
    del session, exitstatus
    if _OWN_CACHE is not None:
        shutil.rmtree(_OWN_CACHE, ignore_errors=True)


# The longest files first (seconds of test time on the 2-core machine, 2026-12-07): pytest-xdist's
# ``--dist loadfile`` hands out whole files in collection order, so a long file collected last
# (test_trainer.py, 190 s, is late in the alphabet) ran alone on one worker at the end while the
# other idled. Longest first is the classic greedy balance; the order within a file is kept.
_LONGEST_FIRST = (
    "test_trainer.py",
    "test_train.py",
    "test_nn_flax_compat.py",
    "test_replay.py",
    "test_ops.py",
    "test_programs.py",
    "test_sharding.py",
    "test_user_site.py",
    "test_nn.py",
    "test_decode.py",
    "test_recovery.py",
    "test_replay_scale.py",
    "test_kernels.py",
    "test_cnn_layers.py",
)


def pytest_collection_modifyitems(session, config, items):
    """Collected files ordered longest first (``_LONGEST_FIRST``, then the rest as collected)."""
    del session, config
    rank = {name: i for i, name in enumerate(_LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: keeps the rest
