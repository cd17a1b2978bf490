"""Loss spikes without a NaN: the host-side watch behind the Trainer's loss-spike rollback.

A run can diverge with every value finite: the loss jumps and does not come back. The watch keeps
a running baseline of the loss (an EMA over applied steps, ``cfg.window``) and reports a spike
when the loss stays above ``cfg.spike_factor`` times that baseline for ``cfg.spike_steps`` steps
in a row; the Trainer then restores the checkpoint before the spike, skips the batches that led
into it and may lower the learning rate for a while (``Config.spike_*``). Off by default.
"""

from __future__ import annotations

import dataclasses
import math

from nan2safe_jax.config import Config


@dataclasses.dataclass(frozen=True)
class Spike:
    """A detected spike: its first step, the step that confirmed it, the loss and the line."""

    start: int
    step: int
    loss: float
    baseline: float


class SpikeWatch:
    """Host-side state machine over ``(step, loss)`` of applied steps.

    Args:
      cfg: ``spike_factor`` (None: the watch never fires), ``spike_steps``, ``window`` (the
        baseline's EMA span) and ``min_history`` (steps before it may fire).
    """

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.baseline: float | None = None
        self.seen = 0
        self._above: list[int] = []

    def update(self, step: int, loss: float, applied: bool, overflow: bool = False) -> Spike | None:
        """Feeds one step; returns a ``Spike`` when this step confirms one.

        Args:
          step: the step's index.
          loss: its loss.
          applied: the update was applied.
          overflow: it was skipped for a loss-scale overflow (a finite loss, scaled gradients
            past the dtype): the loss is the model's all the same, so one above the line counts
            toward the spike. A diverging fp16 run's high losses are mostly such skips, and
            counting only applied steps never saw ``spike_steps`` of them in a row (newuser47).

        Other skipped steps and non-finite losses are not evidence either way (tier 2 owns
        them), and only applied steps move the baseline. Losses above the line do not move it,
        so a slow spike cannot hide itself.
        """
        if self.cfg.spike_factor is None or not (applied or overflow) or not math.isfinite(loss):
            return None
        warm = self.baseline is not None and self.seen >= self.cfg.min_history
        if warm and loss > self.cfg.spike_factor * self.baseline:
            self._above.append(step)
            if len(self._above) >= self.cfg.spike_steps:
                spike = Spike(self._above[0], step, loss, self.baseline)
                self._above = []
                return spike
            return None
        if not applied:
            return None
        self._above = []
        a = self.cfg.alpha
        self.baseline = loss if self.baseline is None else (1 - a) * self.baseline + a * loss
        self.seen += 1
        return None

    def accept(self, loss: float) -> None:
        """Takes ``loss`` as the new baseline: a spike the trainer carries on through (no
        rollback left, or no checkpoint before it) is the run's level from now on, so the
        watch does not report the same plateau again every ``spike_steps`` steps."""
        self._above = []
        if math.isfinite(loss):
            self.baseline = loss

    def reset_streak(self) -> None:
        """Forgets the steps above the line (after a rollback the run starts over from before)."""
        self._above = []
