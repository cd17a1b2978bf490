"""nan2safe_jax.compile_cache and Trainer(compile_cache=...): a resumed run loads its step."""

import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import jax
import optax
import pytest
from flax import nnx
from tiny_models import LLVM_O0, Net, loss_fn

from nan2safe_jax import Trainer, compile_cache


@pytest.fixture
def no_cache_set():
    """JAX's cache directory unset for the test (this suite sets one, tests/conftest.py), then
    put back; nothing compiles in between, so no program lands in the test's directory."""
    before = jax.config.jax_compilation_cache_dir
    jax.config.update("jax_compilation_cache_dir", None)
    yield
    jax.config.update("jax_compilation_cache_dir", before)


def test_enable_sets_the_directory_only_when_the_user_set_none(no_cache_set, tmp_path):
    """A directory ``enable`` set moves to the next run's (a second workdir in one process:
    its restarts find their programs, and the first workdir, maybe deleted, gets no writes);
    one the user set is kept, with a warning."""
    assert compile_cache.current() is None
    first = tmp_path / "a" / "cache"
    assert compile_cache.enable(first) == first
    assert first.is_dir() and compile_cache.current() == first
    assert compile_cache.enable(first) == first  # the same one again: no warning
    assert not compile_cache.set_by_user()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        second = tmp_path / "b"
        assert compile_cache.enable(second) == second and compile_cache.current() == second
    jax.config.update("jax_compilation_cache_dir", str(tmp_path / "user"))
    assert compile_cache.set_by_user()
    with pytest.warns(UserWarning, match="already at"):
        assert compile_cache.enable(tmp_path / "c") == tmp_path / "user"
    assert compile_cache.current() == tmp_path / "user"


def test_a_closed_run_lets_the_cache_directory_it_set_go(no_cache_set, tmp_path):
    """After ``Trainer.close`` the process's compiles no longer go to that run's workdir (a
    temporary folder deleted afterwards made each later compile warn, newuser43); a directory
    the user set stays."""
    with Trainer(Net(rngs=nnx.Rngs(0)), optax.adam(1e-3), loss_fn, workdir=tmp_path / "a") as tr:
        assert tr.compile_cache == tmp_path / "a" / "compile_cache"
        assert compile_cache.current() == tr.compile_cache
    assert compile_cache.current() is None
    compile_cache.release(tmp_path / "a" / "compile_cache")  # again: nothing to do
    # A new Trainer resuming the workdir closes the old one: the directory stays for the new
    # one (review25), and goes with the last
    first = Trainer(Net(rngs=nnx.Rngs(0)), optax.adam(1e-3), loss_fn, workdir=tmp_path / "a")
    second = Trainer(Net(rngs=nnx.Rngs(0)), optax.adam(1e-3), loss_fn, workdir=tmp_path / "a")
    assert first.closed and compile_cache.current() == second.compile_cache
    first.close()  # (again: counted once)
    assert compile_cache.current() == second.compile_cache
    second.close()
    assert compile_cache.current() is None
    # A Trainer whose __init__ fails lets the directory go too
    with pytest.raises(ValueError):
        Trainer(Net(rngs=nnx.Rngs(0)), optax.adam(1e-3), loss_fn, workdir=tmp_path / "c", rules=1)
    assert compile_cache.current() is None
    jax.config.update("jax_compilation_cache_dir", str(tmp_path / "user"))
    with Trainer(Net(rngs=nnx.Rngs(0)), optax.adam(1e-3), loss_fn, workdir=tmp_path / "b") as tr:
        assert tr.compile_cache == tmp_path / "user"
    assert compile_cache.current() == tmp_path / "user"


def test_enable_rejects_a_file(no_cache_set, tmp_path):
    path = tmp_path / "file"
    path.write_text("x")
    with pytest.raises(ValueError, match="compile_cache"):
        compile_cache.enable(path)
    assert compile_cache.current() is None


def test_trainer_keeps_the_cache_the_process_set_and_rejects_a_bad_setting(tmp_path):
    before = compile_cache.current()
    assert before is not None  # tests/conftest.py's
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the default setting keeps it without a word
        tr = Trainer(Net(rngs=nnx.Rngs(0)), optax.adam(1e-3), loss_fn, workdir=tmp_path / "r")
    with tr:
        assert tr.compile_cache == before
    assert not (tmp_path / "r" / "compile_cache").exists()
    with pytest.warns(UserWarning, match="already at"):  # an explicit one is not used
        tr = Trainer(
            Net(rngs=nnx.Rngs(0)),
            optax.adam(1e-3),
            loss_fn,
            workdir=tmp_path / "s",
            compile_cache=tmp_path / "mine",
        )
    with tr:
        assert tr.compile_cache == before
    with pytest.raises(ValueError, match="compile_cache"):
        Trainer(Net(rngs=nnx.Rngs(0)), optax.adam(1e-3), loss_fn, workdir=tmp_path, compile_cache=3)


_CHILD = textwrap.dedent(
    """
    import logging, sys
    sys.path.insert(0, {tests!r})
    seen = []

    class Seen(logging.Handler):
        def emit(self, record):
            msg = record.getMessage()
            for tag, kind in (("cache hit for '", "HIT"), ("CACHE MISS for '", "MISS")):
                if tag in msg:
                    seen.append((kind, msg.split(tag, 1)[1].split("'", 1)[0]))

    log = logging.getLogger("jax._src.compiler")
    log.setLevel(logging.DEBUG)
    log.addHandler(Seen())
    import optax
    from flax import nnx
    from nan2safe_jax import Config, Gear, Trainer, gear
    from tiny_models import Net, data, loss_fn

    tr = Trainer(Net(rngs=nnx.Rngs(0)), optax.adam(1e-3), loss_fn, Config(checkpoint_every=1),
                 {workdir!r})
    print("START", tr.step, tr.compile_cache, flush=True)
    x, y = data(4)
    seen.clear()
    for level in (Gear.FAST, Gear.STABLE):  # the FAST-only program, then the general one
        tr.state = tr.state.replace(gear=gear.set_level(tr.state.gear, level))
        tr.fit([(x[i], y[i]) for i in range(2)], steps=2)
    tr.close()
    for kind, name in seen:
        print(kind, name, flush=True)
    """
)


def test_a_resumed_run_loads_its_step_programs_from_the_workdir_cache(tmp_path):
    """Two processes on one workdir, the second resuming from the first's checkpoints: the
    second asks for the same two step programs (FAST-only, general) and loads both from
    ``workdir/compile_cache`` instead of compiling them."""
    workdir = tmp_path / "run"
    script = tmp_path / "child.py"
    script.write_text(_CHILD.format(tests=str(Path(__file__).parent), workdir=str(workdir)))
    env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
    # every program cached, however fast the tiny step compiles
    env |= dict(XLA_FLAGS=LLVM_O0, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
    runs = []
    for _ in range(2):
        out = subprocess.run(
            [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300
        )
        assert out.returncode == 0, out.stderr[-2000:]
        lines = out.stdout.splitlines()
        start = next(ln for ln in lines if ln.startswith("START")).split()
        assert Path(start[2]) == workdir / "compile_cache"
        runs.append((int(start[1]), [ln.split()[0] for ln in lines if ln.endswith("train_step")]))
    (start1, first), (start2, second) = runs
    assert start1 == 0 and start2 == 4  # the second run resumed
    assert first == ["MISS", "MISS"]  # compiled, and written to the cache
    assert second == ["HIT", "HIT"]  # loaded: nothing compiled again
    assert any((workdir / "compile_cache").iterdir())
