"""A hang watchdog for runs of several processes.

A process of a ``jax.distributed`` run that hangs without dying (stuck in its data loader, a
deadlocked thread, a filesystem that stopped answering) keeps sending heartbeats, so the
coordination service never stops the others: they wait in the step's collective forever, and
the job holds its machines doing nothing. The ``Trainer`` of such a run arms a ``Watchdog``
while ``fit`` runs and beats it after every finished step; when no beat comes for
``timeout_s`` seconds, the watchdog logs why and ends the process with ``HANG_EXIT_CODE``, so
the job fails (and a scheduler restarts it from the newest checkpoint) instead of hanging.
The blocked thread is inside a collective in C++, where no Python exception can reach it, so
ending the process is the only way out (as a collective timeout does elsewhere).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable

HANG_EXIT_CODE = 124  # what ``timeout(1)`` returns: the process ran past its limit


class Watchdog:
    """Calls ``on_hang(waited_s)`` once, from a daemon thread, when the watchdog has been armed
    and not beaten for ``timeout_s`` seconds.

    Args:
      timeout_s: seconds without a beat that count as a hang.
      on_hang: called with the seconds waited; by default ``exit_on_hang``.
      poll_s: how often the thread looks (default: a tenth of the timeout, at most 1 s).
    """

    def __init__(
        self,
        timeout_s: float,
        on_hang: Callable[[float], None] | None = None,
        poll_s: float | None = None,
    ):
        if not timeout_s > 0:
            raise ValueError(f"hang_timeout_s must be > 0 or None, got {timeout_s!r}")
        self.timeout_s = float(timeout_s)
        self.on_hang = on_hang or exit_on_hang
        self._poll = poll_s if poll_s is not None else min(1.0, self.timeout_s / 10)
        self._last = time.monotonic()
        self._armed = False
        self._fired = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="nan2safe-watchdog", daemon=True)
        self._thread.start()

    def arm(self) -> None:
        """Starts counting from now (``fit`` begins)."""
        self._last = time.monotonic()
        self._armed = True

    def beat(self) -> None:
        """A step finished: the run is alive."""
        self._last = time.monotonic()

    def disarm(self) -> None:
        """Stops counting (``fit`` returned: the caller's own code runs now)."""
        self._armed = False

    def stop(self) -> None:
        """Ends the thread."""
        self._armed = False
        self._stop.set()

    @property
    def fired(self) -> bool:
        return self._fired

    def _run(self) -> None:
        while not self._stop.wait(self._poll):
            waited = time.monotonic() - self._last
            if self._armed and waited > self.timeout_s:
                self._fired = True
                self.on_hang(waited)
                return


def exit_on_hang(waited_s: float) -> None:
    """Says why on stderr and ends the process with ``HANG_EXIT_CODE``."""
    sys.stderr.write(
        f"nan2safe: no training step finished in {waited_s:.0f} s: a process of the run is "
        "most likely stuck (hung without dying, so its heartbeats go on). This process stops "
        "here; restart every process to resume from the newest checkpoint.\n"
    )
    sys.stderr.flush()
    os._exit(HANG_EXIT_CODE)
