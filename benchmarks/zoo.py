"""Fault zoo: real fp16 failure mechanisms, three arms on identical data and seeds.

Every scenario is a numerical mechanism of docs/design.md that comes out of fp16 arithmetic on real
data and weights; a knob or a data property only decides *when* it fires:

==================  ===========================================================================
scenario            mechanism
==================  ===========================================================================
qk_growth           the q·k scale of layer 1 grows (a head whose q/k norms blow up) and stays
                    high; the attention has dropout configured, so flax.nnx keeps its logits in
                    fp16: they pass 65504 -> inf, softmax inf - inf -> NaN
masked_rows         one left-padded batch with a key-padding mask (``pad_mask="keys"``) under
                    a causal mask: a padding query sees no key. The model's own hand-written
                    attention (``UserAttention``) fills masked logits with -inf: -inf - -inf
                    = NaN (flax's attention fills with the dtype's minimum: no fault there)
ln_const_rows       LayerNorm with ``epsilon=0`` on sensor rows imputed with one constant:
                    variance 0 -> rsqrt(0) = inf, 0 * inf = NaN
loss_scale          loss scale 2**24 with fp16 compute: the scaled cotangents overflow fp16
                    in the backward pass (plain: a static scale; the others: the initial value
                    of their dynamic scale)
adam_fp16           pure fp16 weights (no f32 master copy) with AdamW eps=1e-8: the moments
                    are fp16, eps rounds to 0 and g**2 underflows, so the update is tiny/tiny
                    (x/0 = inf or 0/0 = NaN)
moe_router          MoE router scores grow (router weights scaled up, ``logit_scale``) until
                    the fp16 scores overflow and the router softmax gives inf - inf = NaN
data_nan            one batch of sensor data holds NaN features (a corrupted record)
intermittent        left padding in 1 of every 15 batches (as masked_rows, data dependent and
                    recurring)
==================  ===========================================================================

Arms: ``plain`` (the model on stock ``flax.nnx`` layers, ``layers="flax"``: what a user has;
optax adamw, fp16 compute, no loss scale, no guard); ``recipe`` (the same stock model plus
Flax/optax's own remedies: Flax ``DynamicScale`` + ``optax.apply_if_finite`` +
``optax.clip_by_global_norm(1.0)``, updates of non-finite steps dropped); ``nan2safe`` (the
same model with the ``nan2safe.nn`` sites swapped in, ``layers="nan2safe"``, same parameters
from the same seed; ``Trainer`` with ``guard``). The model's own code (a hand-written attention
or router, the fault knobs) is the same in every arm.

Per scenario and arm: survived (finite parameters at the end, no stall of more than 50
consecutive skipped steps, mean loss of the last 10 steps within 1.5x of a fault-free run of
the same arm and scenario config), steps lost (skipped + after death), first non-finite step,
first downshift, the culprit named by the first ``locate`` event and whether it is right,
time to locate (``w``: a warm locate that reused replays compiled for an earlier incident of the
same step), and the median step time relative to ``plain``'s fault-free run (the first step,
which compiles, is not timed).

Usage: ``python benchmarks/zoo.py [--quick] [--only NAME[,NAME]] [--json PATH]``.

Workaround (see the module's ``_cache_locate_jaxprs``): the Trainer re-traces the step for every
incident, so each ``locate`` recompiles all its replays; the zoo caches the traced jaxpr per
(step function, argument structure and shapes), so a repeated incident reuses the compiled
replays. ``--cold-locate`` turns that off.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

_REPO = Path(__file__).resolve().parents[1]
if str(_REPO) not in sys.path:
    sys.path.insert(0, str(_REPO))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from flax.training.dynamic_scale import DynamicScale  # noqa: E402

import nan2safe_jax as nan2safe  # noqa: E402
from examples.demo import corpus  # noqa: E402
from examples.transformer import Transformer, TransformerConfig, lm_loss, set_knob  # noqa: E402
from nan2safe_jax import nn as n2s_nn  # noqa: E402
from nan2safe_jax.numerics import all_finite  # noqa: E402

ARMS = ("plain", "recipe", "nan2safe")
# Ablation arm, run only when asked for (``--arms``): nan2safe with SAFE's learning-rate cut on
# every parameter while any site is in SAFE (the behaviour before the cut went per site).
LR_MODEL_ARM = "nan2safe_lr_model"
STALL = 50  # consecutive skipped steps that count as a stall (death)
LOSS_TOL = 1.5  # final loss within this factor of the fault-free run
TAIL = 10  # steps averaged for the "final loss"
LR = 2e-3
BATCH = 8
SEQ = 32
DEFAULT_SCALE = 2.0**15  # initial dynamic loss scale, recipe and nan2safe alike

# A small nan2safe.Config for short runs (the defaults are tuned for 100k-step runs).
CFG = nan2safe.Config(
    min_history=16,
    recovery_window=24,
    safe_max_steps=8,
    checkpoint_every=25,
    max_incidents=30,
    log_every=10,
)
CFG_TEXT = (
    "nan2safe.Config(min_history=16, recovery_window=24, safe_max_steps=8, "
    "checkpoint_every=25, max_incidents=30); other fields default"
)

# ------------------------------------------------------------------------------ data


def _char_text() -> tuple[np.ndarray, int]:
    """The demo's arithmetic corpus as compact ids (0 = padding), and the vocabulary size."""
    raw = np.frombuffer(corpus().encode("ascii"), np.uint8)
    chars = np.unique(raw)
    lut = np.zeros(256, np.int32)
    lut[chars] = np.arange(1, len(chars) + 1)
    return lut[raw], len(chars) + 1


