"""A run's workdir: checked writable, and held by one ``Trainer`` at a time.

Two trainers writing one workdir (a job launched twice, a notebook cell run again) would each
save their own states under the same step numbers; a later resume or rollback would then restore
a checkpoint of the other run. The trainer therefore holds an exclusive lock on the workdir
(``fcntl.flock`` on ``.nan2safe.lock``, released by ``close`` or when the process ends, so a
killed run never leaves it held; processes forked after it was taken, such as data-loader
workers, drop their copy):

* a trainer in another process holding it: the new one raises ``ValueError``;
* a trainer in this process holding it (the notebook case): the new one takes the workdir over,
  closing that one with a warning, once it has been built and has resumed (a new trainer that
  fails, e.g. on the checkpoints of a changed model, leaves the running one as it was).

Each process of a ``jax.distributed`` run locks its own log folder (``sharding.log_dir``), so the
processes of one run never contend, while a second run's process of the same index does. On a
filesystem without ``flock`` (some network mounts) the workdir is not held.
"""

from __future__ import annotations

import gc
import json
import os
import uuid
import warnings
import weakref
from pathlib import Path

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows: no advisory locks, the workdir is not held
    fcntl = None

LOCK_FILE = ".nan2safe.lock"

_held: dict[Path, weakref.ref] = {}  # lock path -> the owner (a Trainer) holding it here
_locks: weakref.WeakSet = weakref.WeakSet()  # every WorkdirLock holding its file in this process


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
        # a name of its own: the processes of one run check the shared workdir at once
        probe = path / f".nan2safe_write_test.{os.getpid()}.{uuid.uuid4().hex[:8]}"
        probe.write_text("ok")
        probe.unlink()
    except OSError as err:
        raise ValueError(f"workdir {str(path)!r} is not writable: {err}") from None
    return path


RUN_RECORD = "run.json"


def write_run_record(workdir: Path, run: dict) -> None:
    """Writes the run record ``workdir/run.json`` whole or not at all.

    The record is written at every start (a resume too). Written in place, a process killed or
    out of disk while writing it left a truncated file, and the run could no longer be resumed
    nor ``nan2safe locate``-d. A temporary file of this process, renamed over the record
    (``os.replace``, atomic on one filesystem), leaves the old record or the new one.

    Args:
      workdir: the run's folder.
      run: the record (factory, config, has_aux), JSON-serializable.

    A record that cannot be written (a full disk, a folder named ``run.json``) is warned about
    (``RuntimeWarning``); training does not depend on it.
    """
    path = Path(workdir) / RUN_RECORD
    tmp = path.with_name(f".{RUN_RECORD}.{os.getpid()}.{uuid.uuid4().hex[:8]}")
    try:
        tmp.write_text(json.dumps(run, indent=1))
        os.replace(tmp, path)
    except OSError as err:  # a full disk, a folder of that name: the checkpoints do not need it
        warnings.warn(
            f"cannot write the run record {str(path)!r} ({err}): training goes on; `nan2safe "
            "locate` then needs --factory",
            RuntimeWarning,
            2,
        )
    finally:
        tmp.unlink(missing_ok=True)


def read_run_record(workdir) -> dict:
    """The run record ``workdir/run.json``: ``{}`` when there is none, and ``{}`` with a
    ``RuntimeWarning`` naming the file when it cannot be read (damaged by a writer of an older
    version, or by hand): the run's checkpoints do not depend on it, only the recorded
    factory, config and ``has_aux`` are then unknown."""
    path = Path(workdir) / RUN_RECORD
    try:
        text = path.read_text()
    except FileNotFoundError:
        return {}
    except OSError as err:
        warnings.warn(f"cannot read the run record {str(path)!r}: {err}", RuntimeWarning, 2)
        return {}
    try:
        run = json.loads(text)
    except ValueError as err:
        warnings.warn(
            f"the run record {str(path)!r} is damaged ({err}); its factory, config and has_aux "
            "are unknown (a Trainer rewrites it)",
            RuntimeWarning,
            2,
        )
        return {}
    return run if isinstance(run, dict) else {}


