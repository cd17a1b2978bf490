"""Decode-loop guard: tier 1's probes and the gears on autoregressive decoding.

The SPEC's inference item: the same probes on a decode loop, rolling back to the last good token
and re-decoding that step in a safer gear. A decode step has no loss and no optimizer to skip;
what goes bad is one token's logits (an fp16 attention whose logits pass 65504 on a long or
unusual context), and the step has already written that token's keys and values into the KV
cache. So ``generate`` keeps the model's non-parameter state (the cache, its index, RNG
counters) from before each token; a token whose logits are not finite is rolled back to it and
decoded again one gear up (FAST, STABLE, SAFE), with no recompile: the gears are data (every
site's ``SiteGear``), and one compiled step serves all three. The detector scores the sites'
probes after each accepted token, as the train step does; a risk of 1 (a probe near the dtype's
limit, or a level shift and acceleration) moves the next tokens to STABLE before anything is
non-finite. After ``cfg.recovery_window`` calm tokens the gear steps back down, one gear at a
time.

The gear is global here (every site together): naming one site would take a tier-2 replay per
fault, and a decode step is cheap to re-run one gear up.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from nan2safe_jax import detector as detector_lib
from nan2safe_jax import site as site_lib
from nan2safe_jax.config import Config
from nan2safe_jax.gear import Gear

__all__ = ["DecodeError", "Generation", "generate"]

# Each step function jitted once (``nnx.jit``), so that calls of ``generate`` share a compile.
_JITTED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_score = jax.jit(detector_lib.update, static_argnums=2)  # the detector, as the train step runs it


class DecodeError(FloatingPointError):
    """A token whose logits are not finite even at SAFE. The model's state is the last good
    token's (``step``: the token's index; ``tokens``: those decoded before it)."""

    def __init__(self, message: str, step: int, tokens: np.ndarray):
        super().__init__(message)
        self.step, self.tokens = step, tokens


@dataclasses.dataclass
class Generation:
    """What ``generate`` decoded.

    Attributes:
      tokens: int[batch, steps], the tokens in order.
      gears: int[steps], the gear each token was decoded at (after any re-decode).
      risk: f32[steps], the detector's risk after each token.
      events: ``{"type", "step", ...}`` dicts: ``rollback`` (a token re-decoded one gear up:
        ``from``, ``to``), ``downshift`` (tier 1 moved the next tokens up: ``risk``,
        ``probes``), ``recover`` (a gear down after calm tokens: ``from``, ``to``).
    """

    tokens: np.ndarray
    gears: np.ndarray
    risk: np.ndarray
    events: list[dict]


def _jitted(step_fn: Callable) -> Callable:
    try:
        return _JITTED[step_fn]
    except (KeyError, TypeError):
        pass
    fn = nnx.jit(step_fn)
    try:
        _JITTED[step_fn] = fn
    except TypeError:  # not weak-referenceable: jitted per call
        pass
    return fn


def set_gear(model: nnx.Module, gear: int) -> None:
    """Sets every site of ``model`` (each layer of a stacked one) to ``gear``, in place."""
    for var in site_lib.site_gears(model).values():
        value = site_lib.fill_default(var)
        var.set_value(jnp.full(jnp.shape(value), int(gear), jnp.int32))


@jax.jit
def _finite(logits: Any) -> jax.Array:
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree_util.tree_leaves(logits)]))


def generate(
    model: nnx.Module,
    step_fn: Callable[[nnx.Module, jax.Array], Any],
    token: jax.typing.ArrayLike,
    steps: int,
    cfg: Config | None = None,
    *,
    pick: Callable[[Any], jax.Array] | None = None,
) -> Generation:
    """Decodes ``steps`` tokens with ``step_fn``, re-decoding a non-finite token one gear up.

    Args:
      model: an ``nnx.Module`` with ``nan2safe.nn`` sites (``nan2safe.nn.convert``) whose KV
        cache is ready (``init_cache``, decode mode); changed in place, as a decode loop of
        your own changes it.
      step_fn: ``step_fn(model, token) -> logits`` for one token (``int[batch]``): it runs the
        model in decode mode and returns the next token's logits. Jitted here with
        ``nnx.jit`` (once per function); a function already jitted is fine too.
      token: ``int[batch]``, the first input token (the prompt's last).
      steps: tokens to decode (an int >= 0).
      cfg: the detector's thresholds and ``recovery_window`` (default ``Config()``).
      pick: ``pick(logits) -> int[batch]``, the next token (default: the argmax of the last
        axis: greedy decoding).

    Returns:
      A ``Generation``.

    Raises:
      ValueError: ``steps`` is not an int >= 0, ``cfg`` not a ``Config``, or ``model`` has no
        site (``nan2safe.nn.convert`` gives it sites).
      DecodeError: a token is not finite at SAFE either (the model holds the last good
        token's state).
    """
    if not isinstance(steps, (int, np.integer)) or isinstance(steps, bool) or steps < 0:
        raise ValueError(f"steps must be an int >= 0, got {steps!r}")
    cfg = Config() if cfg is None else cfg
    if not isinstance(cfg, Config):
        raise ValueError(f"cfg must be a nan2safe.Config, got {type(cfg).__name__}")
    if not site_lib.site_gears(model):
        raise ValueError(
            "generate: the model has no nan2safe site, so no gear can change how it decodes; "
            "run nan2safe.nn.convert(model) first"
        )
    pick = pick or (lambda logits: jnp.argmax(logits, axis=-1))
    run = _jitted(step_fn)
    gear, calm_run = int(Gear.FAST), 0
    det = None
    tokens, gears, risks, events = [], [], [], []
    token = jnp.asarray(token)
    for t in range(int(steps)):
        # The arrays are immutable; the map detaches the state from the model's variables,
        # which the step updates in place.
        before = jax.tree_util.tree_map(lambda x: x, nnx.state(model, nnx.Not(nnx.Param)))
        while True:
            set_gear(model, gear)
            logits = run(model, token)
            if bool(_finite(logits)):
                break
            nnx.update(model, before)  # back to the last good token: its cache, its index
            if gear == int(Gear.SAFE):
                raise DecodeError(
                    f"token {t}: logits not finite at SAFE either; the model holds the state of "
                    "the last good token",
                    t,
                    np.stack(tokens, axis=-1) if tokens else np.zeros((0,), np.int32),
                )
            events.append({"type": "rollback", "step": t, "from": gear, "to": gear + 1})
            gear, calm_run = gear + 1, 0
        probes = site_lib.collect_probes(model)
        if det is None:
            det = detector_lib.DetectorState.create(tuple(probes))
        det, risk = _score(det, probes, cfg)
        r, calm = float(risk.risk), bool(risk.calm)
        token = pick(logits)
        tokens.append(np.asarray(token))
        gears.append(gear)
        risks.append(r)
        if r >= 1.0 and gear == int(Gear.FAST):
            hot = np.asarray(risk.per_probe) >= 1.0
            events.append(
                {
                    "type": "downshift",
                    "step": t,
                    "risk": r,
                    "probes": [n for n, h in zip(det.names, hot, strict=True) if h],
                }
            )
            gear, calm_run = int(Gear.STABLE), 0
            continue
        calm_run = calm_run + 1 if calm else 0
        if gear > int(Gear.FAST) and calm_run >= cfg.recovery_window:
            events.append({"type": "recover", "step": t, "from": gear, "to": gear - 1})
            gear, calm_run = gear - 1, 0
    set_gear(model, Gear.FAST)
    out = np.stack(tokens, axis=-1) if tokens else np.zeros((np.size(token), 0), np.int32)
    return Generation(out, np.asarray(gears, np.int32), np.asarray(risks, np.float32), events)
