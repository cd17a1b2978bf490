"""Decode-loop guard: tier 1's probes and the gears on autoregressive decoding.

The SPEC's inference item: the same probes on a decode loop, rolling back to the last good token
and re-decoding that step in a safer gear. A decode step has no loss and no optimizer to skip;
what goes bad is one token's logits (an fp16 attention whose logits pass 65504 on a long or
unusual context), and the step has already written that token's keys and values into the KV
cache. So ``generate`` keeps the model's non-parameter state (the cache, its index, RNG
counters) from before each token; a token whose logits, or a probe the step wrote, are not
finite (as in the train step: a norm whose variance overflowed outputs finite zeros, and only
its probe reads the inf) is rolled back to it and decoded again one gear up (FAST, STABLE,
SAFE), with no recompile: the gears are data (every site's ``SiteGear``), and one compiled
step serves all three. The detector scores the sites' probes after each accepted token, as
the train step does; a risk of 1 (a probe near the dtype's limit, or a level shift and
acceleration) moves the next tokens to STABLE before anything is non-finite. After
``cfg.recovery_window`` calm tokens the gear steps back down, one gear at a time.

The gear is global here (every site together): naming one site would take a tier-2 replay per
fault, and a decode step is cheap to re-run one gear up. What made a token fail can stay in the
cache (its keys and values): when the gear comes back down, a later token may fail at FAST
again and be rolled back once more, one extra decode per ``recovery_window`` tokens.
"""

from __future__ import annotations

import dataclasses
import functools
import weakref
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from nan2safe_jax import detector as detector_lib
from nan2safe_jax import numerics, probe
from nan2safe_jax import site as site_lib
from nan2safe_jax.config import Config
from nan2safe_jax.gear import Gear

__all__ = ["DecodeError", "Generation", "generate"]

# Each step function jitted once (``nnx.jit``), so that calls of ``generate`` share a compile.
_JITTED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class DecodeError(FloatingPointError):
    """A token whose logits (or a probe) are not finite even at SAFE. The model's state is the
    last good token's (``step``: the token's index; ``tokens``: those decoded before it)."""

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
    _set(list(site_lib.site_gears(model).values()), gear)


def _set(gear_vars: list, gear: int) -> None:
    for var in gear_vars:
        value = site_lib.fill_default(var)
        var.set_value(jnp.full(jnp.shape(value), int(gear), jnp.int32))


@functools.partial(jax.jit, static_argnums=3)
def _judge(logits: Any, probe_values: list, det: Any, cfg: Config):
    """One token's verdict in one program: ``(f32[3] [finite, risk, calm], per-probe risk,
    the detector folded)``; the caller keeps the detector only for an accepted token."""
    rows = site_lib.stacked_rows(probe_values)
    # as the train step's ``finite``: a norm whose variance overflowed outputs finite zeros,
    # and only its probe reads the inf (``train.model_probes_nonfinite``)
    finite = numerics.all_finite(logits) & jnp.all(probe.rows_finite(rows))
    new_det, risk = detector_lib.update(det, rows, cfg)
    head = jnp.stack([finite, risk.risk, risk.calm]).astype(jnp.float32)
    return head, risk.per_probe, new_det


def _variables(model: nnx.Module) -> tuple[list, list]:
    """``(every variable but the parameters, the probes)`` of ``model``: what a rolled-back
    token restores (the cache, its index, RNG counters, sown values) and what the detector
    reads. The step updates these same variables in place."""
    state, probes = [], []
    for path, v in nnx.iter_graph(model):  # one walk for both (site.probe_variables' order)
        if isinstance(v, nnx.Variable) and not isinstance(v, nnx.Param):
            state.append(v)
            if isinstance(v, site_lib.Probe):
                probes.append((site_lib.path_name(path), v))
    return state, probes


def _zero_probes(probe_vars: list) -> None:
    """Each plain ``Probe`` variable to zeros before a call, as the train step rebuilds them:
    a probe this call does not write (a site the decode step never runs, an encoder's at
    prefill) then reads zeros, not a stale value, and one left non-finite by an earlier call
    cannot fail every token. (A sown probe's tuple is the call's to write; kept as it is.)"""
    for _, v in probe_vars:
        x = v.get_value()
        if not isinstance(x, tuple):
            v.set_value(_zeros(jnp.shape(x), jnp.result_type(x)))


@functools.lru_cache(maxsize=64)
def _zeros(shape: tuple[int, ...], dtype: Any) -> jax.Array:
    """One zeros array per probe layout, shared across tokens (arrays are immutable)."""
    return jnp.zeros(shape, dtype)


def _cache_leaves(model: nnx.Module) -> list:
    return jax.tree_util.tree_leaves(nnx.state(model, nnx.Cache))


def _check_logits(logits) -> None:
    leaves = jax.tree_util.tree_leaves(logits)
    if not leaves or not all(jnp.issubdtype(jnp.result_type(x), jnp.inexact) for x in leaves):
        raise ValueError(
            f"step_fn must return the next token's logits (float arrays), got {logits!r:.200}"
        )


