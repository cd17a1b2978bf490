"""workdir: one trainer at a time per workdir, across processes and within one."""

import os
import subprocess
import sys
import textwrap
import warnings

import pytest

from nan2safe_jax.workdir import WorkdirLock, check_workdir

_OTHER_PROCESS = textwrap.dedent(
    """
    import sys
    from nan2safe_jax.workdir import WorkdirLock
    class Owner:
        pass
    try:
        WorkdirLock(sys.argv[1], Owner())
    except ValueError as err:
        print("refused:", err)
    else:
        print("held")
    """
)


class _Owner:
    def __init__(self, folder):
        self.closed = False
        self.lock = WorkdirLock(folder, self)

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


def test_a_newer_holder_in_the_same_process_takes_over_and_closes_the_old(tmp_path):
    old = _Owner(tmp_path)
    with pytest.warns(UserWarning, match="takes workdir .* over"):
        new = _Owner(tmp_path)
    assert old.closed and not new.closed
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        new.close()
        again = _Owner(tmp_path)  # a released workdir is taken without a word
    again.close()


def test_check_workdir_names_what_is_wrong(tmp_path):
    with pytest.raises(ValueError, match="workdir is required"):
        check_workdir(None)
    (tmp_path / "f").write_text("x")
    with pytest.raises(ValueError, match="not a directory"):
        check_workdir(tmp_path / "f")
    assert check_workdir(tmp_path / "new").is_dir()
