"""The persistent compilation cache: a restarted run loads its compiled programs from disk.

XLA compiles the step from scratch in every process: the FAST-only program before the first
step, the general one in a background thread after it, a partial program after an incident,
tier 2's replays. A run that resumes from its checkpoints builds the same programs (the same
shapes, the same gears as data), so JAX's own persistent cache serves every one of them from
the run's directory, and a restart skips most of the compile (README, "Compile time").

JAX keeps one cache per process, set through its config; this module only points it at a
directory when nothing else has, so a user's own ``jax_compilation_cache_dir`` (or
``JAX_COMPILATION_CACHE_DIR``) always wins. A directory it set for an earlier run of the
process is moved to the new run's (a second workdir in a notebook): that run's restarts find
their programs, and a first workdir deleted since costs no failed writes. A run that closes
lets its directory go (``release``): the process's later compiles, in no run, are not written
into a finished run's workdir, nor fail once that workdir is deleted.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import jax

# The directory this module pointed JAX's cache at, if it did: a later run's Trainer (a second
# workdir in the same process) moves the cache to its own, where a directory the user set is
# kept.
_ours: Path | None = None
# The open runs using each directory ``enable`` set (resolved path -> count): a run that closes
# lets it go only when no other run of the process uses it (a new Trainer resuming the
# workdir closes the old one after taking the directory).
_users: dict[str, int] = {}


def _use(path: Path) -> Path:
    key = str(path.resolve())
    _users[key] = _users.get(key, 0) + 1
    return path


def set_by_user() -> bool:
    """JAX's cache directory was set by the user (or the environment), not by ``enable``."""
    now = current()
    return now is not None and (_ours is None or now.resolve() != _ours.resolve())


def current() -> Path | None:
    """The directory JAX's persistent compilation cache uses now, or None when it is off."""
    if not jax.config.jax_enable_compilation_cache:
        return None
    path = jax.config.jax_compilation_cache_dir
    return Path(path) if path else None


def enable(path: str | os.PathLike) -> Path | None:
    """Points JAX's persistent compilation cache at ``path``, unless one is set already.

    Only programs that took at least ``jax_persistent_cache_min_compile_time_secs`` (1 s by
    default) to compile are written: a step is, JAX's own small eager programs are not.

    Args:
      path: the cache directory (created when missing).

    Returns:
      The directory the cache uses from now on: ``path``, or the one that was set before (a
      warning says so when that is another one), or None when the user turned the cache off
      (``jax_enable_compilation_cache=False``).

    Raises:
      ValueError: ``path`` exists and is not a directory.
    """
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise ValueError(f"compile_cache: {str(path)!r} exists and is not a directory")
    if not jax.config.jax_enable_compilation_cache:
        return None
    global _ours
    before = current()
    if before is not None and not set_by_user() and before.resolve() != path.resolve():
        # Set for an earlier run of this process (whose workdir may be gone): this run's own.
        from jax.experimental.compilation_cache import compilation_cache

        path.mkdir(parents=True, exist_ok=True)
        jax.config.update("jax_compilation_cache_dir", str(path))
        compilation_cache.reset_cache()  # JAX opened the old directory once; open this one
        _ours = path
        return _use(path)
    if before is not None:
        if not set_by_user():  # ours, for another run of this process at the same place
            return _use(before)
        if before.resolve() != path.resolve():
            warnings.warn(
                f"compile_cache: JAX's compilation cache is already at {str(before)!r}; "
                f"kept there (not {str(path)!r})",
                stacklevel=2,
            )
        return before
    path.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(path))
    _ours = path
    return _use(path)


def release(path: str | os.PathLike | None) -> None:
    """Turns JAX's cache off again when ``enable`` pointed it at ``path``, it is still there,
    and no other open run took it (each ``enable`` that returned it counts one run, each
    ``release`` one less); a directory the user set, or one a later run moved the cache to, is
    left alone.

    Without it a closed run's workdir took every later compile of the process that ran long
    enough to be cached, and once that workdir was deleted (a temporary folder) each one
    warned ``Error writing persistent compilation cache entry`` (newuser43).
    """
    global _ours
    key = None if path is None else str(Path(path).resolve())
    if key not in _users:
        return
    _users[key] -= 1
    if _users[key] > 0:
        return
    del _users[key]
    if _ours is None:
        return
    now = current()
    if now is None or now.resolve() != Path(path).resolve() or now.resolve() != _ours.resolve():
        return
    from jax.experimental.compilation_cache import compilation_cache

    jax.config.update("jax_compilation_cache_dir", None)
    compilation_cache.reset_cache()
    _ours = None
