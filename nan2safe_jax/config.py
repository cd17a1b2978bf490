"""Config: every threshold of docs/design.md in one frozen, validated object.

The defaults are the write-up's, tuned on 7B/13B models (docs/design.md, "Defaults"). A Config is
hashable and immutable so it can sit in a jitted function's closure or a pytree's static
fields; every field is checked at construction and a bad value raises ``ValueError`` naming the
field, the value received and the accepted range.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import numbers

from nan2safe_jax.probe import DEFAULT_PROBES, PROBE_KINDS

_INT32_MAX = 2**31 - 1  # the jitted step's counters are int32


def _check(ok: bool, name: str, value, accepted: str) -> None:
    if not ok:
        raise ValueError(f"Config.{name} must be {accepted}, got {value!r}")


@dataclasses.dataclass(frozen=True)
class Config:
    """Thresholds and factors of both tiers.

    Attributes:
      window: EMA window of the detector baseline; ``alpha = 2 / (window + 1)``.
      z_threshold: z-score above which a probe counts half a risk point (write-up: 4.0-6.0);
        a floor: ``false_alarm_rate`` may raise the threshold applied (``detector.thresholds``).
      diff_threshold: second-difference threshold, in baseline std units (~60% of z_threshold);
        a floor, as ``z_threshold``.
      false_alarm_rate: target rate, per step, at which stationary noise makes any signal of any
        probe fire (risk >= 0.5), all probes together. Each probe's z and d2 thresholds are
        derived from an equal share of it (Bonferroni over probes); ``None`` applies
        ``z_threshold`` and ``diff_threshold`` as given (the write-up's raw rule).
      diff_headroom: headroom (``max_abs / finfo(dtype).max``) from which a probe's second
        difference counts (the write-up's absolute gate on the acceleration signal); 2**-8 is
        eight doublings below overflow. 0 removes the gate.
      min_history: samples a probe needs before it may take part in a decision (warm-up).
      headroom_limit: ``max_abs / finfo(dtype).max`` past which a probe is full risk by itself.
      trigger_risk: risk at or above which the policy downshifts FAST -> STABLE.
      lr_jump: relative learning-rate change that counts as a schedule jump.
      lr_cooldown: steps after a learning-rate jump during which thresholds are relaxed.
      lr_cooldown_factor: factor applied to both thresholds during the cool-down.
      loss_scale_init: initial dynamic loss scale (2**15 suits fp16).
      loss_scale_period: finite steps before the loss scale grows by ``loss_scale_factor``.
      loss_scale_factor: growth factor of the loss scale; its inverse is the back-off.
      loss_scale_min, loss_scale_max: bounds of the dynamic loss scale.
      loss_scale_downshift: factor applied to the loss scale on the first downshift (1/256).
      clip_norm: global-norm clip threshold in FAST; ``None`` disables clipping.
      clip_downshift: clip threshold factor below FAST (0.5).
      safe_lr_factor: learning-rate factor of a SAFE site's own parameters while it is in SAFE
        (of every parameter while the whole model is; a bare ``guard`` without the train
        step's per-parameter ``lr_factors`` scales every parameter while anything is).
      safe_max_steps: longest SAFE stay before a site returns to STABLE.
      safe_backoff_max: cap on the number of doublings of a repeat offender's SAFE stay.
      recovery_window: consecutive calm steps before STABLE returns to FAST (a step the loss
        scale skipped is not calm).
      ring_buffer: batches kept on the host for replay after a rollback; ``None`` (default)
        keeps ``checkpoint_every`` of them, so a rollback to the newest checkpoint can always
        replay every step since it. A value below ``checkpoint_every`` is an error. While a
        checkpoint due at a refused (skipped) step waits for an applied one, the trainer keeps
        up to twice as many.
      checkpoint_every: steps between checkpoints (trainer).
      max_incidents: non-finite incidents the trainer handles; the next one stops it with an
        error (located
        faults, repeats, transients, damage; a batch reported as polluted input is skipped and
        not counted, but more than ``max_incidents`` of them in a row stop the run too).
      log_every: steps between metric records in ``metrics.jsonl`` (trainer).
      spike_factor: loss-spike rollback (trainer; off when ``None``, the default): a loss above
        ``spike_factor`` times its running baseline for ``spike_steps`` steps in a row is a
        divergence without a NaN.
      spike_steps: consecutive steps above the line that make a spike.
      spike_skip_batches: batches skipped from the spike's first step after the rollback (the
        data that led into the spike).
      spike_lr_factor: learning-rate factor after the rollback: for the replayed batches, then
        ``spike_lr_steps`` more steps.
      spike_lr_steps: steps past the replay that ``spike_lr_factor`` applies (0: the learning
        rate is kept, the replay included).
      spike_max_rollbacks: loss-spike rollbacks at most per ``Trainer``; later spikes are logged.
      probes: the probe kinds the sites compute and the detector watches, a tuple of names from
        ``nan2safe_jax.probe.PROBE_KINDS``; default ``probe.DEFAULT_PROBES``: every kind but
        ``attn_probs`` (an extra pass over an op's largest tensor) and ``norm_output`` (it
        added no lead; ``benchmarks/probe_set.py`` measures what each kind adds and costs).
        Widen it (``PROBE_KINDS``) or narrow it (``()``: only the loss and gradient probes,
        and those a user site asks for itself, ``nn.Site(probe=True)``: they have no kind);
        a kind that is off is not traced, so it costs nothing.
    """

    window: int = 128
    z_threshold: float = 5.0
    diff_threshold: float = 3.0
    false_alarm_rate: float | None = 1e-3
    diff_headroom: float = 2.0**-8
    min_history: int = 32
    headroom_limit: float = 0.5
    trigger_risk: float = 1.0
    lr_jump: float = 0.2
    lr_cooldown: int = 40
    lr_cooldown_factor: float = 2.0
    loss_scale_init: float = 2.0**15
    loss_scale_period: int = 2000
    loss_scale_factor: float = 2.0
    loss_scale_min: float = 1.0
    loss_scale_max: float = 2.0**24
    loss_scale_downshift: float = 1.0 / 256
    clip_norm: float | None = 1.0
    clip_downshift: float = 0.5
    safe_lr_factor: float = 0.1
    safe_max_steps: int = 8
    safe_backoff_max: int = 4
    recovery_window: int = 64
    ring_buffer: int | None = None
    checkpoint_every: int = 50
    max_incidents: int = 8
    log_every: int = 1
    spike_factor: float | None = None
    spike_steps: int = 3
    spike_skip_batches: int = 8
    spike_lr_factor: float = 1.0
    spike_lr_steps: int = 0
    spike_max_rollbacks: int = 3
    probes: tuple[str, ...] = DEFAULT_PROBES

    def __post_init__(self):
        # numpy scalars (a value read from an array, a sweep's np.arange) count as the Python
        # numbers they hold, and are stored as those: a Config is hashed as a static argument.
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if type(v).__module__ == "numpy" and isinstance(v, numbers.Real):
                py = int(v) if isinstance(v, numbers.Integral) else float(v)
                object.__setattr__(self, f.name, py)

        def is_int(v):
            return isinstance(v, int) and not isinstance(v, bool)

        def is_num(v):
            return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)

        _check(is_int(self.window) and self.window >= 2, "window", self.window, "an int >= 2")
        _check(
            is_num(self.z_threshold) and self.z_threshold > 0,
            "z_threshold",
            self.z_threshold,
            "> 0 (the write-up uses 4.0-6.0)",
        )
        _check(
            is_num(self.diff_threshold) and self.diff_threshold > 0,
            "diff_threshold",
            self.diff_threshold,
            "> 0 (about 60% of z_threshold)",
        )
        _check(
            self.false_alarm_rate is None
            or (is_num(self.false_alarm_rate) and 0 < self.false_alarm_rate < 0.5),
            "false_alarm_rate",
            self.false_alarm_rate,
            "None or in (0, 0.5)",
        )
        _check(
            is_num(self.diff_headroom) and 0 <= self.diff_headroom <= 1,
            "diff_headroom",
            self.diff_headroom,
            "in [0, 1]",
        )
        _check(
            is_int(self.min_history) and 3 <= self.min_history <= 2**30,
            "min_history",
            self.min_history,
            "an int in [3, 2**30] (the second difference needs three samples; the detector "
            "counts samples up to 2**30)",
        )
        _check(
            is_num(self.headroom_limit) and 0 < self.headroom_limit <= 1,
            "headroom_limit",
            self.headroom_limit,
            "in (0, 1]",
        )
        _check(
            is_num(self.trigger_risk) and 0 < self.trigger_risk <= 1,
            "trigger_risk",
            self.trigger_risk,
            "in (0, 1]",
        )
        _check(is_num(self.lr_jump) and self.lr_jump > 0, "lr_jump", self.lr_jump, "> 0")
        _check(
            is_int(self.lr_cooldown) and 0 <= self.lr_cooldown <= _INT32_MAX,
            "lr_cooldown",
            self.lr_cooldown,
            f"an int in [0, {_INT32_MAX}] (the write-up uses 30-50)",
        )
        _check(
            is_num(self.lr_cooldown_factor) and self.lr_cooldown_factor >= 1,
            "lr_cooldown_factor",
            self.lr_cooldown_factor,
            ">= 1",
        )
        _check(
            is_num(self.loss_scale_min) and self.loss_scale_min > 0,
            "loss_scale_min",
            self.loss_scale_min,
            "> 0",
        )
        _check(
            is_num(self.loss_scale_max) and self.loss_scale_max >= self.loss_scale_min,
            "loss_scale_max",
            self.loss_scale_max,
            f"finite and >= loss_scale_min ({self.loss_scale_min})",
        )
        _check(
            is_num(self.loss_scale_init)
            and self.loss_scale_min <= self.loss_scale_init <= self.loss_scale_max,
            "loss_scale_init",
            self.loss_scale_init,
            f"in [loss_scale_min, loss_scale_max] = [{self.loss_scale_min}, {self.loss_scale_max}]",
        )
        _check(
            is_int(self.loss_scale_period) and 1 <= self.loss_scale_period <= _INT32_MAX,
            "loss_scale_period",
            self.loss_scale_period,
            f"an int in [1, {_INT32_MAX}]",
        )
        _check(
            is_num(self.loss_scale_factor) and self.loss_scale_factor > 1,
            "loss_scale_factor",
            self.loss_scale_factor,
            "> 1",
        )
        _check(
            is_num(self.loss_scale_downshift) and 0 < self.loss_scale_downshift <= 1,
            "loss_scale_downshift",
            self.loss_scale_downshift,
            "in (0, 1] (the write-up uses 1/256)",
        )
        _check(
            self.clip_norm is None or (is_num(self.clip_norm) and self.clip_norm > 0),
            "clip_norm",
            self.clip_norm,
            "None or > 0",
        )
        _check(
            is_num(self.clip_downshift) and 0 < self.clip_downshift <= 1,
            "clip_downshift",
            self.clip_downshift,
            "in (0, 1]",
        )
        _check(
            is_num(self.safe_lr_factor) and 0 < self.safe_lr_factor <= 1,
            "safe_lr_factor",
            self.safe_lr_factor,
            "in (0, 1]",
        )
        _check(
            is_int(self.safe_max_steps) and self.safe_max_steps >= 1,
            "safe_max_steps",
            self.safe_max_steps,
            "an int >= 1 (the write-up uses 5-10)",
        )
        _check(
            is_int(self.safe_backoff_max) and 0 <= self.safe_backoff_max <= 16,
            "safe_backoff_max",
            self.safe_backoff_max,
            "an int in [0, 16]",
        )
        _check(
            self.safe_max_steps * 2**self.safe_backoff_max <= _INT32_MAX,
            "safe_max_steps",
            self.safe_max_steps,
            f"at most {_INT32_MAX} once doubled safe_backoff_max ({self.safe_backoff_max}) "
            "times: the step counts a SAFE stay in int32",
        )
        _check(
            is_int(self.recovery_window) and 1 <= self.recovery_window <= _INT32_MAX,
            "recovery_window",
            self.recovery_window,
            f"an int in [1, {_INT32_MAX}] (the step counts it in int32)",
        )
        _check(
            self.ring_buffer is None or (is_int(self.ring_buffer) and self.ring_buffer >= 1),
            "ring_buffer",
            self.ring_buffer,
            "None or an int >= 1",
        )
        _check(
            is_int(self.checkpoint_every) and self.checkpoint_every >= 1,
            "checkpoint_every",
            self.checkpoint_every,
            "an int >= 1",
        )
        _check(
            is_int(self.max_incidents) and self.max_incidents >= 1,
            "max_incidents",
            self.max_incidents,
            "an int >= 1",
        )
        _check(is_int(self.log_every) and self.log_every >= 1, "log_every", self.log_every, ">= 1")
        _check(
            self.ring_buffer is None or self.ring_buffer >= self.checkpoint_every,
            "ring_buffer",
            self.ring_buffer,
            f"None or >= checkpoint_every ({self.checkpoint_every}): a rollback to the newest "
            "checkpoint replays every batch since it from the ring buffer",
        )
        _check(
            self.spike_factor is None or (is_num(self.spike_factor) and self.spike_factor > 1),
            "spike_factor",
            self.spike_factor,
            "None (off) or > 1",
        )
        _check(
            is_int(self.spike_steps) and self.spike_steps >= 1,
            "spike_steps",
            self.spike_steps,
            "an int >= 1",
        )
        _check(
            is_int(self.spike_skip_batches) and self.spike_skip_batches >= 0,
            "spike_skip_batches",
            self.spike_skip_batches,
            "an int >= 0",
        )
        _check(
            is_num(self.spike_lr_factor) and 0 < self.spike_lr_factor <= 1,
            "spike_lr_factor",
            self.spike_lr_factor,
            "in (0, 1]",
        )
        _check(
            is_int(self.spike_lr_steps) and self.spike_lr_steps >= 0,
            "spike_lr_steps",
            self.spike_lr_steps,
            "an int >= 0",
        )
        _check(
            is_int(self.spike_max_rollbacks) and self.spike_max_rollbacks >= 0,
            "spike_max_rollbacks",
            self.spike_max_rollbacks,
            "an int >= 0",
        )
        if isinstance(self.probes, list):  # e.g. read back from JSON: kept hashable
            object.__setattr__(self, "probes", tuple(self.probes))
        _check(
            isinstance(self.probes, tuple)
            and all(isinstance(k, str) and k in PROBE_KINDS for k in self.probes)
            and len(set(self.probes)) == len(self.probes),
            "probes",
            self.probes,
            f"a tuple of distinct probe kinds from {PROBE_KINDS}",
        )

    @property
    def ring_size(self) -> int:
        """Batches the trainer keeps for replay: ``ring_buffer``, or ``checkpoint_every``."""
        return self.checkpoint_every if self.ring_buffer is None else self.ring_buffer

    @property
    def alpha(self) -> float:
        """EMA smoothing factor, ``2 / (window + 1)``."""
        return 2.0 / (self.window + 1)

    def replace(self, **changes) -> Config:
        """Returns a copy with ``changes`` applied (and validated)."""
        return dataclasses.replace(self, **changes)


class UnknownFieldError(ValueError, TypeError):
    """A ``Config`` field that does not exist. A ``ValueError`` naming the field, as every bad
    value is; a ``TypeError`` too, as Python raises for an unexpected keyword argument."""


def _known_fields_only(init):
    names = tuple(f.name for f in dataclasses.fields(Config))

    @functools.wraps(init)
    def checked(self, *args, **kwargs):
        for name in kwargs:
            if name not in names:
                near = difflib.get_close_matches(name, names, n=1)
                hint = f" (did you mean {near[0]!r}?)" if near else ""
                raise UnknownFieldError(f"Config has no field {name!r}{hint}")
        init(self, *args, **kwargs)

    return checked


Config.__init__ = _known_fields_only(Config.__init__)