def check_shared(workdir: Path) -> None:
    """In a run of several processes, checks that every process sees the same ``workdir``.

    The processes of a run save one checkpoint together (each writes its shards and orbax
    commits once all are written): a workdir on disks local to each machine left every
    process waiting for the others' files at the first checkpoint, silently. Each process
    writes a marker in a folder whose name process 0 chose, and reads the others' back.
    Free with one process.

    Raises:
      ValueError: some process does not see another's marker (names them).
    """
    import jax

    if jax.process_count() == 1:
        return
    import numpy as np
    from jax.experimental import multihost_utils

    n, me = jax.process_count(), jax.process_index()
    token = int(multihost_utils.broadcast_one_to_all(np.asarray(uuid.uuid4().int % 2**31)))
    folder = workdir / f".nan2safe_shared.{token}"
    folder.mkdir(exist_ok=True)
    (folder / str(me)).write_text("")
    multihost_utils.sync_global_devices("nan2safe: shared workdir markers written")
    seen = [(folder / str(i)).exists() for i in range(n)]
    table = multihost_utils.process_allgather(np.asarray(seen, np.int32))
    (folder / str(me)).unlink(missing_ok=True)
    multihost_utils.sync_global_devices("nan2safe: shared workdir markers read")
    try:  # by whichever process comes first (each, when the folders are not shared)
        folder.rmdir()
    except OSError:
        pass
    check_shared_table(np.asarray(table).reshape(n, n).astype(bool).tolist(), workdir)


def check_shared_table(seen, workdir) -> None:
    """Raises ValueError when a process did not see another's marker (``seen[i][j]``: process
    ``i`` saw process ``j``'s; what ``check_shared`` gathers)."""
    blind = {i: [j for j, ok in enumerate(row) if not ok] for i, row in enumerate(seen)}
    blind = {i: js for i, js in blind.items() if js}
    if blind:
        said = "; ".join(f"process {i} does not see processes {js}" for i, js in blind.items())
        raise ValueError(
            f"workdir {str(workdir)!r} is not one folder shared by the run's processes ({said}). "
            "They save each checkpoint together: give every process the same path on a shared "
            "filesystem"
        )


class WorkdirLock:
    """An exclusive hold on ``folder`` (see the module docstring).

    Built first, it raises when another process holds the folder; ``holder`` is then a trainer
    of this process that holds it (or None). ``take_over(owner)`` makes ``owner`` the holder,
    closing that one first.

    Args:
      folder: the folder to hold (created).

    Raises:
      ValueError: another process holds the folder.
    """

    def __init__(self, folder):
        self.path = (Path(folder) / LOCK_FILE).resolve()  # one key for every spelling of it
        self._file = None
        self._pending = None  # the open lock file, while a holder of this process has it
        self.holder = None
        if fcntl is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        f = open(self.path, "a+")  # noqa: SIM115 - held open for the owner's lifetime
        try:
            if not _try(f):
                ref = _held.get(self.path)
                self.holder = None if ref is None else ref()
                if self.holder is None:
                    gc.collect()  # a dropped holder in a reference cycle still has it open
                    if not _try(f):
                        _refuse(f, self.path)
        except BaseException:
            f.close()
            raise
        if self.holder is None:
            self._own(f)
        else:
            self._pending = f

    def _own(self, f) -> None:
        f.seek(0)
        f.truncate()
        f.write(f"{os.getpid()}\n")
        f.flush()
        self._file = f
        _locks.add(self)

    def take_over(self, owner) -> None:
        """Holds the folder for ``owner``: a holder of this process is closed (warned) first.

        Raises:
          ValueError: the folder is still held after that (another process took it).
        """
        if self._pending is not None:
            f, self._pending = self._pending, None
            holder, self.holder = self.holder, None
            if holder is not None and holder is not owner:
                warnings.warn(
                    f"a new Trainer takes workdir {str(self.path.parent)!r} over: the Trainer "
                    "that held it in this process is closed",
                    stacklevel=3,
                )
                holder.close()
            if not _try(f):
                try:
                    _refuse(f, self.path)
                finally:
                    f.close()
            self._own(f)
        if self._file is not None:
            _held[self.path] = weakref.ref(owner)

    def release(self) -> None:
        """Lets the folder go (the lock file stays: deleting it would race a new holder)."""
        if self._pending is not None:
            self._pending.close()
            self._pending = None
        if self._file is None:
            return
        if _held.get(self.path) is not None:
            del _held[self.path]
        _locks.discard(self)
        f, self._file = self._file, None
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)
        except OSError:  # no flock on this filesystem: nothing was held
            pass
        finally:
            f.close()


def _try(f) -> bool:
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    except OSError:  # a filesystem without flock (some network mounts): not held
        return True
    return True


def _refuse(f, path: Path) -> None:
    f.seek(0)
    pid = f.read().strip() or "unknown"
    raise ValueError(
        f"workdir {str(path.parent)!r} is in use by another Trainer (process {pid}); two runs "
        "in one workdir would overwrite each other's checkpoints. Stop that run, or give this "
        "one its own workdir"
    )


def _drop_in_child() -> None:
    """In a forked child: closes its copies of the lock files, without unlocking (the lock
    belongs to the parent; it goes with the parent's own copy)."""
    for lock in list(_locks):
        if lock._file is not None:
            lock._file.close()
            lock._file = None
    _held.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_drop_in_child)
