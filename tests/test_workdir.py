"""workdir: one trainer at a time per workdir, across processes and within one."""

import os
import signal
import subprocess
import sys
import textwrap
import time
import warnings

import pytest

from nan2safe_jax import workdir as workdir_lib
from nan2safe_jax.workdir import WorkdirLock, check_workdir

_OTHER_PROCESS = textwrap.dedent(
    """
    import sys
    from nan2safe_jax.workdir import WorkdirLock
    class Owner:
        pass
    try:
        WorkdirLock(sys.argv[1]).take_over(Owner())
    except ValueError as err:
        print("refused:", err)
    else:
        print("held")
    """
)


class _Owner:
    def __init__(self, folder):
        self.closed = False
        self.lock = WorkdirLock(folder)
        self.lock.take_over(self)

    def close(self):
        self.closed = True
        self.lock.release()


def _other_process(folder) -> str:
    out = subprocess.run(
        [sys.executable, "-c", _OTHER_PROCESS, str(folder)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return out.stdout.strip()


def test_another_process_is_refused_while_the_workdir_is_held(tmp_path):
    owner = _Owner(tmp_path)
    said = _other_process(tmp_path)
    assert said.startswith("refused:") and f"process {os.getpid()}" in said, said
    assert "own workdir" in said
    owner.close()
    assert _other_process(tmp_path) == "held"  # let go by close: the next run may start


def test_a_newer_holder_in_the_same_process_takes_over_only_when_it_says_so(tmp_path):
    old = _Owner(tmp_path)
    (tmp_path / "sub").mkdir()
    alias = tmp_path / "sub" / ".." / "alias"
    alias.symlink_to(tmp_path)
    pending = WorkdirLock(alias)  # another spelling of the same folder: the same hold
    assert pending.holder is old and not old.closed  # nothing happens until take_over
    new = object.__new__(_Owner)
    new.closed, new.lock = False, pending
    with pytest.warns(UserWarning, match="takes workdir .* over"):
        pending.take_over(new)
    assert old.closed and not new.closed
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        new.close()
        again = _Owner(tmp_path)  # a released workdir is taken without a word
    # A lock built and then dropped (its trainer failed before take_over) holds nothing.
    WorkdirLock(tmp_path).release()
    assert not again.closed
    again.close()


def test_a_forked_child_does_not_keep_the_workdir_after_its_parent_dies(tmp_path):
    """Data-loader workers forked after the trainer started inherit the lock file; they drop
    their copy, so a killed run's workdir is free again while they live on."""
    script = textwrap.dedent(
        f"""
        import os, time
        from nan2safe_jax.workdir import WorkdirLock
        class Owner:
            pass
        owner = Owner()
        lock = WorkdirLock({str(tmp_path)!r})
        lock.take_over(owner)
        if os.fork() == 0:
            time.sleep(60)
            os._exit(0)
        print("ready", flush=True)
        time.sleep(60)
        """
    )
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout.readline().strip() == "ready"
        assert _other_process(tmp_path).startswith("refused:")
        parent.send_signal(signal.SIGKILL)
        parent.wait(timeout=30)
        time.sleep(0.2)
        assert _other_process(tmp_path) == "held"  # the orphaned child still sleeps
    finally:
        parent.kill()
        subprocess.run(["pkill", "-f", str(tmp_path)], check=False)


def test_release_on_a_filesystem_without_flock_does_not_raise(tmp_path, monkeypatch):
    owner = _Owner(tmp_path)

    def no_flock(fd, op):
        raise OSError(38, "Function not implemented")

    monkeypatch.setattr(workdir_lib.fcntl, "flock", no_flock)
    owner.close()  # the unlock fails as the lock did: nothing to let go
    held = _Owner(tmp_path)  # not held on such a filesystem, and not refused
    held.close()


def test_check_workdir_names_what_is_wrong(tmp_path):
    with pytest.raises(ValueError, match="workdir is required"):
        check_workdir(None)
    (tmp_path / "f").write_text("x")
    with pytest.raises(ValueError, match="not a directory"):
        check_workdir(tmp_path / "f")
    assert check_workdir(tmp_path / "new").is_dir()
    assert not [p for p in (tmp_path / "new").iterdir()]  # its write test leaves nothing