_TEXT, _VOCAB = _char_text()


def lm_batches(steps: int, left_padded=(), seed: int = 0) -> list[dict]:
    """Character batches ``{"tokens", "mask"}``, right-padded except at ``left_padded`` steps.

    A left-padded batch puts each row's real tokens at the end (its padding at the start); under
    ``pad_mask="keys"`` and a causal mask those padding queries see no key at all.
    """
    rng = np.random.default_rng(seed)
    left_padded = set(left_padded)
    out = []
    for step in range(steps):
        starts = rng.integers(0, len(_TEXT) - SEQ, BATCH)
        tokens = np.stack([_TEXT[s : s + SEQ] for s in starts])
        lengths = rng.integers(SEQ // 2, SEQ + 1, BATCH)
        mask = np.arange(SEQ)[None, :] < lengths[:, None]
        if step in left_padded:
            mask[0] = np.arange(SEQ) < SEQ // 2  # at least one row with padding
            mask = mask[:, ::-1].copy()
        tokens = np.where(mask, tokens, 0)
        out.append({"tokens": jnp.asarray(tokens), "mask": jnp.asarray(mask)})
    return out


FEATURES = 16


def sensor_batches(steps: int, const_rows=(), nan_rows=(), seed: int = 0) -> list[dict]:
    """Regression batches ``{"x": f32[B, T, F], "y": f32[B, T]}`` from a fixed teacher network.

    At ``const_rows`` steps a few time steps of every sequence lost all their sensors and the
    loader imputed them with one constant (0.0); at ``nan_rows`` steps a few features of one
    record are NaN (a corrupted record).
    """
    rng = np.random.default_rng(seed)
    w1 = rng.normal(size=(FEATURES, 32)) / math.sqrt(FEATURES)
    w2 = rng.normal(size=(32,)) / math.sqrt(32)
    out = []
    for step in range(steps):
        x = rng.normal(size=(BATCH, SEQ, FEATURES)) * rng.uniform(0.5, 2.0, (BATCH, SEQ, 1))
        y = np.tanh(x @ w1) @ w2 + 0.05 * rng.normal(size=(BATCH, SEQ))
        if step in const_rows:
            x[:, 3:6, :] = 0.0
        if step in nan_rows:
            x[2, 7, :3] = np.nan
        out.append({"x": jnp.asarray(x, jnp.float32), "y": jnp.asarray(y, jnp.float32)})
    return out


# ------------------------------------------------------------------------------ models


class SensorNet(nnx.Module):
    """``LayerNorm(eps) -> Linear -> gelu -> Linear`` on per-time-step sensor features.

    ``layers``: ``"flax"`` (stock ``flax.nnx``) or ``"nan2safe"`` (``nan2safe.nn`` sites).
    """

    def __init__(self, *, epsilon: float, dtype: Any, layers: str, rngs: nnx.Rngs):
        lib = nnx if layers == "flax" else n2s_nn
        kw = dict(dtype=dtype, param_dtype=jnp.float32, rngs=rngs)
        self.norm = lib.LayerNorm(FEATURES, epsilon=epsilon, **kw)
        self.fc1 = lib.Linear(FEATURES, 64, **kw)
        self.fc2 = lib.Linear(64, 1, **kw)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.fc2(jax.nn.gelu(self.fc1(self.norm(x))))[..., 0]


def sensor_loss(model: SensorNet, batch: dict) -> jax.Array:
    """Mean squared error, in f32."""
    pred = model(batch["x"]).astype(jnp.float32)
    return jnp.mean(jnp.square(pred - batch["y"]))


def _lm_config(**kw) -> TransformerConfig:
    base = dict(
        num_layers=2,
        d_model=32,
        num_heads=2,
        seq_len=SEQ,
        vocab=_VOCAB,
        dtype=jnp.float16,
        param_dtype=jnp.float32,
        pad_mask="keys",
        # dropout configured (run deterministic), as in many GPT-style configs: flax.nnx then
        # keeps the attention logits in fp16 (its explicit-weights path)
        attn_dropout=0.1,
    )
    return TransformerConfig(**(base | kw))


def _lm(**kw) -> Callable[[str], nnx.Module]:
    return lambda layers: Transformer(_lm_config(layers=layers, **kw), rngs=nnx.Rngs(0))


# model key -> builder(layers): "flax" for the plain and recipe arms, "nan2safe" for nan2safe
MODELS: dict[str, Callable[[str], nnx.Module]] = {
    "lm": _lm(),
    "lm_user_attn": _lm(attention="user"),
    "lm_user_site": _lm(attention="user_site"),
    "lm_fp16w": _lm(param_dtype=jnp.float16),
    "lm_moe": _lm(num_experts=4, top_k=2),
    "sensor": lambda layers: SensorNet(
        epsilon=0.0, dtype=jnp.float16, layers=layers, rngs=nnx.Rngs(0)
    ),
}
LOSSES = {k: sensor_loss if k == "sensor" else lm_loss for k in MODELS}


def _layers(arm: str) -> str:
    """The layer set of an arm: the user's stock flax.nnx, or the nan2safe.nn sites."""
    return "nan2safe" if arm.startswith("nan2safe") else "flax"


def _adamw(eps: float = 1e-8):
    return optax.adamw(LR, eps=eps)


# ------------------------------------------------------------------------------ scenarios


@dataclasses.dataclass(frozen=True)
class Scenario:
    """One fault. ``batches(steps, faulty)`` and ``knobs(step, steps, faulty)`` give the data
    and the knob values of each step; ``expect(report)`` says whether a ``locate`` report names
    the right culprit (None: no op is the cause)."""

    name: str
    mechanism: str
    model: str
    batches: Callable[[int, bool], list]
    knobs: Callable[[int, int, bool], tuple] = lambda step, steps, faulty: ()
    eps: Callable[[bool], float] = lambda faulty: 1e-8  # AdamW eps
    scale: Callable[[bool], float | None] = lambda faulty: None  # loss scale override
    expect: Callable[[dict], bool] | None = None
    expect_text: str = "null (no op is the cause)"
    polluted: bool = False  # nan2safe must report polluted_input


def _growth(step: int, steps: int, start: float, rate: float, up: int) -> float:
    """1 before ``start * steps``, then ``rate**k`` for ``up`` steps, then held."""
    k = step - int(start * steps)
    return 1.0 if k < 0 else rate ** min(k, up)


def _site_prim(sites, prims):
    def check(r: dict) -> bool:
        return r.get("site") in sites and r.get("primitive") in prims

    return check


def _user_code(prims, line_marker: str):
    """The culprit is in the model's own code (no site): the primitive, and the user line is
    the line of ``examples/transformer.py`` holding ``line_marker``."""
    path = _REPO / "examples" / "transformer.py"
    lines = [
        f"transformer.py:{i}"
        for i, text in enumerate(path.read_text().splitlines(), 1)
        if line_marker in text
    ]

    def check(r: dict) -> bool:
        where = {str(r.get("user_source") or ""), str(r.get("source") or "")}
        return r.get("primitive") in prims and any(w.endswith(tuple(lines)) for w in where)

    return check


_OVERFLOW_PRIMS = {"dot_general", "mul", "exp", "convert_element_type", "add", "reduce_sum"}
_MASKED_PRIMS = {"div", "sub"}  # softmax 0/0, or -inf - -inf of the row max
_SOFTMAX_LINE = "weights = jax.nn.softmax(logits"  # UserAttention's softmax


def _every(n: int, steps: int) -> tuple:
    return tuple(range(n - 1, steps, n))


SCENARIOS: dict[str, Scenario] = {
    s.name: s
    for s in [
        Scenario(
            "qk_growth",
            "q·k scale of layer 1 grows x1.6/step for 24 steps and stays: fp16 logits > 65504",
            "lm",
            lambda steps, faulty: lm_batches(steps),
            knobs=lambda step, steps, faulty: (
                (("qk_gain", _growth(step, steps, 0.3, 1.6, 24) if faulty else 1.0, 1),)
            ),
            expect=_site_prim({"blocks.1.attn"}, _OVERFLOW_PRIMS),
            expect_text="blocks.1.attn: dot_general|mul|exp|convert|add|reduce_sum",
        ),
        Scenario(
            "masked_rows",
            "left-padded batch, key-padding + causal mask: a fully masked row in the model's "
            "hand-written attention (-inf fill): -inf - -inf = NaN",
            "lm_user_attn",
            lambda steps, faulty: lm_batches(steps, (int(0.4 * steps),) if faulty else ()),
            expect=_user_code(_MASKED_PRIMS, _SOFTMAX_LINE),
            expect_text="no site: div|sub at UserAttention's softmax line",
        ),
        Scenario(
            "ln_const_rows",
            "LayerNorm eps=0 on sensor rows imputed with a constant: rsqrt(0) = inf, 0*inf",
            "sensor",
            lambda steps, faulty: sensor_batches(
                steps, (int(0.4 * steps), int(0.7 * steps)) if faulty else ()
            ),
            expect=_site_prim({"norm"}, {"rsqrt", "mul", "div"}),
            expect_text="norm: rsqrt|mul|div",
        ),
        Scenario(
            "loss_scale",
            "loss scale 2**24 with fp16 compute: scaled cotangents overflow fp16 (backward)",
            "lm",
            lambda steps, faulty: lm_batches(steps),
            scale=lambda faulty: 2.0**24 if faulty else None,
        ),
        Scenario(
            "adam_fp16",
            "fp16 weights, AdamW eps=1e-8: fp16 moments, eps -> 0, g**2 underflows: tiny/tiny",
            "lm_fp16w",
            lambda steps, faulty: lm_batches(steps),
            eps=lambda faulty: 1e-8 if faulty else 1e-3,
        ),
        Scenario(
            "moe_router",
            "MoE router weights grow (logit_scale x1.8/step, held): fp16 scores overflow",
            "lm_moe",
            lambda steps, faulty: lm_batches(steps),
            knobs=lambda step, steps, faulty: (
                (("logit_scale", _growth(step, steps, 0.3, 1.8, 20) if faulty else 1.0, None),)
            ),
            expect=_site_prim({"blocks.0.mlp.router", "blocks.1.mlp.router"}, _OVERFLOW_PRIMS),
            expect_text="blocks.{0,1}.mlp.router: dot_general|mul|exp|convert|add|reduce_sum",
        ),
        Scenario(
            "data_nan",
            "one batch of sensor data with NaN features (corrupted record)",
            "sensor",
            lambda steps, faulty: sensor_batches(steps, nan_rows=(int(0.4 * steps),) * faulty),
            polluted=True,
            expect_text="null; nan2safe must report polluted_input",
        ),
        Scenario(
            "intermittent",
            "left padding in 1 of every 15 batches: fully masked rows in the hand-written "
            "attention, recurring",
            "lm_user_attn",
            lambda steps, faulty: lm_batches(steps, _every(15, steps) if faulty else ()),
            expect=_user_code(_MASKED_PRIMS, _SOFTMAX_LINE),
            expect_text="no site: div|sub at UserAttention's softmax line",
        ),
        Scenario(
            "intermittent_site",
            "intermittent, after the user made the hand-written attention core a site "
            "(nan2safe.nn.Site with a SAFE path); flax arms: the same plain core",
            "lm_user_site",
            lambda steps, faulty: lm_batches(steps, _every(15, steps) if faulty else ()),
            expect=_site_prim({"blocks.0.attn.core", "blocks.1.attn.core"}, _MASKED_PRIMS),
            expect_text="blocks.{0,1}.attn.core: div|sub",
        ),
    ]
}

# ------------------------------------------------------------------------------ arms

_STEPS: dict[tuple, Any] = {}  # compiled steps shared by runs of the same model and optimizer


def _apply_knobs(model: nnx.Module, knobs, last: dict) -> bool:
    """Writes changed knob values into ``model``; True when something changed."""
    changed = False
    for name, value, layer in knobs:
        if last.get((name, layer)) != value:
            set_knob(model, name, value, layer=layer)
            last[(name, layer)] = value
            changed = True
    return changed


def _plain_step(model_key: str, eps: float):
    key = ("plain", model_key, eps)
    if key not in _STEPS:
        tx = _adamw(eps)
        graphdef = nnx.graphdef(MODELS[model_key]("flax"))
        loss_fn = LOSSES[model_key]

        @jax.jit
        def step(params, opt, rest, batch, scale):
            def f(p):
                loss = loss_fn(nnx.merge(graphdef, p, rest, copy=True), batch)
                return loss.astype(jnp.float32) * scale, loss

            (_, loss), g = jax.value_and_grad(f, has_aux=True)(params)
            g = jax.tree_util.tree_map(lambda x: (x.astype(jnp.float32) / scale).astype(x.dtype), g)
            updates, opt = tx.update(g, opt, params)
            params = optax.apply_updates(params, updates)
            return params, opt, loss, all_finite(g), all_finite(params)

        _STEPS[key] = (tx, step)
    return _STEPS[key]


def _recipe_step(model_key: str, eps: float):
    key = ("recipe", model_key, eps)
    if key not in _STEPS:
        inner = optax.chain(optax.clip_by_global_norm(1.0), _adamw(eps))
        tx = optax.apply_if_finite(inner, max_consecutive_errors=STALL)
        graphdef = nnx.graphdef(MODELS[model_key]("flax"))
        loss_fn = LOSSES[model_key]

        @jax.jit
        def step(params, opt, ds, rest, batch):
            def f(p):
                loss = loss_fn(nnx.merge(graphdef, p, rest, copy=True), batch)
                return loss.astype(jnp.float32)

            ds, fin, loss, g = ds.value_and_grad(f)(params)
            # DynamicScale returns f32 gradients; hand the optimizer the parameters' dtype.
            g = jax.tree_util.tree_map(lambda x, p: x.astype(p.dtype), g, params)
            updates, opt = tx.update(g, opt, params)
            new = optax.apply_updates(params, updates)
            params = jax.tree_util.tree_map(lambda a, b: jnp.where(fin, a, b), new, params)
            return params, opt, ds, loss, fin, all_finite(params)

        _STEPS[key] = (tx, step)
    return _STEPS[key]


def _run_functional(sc: Scenario, arm: str, steps: int, faulty: bool, data: list) -> dict:
    """The plain and recipe arms: a hand-written jitted step, one host sync per step."""
    eps = sc.eps(faulty)
    model = MODELS[sc.model](_layers(arm))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    scale = sc.scale(faulty)
    if arm == "plain":
        tx, step = _plain_step(sc.model, eps)
        plain_scale = jnp.asarray(1.0 if scale is None else scale, jnp.float32)
    else:
        tx, step = _recipe_step(sc.model, eps)
        ds = DynamicScale(scale=DEFAULT_SCALE if scale is None else scale)
    opt = tx.init(params)
    losses, skipped, times = [], [], []
    first_bad = dead_at = None
    last: dict = {}
    for t, batch in enumerate(data):
        m = nnx.merge(graphdef, params, rest)
        if _apply_knobs(m, sc.knobs(t, steps, faulty), last):
            _, _, rest = nnx.split(m, nnx.Param, ...)
        t0 = time.perf_counter()
        if arm == "plain":
            params, opt, loss, fin, pfin = step(params, opt, rest, batch, plain_scale)
        else:
            params, opt, ds, loss, fin, pfin = step(params, opt, ds, rest, batch)
        loss, fin, pfin = float(loss), bool(fin), bool(pfin)
        if t:  # step 0 holds the compile
            times.append(time.perf_counter() - t0)
        losses.append(loss)
        skipped.append(arm == "recipe" and not fin)
        # plain has no loss scale: any non-finite gradient is the fault; the recipe's overflow
        # skips are its loss scale at work, so only a non-finite loss counts there
        bad = not math.isfinite(loss) or (arm == "plain" and not fin) or not pfin
        if bad and first_bad is None:
            first_bad = t
        if not pfin:
            dead_at = t
            break
    return dict(
        losses=losses,
        skipped=skipped,
        times=times,
        first_nonfinite=first_bad,
        dead_at=dead_at,
        params_finite=dead_at is None,
        events=[],
    )


_LOCATE_JAXPRS: dict[tuple, Any] = {}
_LOCATE_CALLS: list[bool] = []  # per locate of the current run: was its jaxpr cached (warm)?


def _cache_locate_jaxprs(enable: bool = True) -> None:
    """Workaround: reuse the traced step jaxpr across incidents (see the module docstring).

    ``replay.locate`` keeps its compiled replays per jaxpr object, but ``locate_step`` traces a
    new jaxpr for every call, so a second incident of the same step recompiles everything. The
    cache is keyed by the step function and the structure, shapes and dtypes of its arguments
    (the values are inputs of the jaxpr, never baked in).
    """
    from nan2safe_jax import replay

    orig = getattr(replay.locate_step, "_zoo_orig", replay.locate_step)
    if not enable:
        replay.locate_step = orig
        return

    def locate_step(step_fn, *args):
        leaves, tree = jax.tree_util.tree_flatten(args)
        key = (id(step_fn), tree, tuple((jnp.shape(x), jnp.result_type(x)) for x in leaves))
        jaxpr = _LOCATE_JAXPRS.get(key)
        _LOCATE_CALLS.append(jaxpr is not None)
        if jaxpr is None:
            jaxpr = _LOCATE_JAXPRS[key] = (step_fn, jax.make_jaxpr(step_fn)(*args))
        report = replay.locate(jaxpr[1], args)
        return orig(step_fn, *args) if report is None else report

    locate_step._zoo_orig = orig
    replay.locate_step = locate_step


def _n2s_parts(model_key: str, eps: float, cfg: nan2safe.Config, arm: str = "nan2safe"):
    key = (arm, model_key, eps, cfg)
    if key not in _STEPS:
        tx = nan2safe.optax.guard(_adamw(eps), cfg)
        if arm == LR_MODEL_ARM:
            # Every trace of this step must happen inside the swap: no background compile.
            before = os.environ.get("NAN2SAFE_BACKGROUND_COMPILE")
            os.environ["NAN2SAFE_BACKGROUND_COMPILE"] = "0"
            try:
                step = _with_model_wide_lr_cut(nan2safe.make_train_step(LOSSES[model_key]))
            finally:
                if before is None:
                    del os.environ["NAN2SAFE_BACKGROUND_COMPILE"]
                else:
                    os.environ["NAN2SAFE_BACKGROUND_COMPILE"] = before
        else:
            step = nan2safe.make_train_step(LOSSES[model_key])
        _STEPS[key] = (tx, step)
    return _STEPS[key]


def _model_wide_lr_factors(params, gs, factor):
    """``train.lr_factors`` as it was before the cut went per site: ``factor`` on every
    parameter while the whole model or any site is in SAFE."""
    f = jnp.where(nan2safe.gear.any_safe(gs), factor, 1.0).astype(jnp.float32)
    return jax.tree_util.tree_map(lambda _: f, params)


def _with_model_wide_lr_cut(step_fn):
    """``step_fn`` traced with ``_model_wide_lr_factors`` (the ``LR_MODEL_ARM`` ablation).

    The step is jitted, so the swap only needs to hold while it is traced: for its first calls
    (each of its two programs), and for ``locate``, which traces ``step_fn.jitted`` or
    ``step_fn.jitted_fast`` again.
    """
    from nan2safe_jax import train

    def traced_with(fn):
        def run(*args):
            orig = train.lr_factors
            train.lr_factors = _model_wide_lr_factors
            try:
                return fn(*args)
            finally:
                train.lr_factors = orig

        return run

    wrapped = traced_with(step_fn)
    for name in dir(step_fn):
        if not name.startswith("_"):
            setattr(wrapped, name, getattr(step_fn, name))
    wrapped.jitted = jax.jit(traced_with(step_fn.jitted))
    wrapped.jitted_fast = jax.jit(traced_with(step_fn.jitted_fast))
    return wrapped


def _run_nan2safe(
    sc: Scenario, steps: int, faulty: bool, data: list, workdir: Path, arm: str = "nan2safe"
) -> dict:
    scale = sc.scale(faulty)
    tx, step_fn = _n2s_parts(sc.model, sc.eps(faulty), CFG, arm)
    if workdir.exists():
        shutil.rmtree(workdir)
    trainer = nan2safe.Trainer(
        MODELS[sc.model](_layers("nan2safe")), tx, LOSSES[sc.model], CFG, workdir, resume=False
    )
    trainer.step_fn = step_fn  # one compile per model/optimizer/config, shared by runs
    if scale is not None:
        # Config(loss_scale_init=scale), set in the state instead: the same compiled step (and
        # the same cached locate replays) serve every scenario of this model.
        opt = trainer.state.opt_state
        ls = opt.loss_scale._replace(scale=jnp.asarray(scale, jnp.float32))
        trainer.state = trainer.state.replace(opt_state=opt._replace(loss_scale=ls))
    last: dict = {}

    def stream():
        for t, batch in enumerate(data):
            m = trainer.state.model
            if _apply_knobs(m, sc.knobs(t, steps, faulty), last):
                _, _, rest = nnx.split(m, nnx.Param, ...)
                trainer.state = trainer.state.replace(rest=rest)
            yield batch

    it = stream()
    _LOCATE_CALLS.clear()
    history: list[dict] = []
    dead_at = None
    while len(history) < len(data):
        try:
            got = trainer.fit(it, steps=min(25, len(data) - len(history)))
        except nan2safe.supervisor.NanIncidentError:
            dead_at = trainer.step - 1
            break
        if not got:
            break
        history.extend(got)
    if dead_at is None and not bool(all_finite(trainer.state.params)):
        dead_at = len(history) - 1
    stamps = [h["time"] for h in history]
    warm = _LOCATE_CALLS[0] if _LOCATE_CALLS else None
    return dict(
        losses=[h["loss"] for h in history],
        skipped=[h["skipped"] for h in history],
        times=list(np.diff(stamps)) if len(stamps) > 1 else [],
        first_nonfinite=next(
            (h["step"] for h in history if h["incident"] or not math.isfinite(h["loss"])), None
        ),
        locate_warm=warm,
        dead_at=dead_at,
        params_finite=dead_at is None,
        events=list(trainer.events),
    )


def _run(sc: Scenario, arm: str, steps: int, faulty: bool, workdir: Path) -> dict:
    data = sc.batches(steps, faulty)
    if arm.startswith("nan2safe"):
        return _run_nan2safe(sc, steps, faulty, data, workdir, arm)
    return _run_functional(sc, arm, steps, faulty, data)


# ------------------------------------------------------------------------------ scoring


def _final_loss(losses: list[float]) -> float:
    tail = losses[-TAIL:]
    if len(tail) < TAIL or not all(math.isfinite(x) for x in tail):
        return float("nan")
    return float(np.mean(tail))


def _longest_run(flags: list[bool]) -> int:
    best = cur = 0
    for f in flags:
        cur = cur + 1 if f else 0
        best = max(best, cur)
    return best


def _first_step(run: dict | None, typ: str):
    return next((e["step"] for e in (run or {}).get("events", []) if e["type"] == typ), None)


def _score(sc: Scenario, arm: str, steps: int, run: dict, clean: dict | None) -> dict:
    final = _final_loss(run["losses"])
    ref = _final_loss(clean["losses"]) if clean else float("nan")
    stall = _longest_run(run["skipped"])
    done = len(run["losses"])
    after_death = steps - run["dead_at"] if run["dead_at"] is not None else steps - done
    lost = int(sum(run["skipped"][: run["dead_at"]])) + after_death
    loss_ok = math.isfinite(final) and (not math.isfinite(ref) or final <= LOSS_TOL * ref)
    survived = run["params_finite"] and stall <= STALL and loss_ok and done == steps
    ev = run["events"]
    first = lambda typ: next((e for e in ev if e["type"] == typ), None)  # noqa: E731
    loc, down, pol = first("locate"), first("downshift"), first("polluted_input")
    rec: dict[str, Any] = dict(
        scenario=sc.name,
        arm=arm,
        survived=bool(survived),
        final_loss=final,
        clean_loss=ref,
        steps=steps,
        steps_lost=int(lost),
        longest_skip_run=stall,
        first_nonfinite=run["first_nonfinite"],
        died_at=run["dead_at"],
        first_downshift=down["step"] if down else None,
        clean_first_downshift=_first_step(clean, "downshift"),
        culprit=None,
        culprit_correct=None,
        locate_seconds=None,
        incidents=None,
        median_step_s=float(np.median(run["times"])) if run["times"] else None,
        expected=sc.expect_text,
    )
    if not arm.startswith("nan2safe"):
        return rec
    rec["incidents"] = sum(e["type"] in ("locate", "polluted_input", "transient") for e in ev)
    if loc is not None:
        r = loc["report"]
        rec["locate_warm"] = run.get("locate_warm")
        rec["culprit"] = f"{r.get('site')}:{r.get('primitive')}"
        rec["locate_seconds"] = float(r.get("seconds") or 0.0)
        rec["diagnosis"] = r.get("diagnosis")
        rec["direction"] = r.get("direction")
        if sc.expect is not None:
            rec["culprit_correct"] = bool(sc.expect(r))
    elif pol is not None:
        rec["culprit"] = "polluted_input"
    if sc.polluted:
        # No op is the cause: culprit_correct stays null; the diagnosis must be polluted input.
        rec["polluted_input_reported"] = pol is not None and loc is None
    elif sc.expect is not None and loc is None:
        # An op-level fault that never reached tier 2 (tier 1 prevented every non-finite step):
        # nothing was named, so nothing can be wrong; recorded as null with a note.
        rec["note"] = "no incident: prevented before any non-finite step"
    return rec


def run_scenario(
    name: str,
    *,
    quick: bool = True,
    steps: int | None = None,
    arms=ARMS,
    reference: bool = True,
    workdir: str | Path | None = None,
) -> list[dict]:
    """Runs one scenario under each arm; returns one record per arm.

    Args:
      name: a key of ``SCENARIOS``.
      quick: CI size (100 steps) instead of 300.
      steps: overrides the number of steps.
      arms: which of ``ARMS`` to run.
      reference: also run each arm fault-free, for the final-loss criterion (without it the
        loss criterion is only "finite").
      workdir: where nan2safe's run directories go (a temporary directory by default).
    """
    if name not in SCENARIOS:
        raise ValueError(f"unknown scenario {name!r}; have {sorted(SCENARIOS)}")
    sc = SCENARIOS[name]
    steps = steps or (100 if quick else 300)
    root = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="zoo_"))
    records = []
    base = None
    for arm in arms:
        run = _run(sc, arm, steps, True, root / f"{name}_{arm}")
        # The fault-free run only matters for an arm that stayed finite (the loss criterion),
        # and for plain (its step time is the reference speed).
        alive = run["params_finite"] and len(run["losses"]) == steps
        clean = None
        if reference and (alive or arm == "plain"):
            clean = _run(sc, arm, steps, False, root / f"{name}_{arm}_clean")
        if arm == "plain":
            times = clean["times"] if clean else run["times"]
            base = float(np.median(times)) if times else None
        records.append(_score(sc, arm, steps, run, clean))
    for r in records:
        r["step_time_ratio"] = r["median_step_s"] / base if base and r["median_step_s"] else None
    if workdir is None:
        shutil.rmtree(root, ignore_errors=True)
    return records


