"""The persistent compilation cache: a restarted run loads its compiled programs from disk.

XLA compiles the step from scratch in every process: the FAST-only program before the first
step, the general one in a background thread after it, a partial program after an incident,
tier 2's replays. A run that resumes from its checkpoints builds the same programs (the same
shapes, the same gears as data), so JAX's own persistent cache serves every one of them from
the run's directory, and a restart skips most of the compile (README, "Compile time").

JAX keeps one cache per process, set through its config; this module only points it at a
directory when nothing else has, so a user's own ``jax_compilation_cache_dir`` (or
``JAX_COMPILATION_CACHE_DIR``) always wins.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import jax


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
    before = current()
    if before is not None:
        if before.resolve() != path.resolve():
            warnings.warn(
                f"compile_cache: JAX's compilation cache is already at {str(before)!r}; "
                f"kept there (not {str(path)!r})",
                stacklevel=2,
            )
        return before
    path.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(path))
    return path