def _check_first(model, cache_before, token, next_token) -> None:
    """The first token's results, checked once: misuse surfaces here, not deep in flax."""
    after = _cache_leaves(model)
    same = [jnp.array_equal(a, b) for a, b in zip(after, cache_before, strict=True)]
    if cache_before and all(bool(x) for x in same):
        raise ValueError(
            "step_fn did not update the model's KV cache (nnx.Cache): a jax.jit function does "
            "not write an nnx model back; pass the plain function (generate jits it with "
            "nnx.jit) or an nnx.jit one"
        )
    shape, dtype = jnp.shape(next_token), jnp.result_type(next_token)
    if shape != jnp.shape(token) or not jnp.issubdtype(dtype, jnp.integer):
        raise ValueError(
            f"pick must return integer tokens shaped as token {jnp.shape(token)}, got "
            f"{dtype} {shape}"
        )


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
        ``nnx.jit`` (once per function); an ``nnx.jit`` one is fine too, not a ``jax.jit``
        one (it does not write the model's cache back: a ``ValueError`` at the first token).
      token: ``int[batch]``, the first input token (the prompt's last).
      steps: tokens to decode (an int >= 0).
      cfg: the detector's thresholds and ``recovery_window`` (default ``Config()``).
      pick: ``pick(logits) -> int[batch]``, the next token (default: the argmax of the last
        axis: greedy decoding).

    Returns:
      A ``Generation``.

    Raises:
      ValueError: ``steps`` is not an int >= 0, ``cfg`` not a ``Config``, ``token`` not
        integer, or ``model`` has no site (``nan2safe.nn.convert`` gives it sites); at the
        first token: ``step_fn`` returned no float logits or left the KV cache as it was,
        ``pick`` no integer tokens shaped as ``token``.
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
    token = jnp.asarray(token)
    if not jnp.issubdtype(token.dtype, jnp.integer):
        raise ValueError(f"token must be integer token ids, got {token.dtype}")
    run = _jitted(step_fn)
    gear_vars = list(site_lib.site_gears(model).values())
    state_vars, probe_vars = _variables(model)
    gear, calm_run, det, seen = int(Gear.FAST), 0, None, None
    tokens, gears, risks, events = [], [], [], []
    _set(gear_vars, gear)
    try:
        for t in range(int(steps)):
            before = [v.get_value() for v in state_vars]  # immutable arrays: no copy
            cache_before = _cache_leaves(model) if t == 0 else None
            while True:
                _zero_probes(probe_vars)
                logits = run(model, token)
                _check_logits(logits)
                probe_vars = site_lib.probe_variables(model) if t == 0 else probe_vars
                values = [v.get_value() for _, v in probe_vars]
                layout = [(n, [np.shape(x) for x in jax.tree_util.tree_leaves(v)]) for n, v in
                          zip((n for n, _ in probe_vars), values, strict=True)]  # fmt: skip
                if det is None or layout != seen:  # a sown probe's rows can change
                    seen = layout
                    names = tuple(n for b in site_lib.blocks_of(probe_vars) for n in b.names)
                    if det is None or det.names != names:
                        det = detector_lib.DetectorState.create(names)
                head, per_probe, judged = _judge(logits, values, det, cfg)
                finite, r, calm = np.asarray(head).tolist()
                if finite:
                    break
                for v, x in zip(state_vars, before, strict=True):
                    v.set_value(x)  # back to the last good token: its cache, its index
                if gear == int(Gear.SAFE):
                    done = np.stack(tokens, axis=-1) if tokens else np.zeros((*token.shape, 0))
                    raise DecodeError(
                        f"token {t}: logits or a probe not finite at SAFE either; the model "
                        "holds the state of the last good token",
                        t,
                        done.astype(np.int32),
                    )
                events.append({"type": "rollback", "step": t, "from": gear, "to": gear + 1})
                gear, calm_run = gear + 1, 0
                _set(gear_vars, gear)
            det = judged
            # A call can add variables (a sown probe, an nnx.Intermediate): listed again for the
            # next token's snapshot and probes, one walk of the graph per token.
            state_vars, probe_vars = _variables(model)
            next_token = pick(logits)
            if t == 0:
                _check_first(model, cache_before, token, next_token)
            token = next_token
            tokens.append(token)
            gears.append(gear)
            risks.append(r)
            if r >= 1.0 and gear == int(Gear.FAST):
                hot = np.asarray(per_probe) >= 1.0
                probes = [n for n, h in zip(det.names, hot, strict=True) if h]
                events.append({"type": "downshift", "step": t, "risk": r, "probes": probes})
                gear, calm_run = int(Gear.STABLE), 0
                _set(gear_vars, gear)
                continue
            calm_run = calm_run + 1 if calm else 0
            if gear > int(Gear.FAST) and calm_run >= cfg.recovery_window:
                events.append({"type": "recover", "step": t, "from": gear, "to": gear - 1})
                gear, calm_run = gear - 1, 0
                _set(gear_vars, gear)
    finally:
        _set(gear_vars, Gear.FAST)  # a plain call of the model after this runs FAST
    tokens = [np.asarray(x) for x in tokens]
    out = np.stack(tokens, axis=-1) if tokens else np.zeros((np.size(token), 0), np.int32)
    return Generation(out, np.asarray(gears, np.int32), np.asarray(risks, np.float32), events)