# ------------------------------------------------------------------------------ table


def _fmt(v, spec: str = "") -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "NO"
    if isinstance(v, float):
        return "nan" if not math.isfinite(v) else format(v, spec or ".3g")
    return str(v)


def table(records: list[dict], omit: tuple[str, ...] = ()) -> str:
    """The records as the printed table, without the columns titled in ``omit``."""
    wide = lambda key, least: max([least, *(len(str(r[key])) for r in records)])  # noqa: E731
    cols = [
        ("scenario", wide("scenario", 13), "scenario", ""),
        ("arm", wide("arm", 8), "arm", ""),
        ("surv", 5, "survived", ""),
        ("lost", 5, "steps_lost", ""),
        ("1st bad", 7, "first_nonfinite", ""),
        ("down/clean", 10, "first_downshift", ""),
        ("loss/clean", 10, None, ""),
        ("culprit", 30, "culprit", ""),
        ("ok", 3, "culprit_correct", ""),
        ("loc s", 6, "locate_seconds", ".1f"),
        ("t/plain", 7, "step_time_ratio", ".2f"),
    ]
    cols = [c for c in cols if c[0] not in omit]
    head = " ".join(f"{c[0]:<{c[1]}}" for c in cols)
    lines = [f"fault zoo; nan2safe arm: {CFG_TEXT}", head, "-" * len(head)]
    for r in records:
        cells = []
        for _title, width, key, spec in cols:
            if key is None:
                f, c = r["final_loss"], r["clean_loss"]
                v = f"{f:.2f}/{c:.2f}" if math.isfinite(f) and math.isfinite(c) else _fmt(f)
            elif key == "locate_seconds" and r.get(key) is not None:
                v = f"{r[key]:.1f}" + ("w" if r.get("locate_warm") else "")
            elif key == "first_downshift" and r["arm"].startswith("nan2safe"):
                v = f"{_fmt(r[key])}/{_fmt(r['clean_first_downshift'])}"
            else:
                v = _fmt(r.get(key), spec)
            cells.append(f"{v[:width]:<{width}}")
        lines.append(" ".join(cells))
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="CI size: 100 steps per run")
    ap.add_argument("--only", default="", help="comma-separated scenario names")
    ap.add_argument("--json", type=Path, help="write the records here")
    ap.add_argument("--steps", type=int, help="steps per run (overrides --quick)")
    ap.add_argument("--cold-locate", action="store_true", help="no jaxpr cache for locate")
    ap.add_argument(
        "--arms",
        default=",".join(ARMS),
        help=f"comma-separated arms (default {','.join(ARMS)}; also {LR_MODEL_ARM}: SAFE's "
        "learning-rate cut on the whole model, the behaviour before it went per site)",
    )
    args = ap.parse_args(argv)
    arms = tuple(a for a in args.arms.split(",") if a)
    if not arms or set(arms) - {*ARMS, LR_MODEL_ARM}:
        ap.error(f"--arms: unknown arm in {args.arms!r}; have {[*ARMS, LR_MODEL_ARM]}")
    names = [n for n in args.only.split(",") if n] or list(SCENARIOS)
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        ap.error(f"unknown scenario(s) {unknown}; have {sorted(SCENARIOS)}")
    _cache_locate_jaxprs(not args.cold_locate)
    records = []
    t0 = time.time()
    for name in names:
        t1 = time.time()
        recs = run_scenario(name, quick=args.quick, steps=args.steps, arms=arms)
        records.extend(recs)
        print(f"[{name}] {time.time() - t1:.0f} s", flush=True)
    print()
    print(table(records))
    print(f"\ntotal {time.time() - t0:.0f} s")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        clean = [{k: _no_nan(v) for k, v in r.items()} for r in records]
        args.json.write_text(json.dumps(clean, indent=1, default=_json_default))
    return 0


def _no_nan(v):
    return None if isinstance(v, float) and not math.isfinite(v) else v


def _json_default(o):
    if isinstance(o, (np.integer, np.bool_)):
        return o.item()
    if isinstance(o, np.floating):
        return float(o)
    return str(o)


if __name__ == "__main__":
    sys.exit(main())
