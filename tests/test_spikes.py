"""SpikeWatch: which steps are evidence of a loss spike, against a reference count."""

import pytest

from nan2safe_jax import Config
from nan2safe_jax.spikes import SpikeWatch

CFG = Config(spike_factor=3.0, spike_steps=3, min_history=4, window=8)


def _watch(steps, cfg=CFG):
    """Feeds ``(loss, applied, overflow)`` per step; returns the watch and every spike."""
    watch, spikes = SpikeWatch(cfg), []
    for i, (loss, applied, overflow) in enumerate(steps):
        spike = watch.update(i, loss, applied, overflow=overflow)
        if spike is not None:
            spikes.append(spike)
    return watch, spikes


CALM = [(1.0, True, False)] * 6


@pytest.mark.parametrize(
    "tail, want",
    [
        ([(100.0, True, False)] * 3, (6, 8)),
        ([(100.0, False, True)] * 3, (6, 8)),  # overflow skips at a spiking loss
        ([(100.0, False, True), (100.0, True, False), (100.0, False, True)], (6, 8)),
        ([(100.0, False, True)] * 2 + [(1.0, False, True), (100.0, True, False)], (6, 9)),
        ([(100.0, False, False)] * 3, None),  # skipped for another reason: tier 2's
        ([(float("nan"), False, False)] * 3, None),
        ([(100.0, True, False)] * 2 + [(1.0, True, False), (100.0, True, False)], None),
    ],
    ids=["applied", "overflow", "mixed", "calm-overflow-between", "other-skip", "nan", "broken"],
)
def test_a_spike_is_spike_steps_finite_losses_above_the_line_applied_or_overflow_skipped(
    tail, want
):
    watch, spikes = _watch(CALM + tail)
    got = [(s.start, s.step) for s in spikes]
    assert got == ([] if want is None else [want])
    assert watch.baseline == pytest.approx(1.0)  # no skipped or spiking loss moved it


def test_an_overflow_skip_below_the_line_neither_breaks_a_streak_nor_moves_the_baseline():
    watch, _ = _watch(CALM + [(100.0, True, False), (0.5, False, True)])
    assert watch.baseline == pytest.approx(1.0) and watch.seen == 6
    assert watch.update(8, 100.0, True) is None
    assert watch.update(9, 100.0, True) is not None  # 6, 8, 9: three above the line


def test_the_watch_is_off_without_spike_factor():
    _, spikes = _watch(CALM + [(100.0, True, False)] * 5, Config(min_history=4))
    assert spikes == []
