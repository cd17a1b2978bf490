"""A run's workdir: checked writable, and held by one ``Trainer`` at a time.

Two trainers writing one workdir (a job launched twice, a notebook cell run again) would each
save their own states under the same step numbers; a later resume or rollback would then restore
a checkpoint of the other run. The trainer therefore holds an exclusive lock on the workdir
(``fcntl.flock`` on ``.nan2safe.lock``, released by ``close`` or when the process ends, so a
killed run never leaves it held):

* a trainer in another process holding it: the new one raises ``ValueError``;
* a trainer in this process holding it (the notebook case): that one is closed, with a warning,
  and the new one takes the workdir over.

Each process of a ``jax.distributed`` run locks its own log folder (``sharding.log_dir``), so the
processes of one run never contend, while a second run's process of the same index does.
"""

from __future__ import annotations

import gc
import os
import warnings
import weakref
from pathlib import Path

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows: no advisory locks, the workdir is not held
    fcntl = None

LOCK_FILE = ".nan2safe.lock"

# lock path -> the owner (a Trainer) holding it in this process
_held: dict[Path, weakref.ref] = {}


def check_workdir(workdir) -> Path:
    """``workdir`` as a ``Path``, created, after checking that it can be written.

    Raises:
      ValueError: None, a file, or a folder this process cannot write.
    """
    if workdir is None:
        raise ValueError("workdir is required: checkpoints, events and incidents are kept there")
    path = Path(workdir)
    if path.exists() and not path.is_dir():
        raise ValueError(f"workdir {str(path)!r} exists and is not a directory")
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / ".nan2safe_write_test"
        probe.write_text("ok")
        probe.unlink()
    except OSError as err:
        raise ValueError(f"workdir {str(path)!r} is not writable: {err}") from None
    return path


class WorkdirLock:
    """An exclusive hold on ``folder`` for ``owner`` (see the module docstring).

    Args:
      folder: the folder to hold (created).
      owner: the object holding it; ``owner.close()`` is called when a newer holder in this
        process takes the folder over.

    Raises:
      ValueError: another process holds the folder.
    """

    def __init__(self, folder, owner):
        self.path = (Path(folder) / LOCK_FILE).absolute()
        self._file = None
        if fcntl is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        f = open(self.path, "a+")  # noqa: SIM115 - held open for the owner's lifetime
        try:
            if not self._try(f):
                self._take_over(f, owner)
            f.seek(0)
            f.truncate()
            f.write(f"{os.getpid()}\n")
            f.flush()
        except BaseException:
            f.close()
            raise
        self._file = f
        _held[self.path] = weakref.ref(owner)

    @staticmethod
    def _try(f) -> bool:
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        except OSError:  # a filesystem without flock (some network mounts): not held
            return True
        return True

    def _take_over(self, f, owner) -> None:
        ref = _held.get(self.path)
        holder = None if ref is None else ref()
        if holder is not None and holder is not owner:
            warnings.warn(
                f"a new Trainer takes workdir {str(self.path.parent)!r} over: the Trainer that "
                "held it in this process is closed",
                stacklevel=4,
            )
            holder.close()
        else:
            gc.collect()  # a dropped holder in a reference cycle still has the file open
        if self._try(f):
            return
        f.seek(0)
        pid = f.read().strip() or "unknown"
        raise ValueError(
            f"workdir {str(self.path.parent)!r} is in use by another Trainer (process {pid}); "
            "two runs in one workdir would overwrite each other's checkpoints. Stop that run, "
            "or give this one its own workdir"
        )

    def release(self) -> None:
        """Lets the folder go (the lock file stays: deleting it would race a new holder)."""
        if self._file is None:
            return
        if _held.get(self.path) is not None:
            del _held[self.path]
        fcntl.flock(self._file.fileno(), fcntl.LOCK_UN)
        self._file.close()
        self._file = None
