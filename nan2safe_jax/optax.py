"""optax transforms that read the gear: loss scale, geared clipping, skip-non-finite, lr factor.

Each transform is an ``optax.GradientTransformationExtraArgs``; the gear arrives as the extra
argument ``gear`` (a ``GearState``, or an int32 level) and, for the ones that need it, the
step's finiteness as ``finite`` (a bool computed once by the step; computed here when absent).
``guard(inner, cfg)`` chains them around any optimizer.

References:
  Micikevicius et al. 2018, "Mixed Precision Training" (dynamic loss scaling).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from nan2safe_jax import gear as gear_lib
from nan2safe_jax.config import Config
from nan2safe_jax.gear import Gear, GearState
from nan2safe_jax.numerics import MAX_I32 as MAX_I32
from nan2safe_jax.numerics import all_finite, global_norm, saturating_add
from nan2safe_jax.numerics import select_tree as select_tree  # the old home of these names
from nan2safe_jax.numerics import sum_of_squares as sum_of_squares


def _level(gear) -> jax.Array:
    if isinstance(gear, GearState):
        return gear.level
    return jnp.asarray(0 if gear is None else gear, jnp.int32)


def _in_safe(gear) -> jax.Array:
    if isinstance(gear, GearState):
        return gear_lib.any_safe(gear)
    return _level(gear) >= Gear.SAFE


def _finite(updates, finite) -> jax.Array:
    return all_finite(updates) if finite is None else jnp.asarray(finite, bool)


def _verdict(updates, finite):
    """``finite`` as the transforms pass it on: a Python bool (decided at trace time, as
    ``apply_update`` traces each outcome) stays one, anything else is ``_finite``'s array."""
    return finite if isinstance(finite, bool) else _finite(updates, finite)


# --------------------------------------------------------------------------- loss scale


class LossScaleState(NamedTuple):
    scale: jax.Array  # f32[] current loss scale
    good_steps: jax.Array  # i32[] finite steps since the last change
    level: jax.Array  # i32[] global gear seen at the last update (detects the first downshift)


def dynamic_loss_scale(cfg: Config) -> optax.GradientTransformationExtraArgs:
    """Dynamic loss scale whose value lives in the optimizer state; updates pass through.

    Backs off by ``1 / loss_scale_factor`` on a non-finite step, grows by ``loss_scale_factor``
    after ``loss_scale_period`` finite steps, stays within ``[loss_scale_min, loss_scale_max]``,
    and is cut by ``loss_scale_downshift`` (1/256) when the gear leaves FAST (the first downshift:
    too large a scale is what overflows fp16 gradients). The cut belongs to the lower gears: the
    recovery to FAST undoes it (else each alarm would cost 1/256 for good, and a run that
    recovered twice would train at FAST near ``loss_scale_min``, where small fp16 gradients
    flush to 0; a scale still too large then backs off as any overflow does).

    The step reads the scale with ``loss_scale_of(opt_state)`` to scale the loss, then passes the
    *unscaled* gradients to ``update``.
    """

    def init_fn(params):
        del params
        return LossScaleState(
            scale=jnp.asarray(cfg.loss_scale_init, jnp.float32),
            good_steps=jnp.zeros([], jnp.int32),
            level=jnp.zeros([], jnp.int32),
        )

    def update_fn(updates, state, params=None, *, gear=None, finite=None, **extra):
        del params, extra
        ok = _finite(updates, finite)
        level = _level(gear)
        good = jnp.where(ok, saturating_add(state.good_steps), 0)
        grow = good >= cfg.loss_scale_period
        scale = jnp.where(ok, state.scale, state.scale / cfg.loss_scale_factor)
        scale = jnp.where(grow, scale * cfg.loss_scale_factor, scale)
        downshift = (state.level == Gear.FAST) & (level > Gear.FAST)
        recover = (state.level > Gear.FAST) & (level == Gear.FAST)
        scale = jnp.where(downshift, scale * cfg.loss_scale_downshift, scale)
        scale = jnp.where(recover, scale / cfg.loss_scale_downshift, scale)
        scale = jnp.clip(scale, cfg.loss_scale_min, cfg.loss_scale_max).astype(jnp.float32)
        new = LossScaleState(scale, jnp.where(grow, 0, good).astype(jnp.int32), level)
        return updates, new

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


# --------------------------------------------------------------------------- clipping


def _times(u: jax.Array, k: jax.Array) -> jax.Array:
    """``u * k`` computed in f32 (an fp16 update times a loss-scale factor like 2**-24 would
    round it away), in ``u``'s dtype."""
    return (u.astype(jnp.float32) * k).astype(u.dtype)


class GearedClipState(NamedTuple):
    clipped: jax.Array  # i32[] steps clipped so far (saturating)


def geared_clip(
    max_norm: float | None, factors=(1.0, 0.5, 0.5)
) -> optax.GradientTransformationExtraArgs:
    """Clips by global norm with a threshold that tightens as the gear drops.

    The threshold is ``max_norm * factors[level]``. The norm is computed without overflow (or
    taken from the extra argument ``grad_norm`` when the caller has it already), and a
    non-finite norm scales the update to zero instead of turning it into NaN.

    The extra argument ``grad_unscale`` (a scalar; ``grad_norm`` must then be given, of the
    unscaled gradients) says the updates are still loss-scaled: each is multiplied by it, in
    f32, in the same pass as the clip. The train step passes the loss-scaled gradients so: the
    unscale then fuses with the clip and the optimizer's kernels, where a separate unscale was
    one more kernel per parameter.

    The extra argument ``finite=True`` (a Python bool, as ``apply_update`` passes it for the
    outcome it applies) says every element is finite: the mask that zeroes non-finite
    elements is then not traced (a select per element in each kernel the clip fuses into).

    Args:
      max_norm: FAST threshold; ``None`` passes updates through (unscaled, with
        ``grad_unscale``).
      factors: threshold factor for FAST, STABLE and SAFE.
    """
    factors = tuple(float(f) for f in factors)
    if len(factors) != 3 or not all(0 < f <= 1 for f in factors):
        raise ValueError(f"factors must be three values in (0, 1], got {factors!r}")

    def init_fn(params):
        del params
        return GearedClipState(clipped=jnp.zeros([], jnp.int32))

    def update_fn(
        updates,
        state,
        params=None,
        *,
        gear=None,
        grad_norm=None,
        grad_unscale=None,
        finite=None,
        **extra,
    ):
        del params, extra
        if grad_unscale is not None and grad_norm is None:
            raise ValueError("geared_clip: grad_unscale needs grad_norm (of the unscaled updates)")
        if max_norm is None:
            if grad_unscale is None:
                return updates, state
            k = jnp.asarray(grad_unscale, jnp.float32)
            return jax.tree_util.tree_map(lambda u: _times(u, k), updates), state
        thr = max_norm * jnp.asarray(factors, jnp.float32)[jnp.clip(_level(gear), 0, 2)]
        norm = global_norm(updates) if grad_norm is None else grad_norm
        ok = jnp.isfinite(norm)
        factor = jnp.minimum(1.0, thr / jnp.maximum(norm, 1e-30))
        unscale = 1.0 if grad_unscale is None else jnp.asarray(grad_unscale, jnp.float32)
        # The multiplier is a ``lax.cond``'s result, not a ``jnp.where``'s: XLA copies a scalar
        # computation into every kernel that reads it (two or three per parameter, each then
        # compiling the whole chain: 550 of the demo step's 7,600 fused instructions, and the
        # compile time follows the fused instructions); a cond's result is read as a value.
        k = jax.lax.cond(
            ok,
            lambda: (factor * unscale).astype(jnp.float32),  # a float64 norm (x64) too
            lambda: jnp.zeros([], jnp.float32),
        )
        if grad_unscale is None:
            scale = lambda u: u * k.astype(u.dtype)  # noqa: E731
        else:
            scale = lambda u: _times(u, k)  # noqa: E731
        if finite is True:  # every element is finite: known at trace time, no mask
            clipped = jax.tree_util.tree_map(lambda u: scale(u).astype(u.dtype), updates)
        else:
            clipped = jax.tree_util.tree_map(
                lambda u: jnp.where(jnp.isfinite(u), scale(u), 0).astype(u.dtype), updates
            )
        hit = (~ok | (factor < 1.0)).astype(jnp.int32)
        return clipped, GearedClipState(saturating_add(state.clipped, hit))

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


# --------------------------------------------------------------------------- lr factor


def safe_lr_factor(factor: float) -> optax.GradientTransformationExtraArgs:
    """Scales updates by ``factor`` where the fault is (docs/design.md, "Gears").

    With the extra argument ``lr_factors`` (a tree like the updates, from
    ``nan2safe_jax.train.lr_factors``: ``factor`` on the parameters of sites in SAFE, 1
    elsewhere) each update is scaled by its own factor. Without it, every update is scaled by
    ``factor`` while the model or any site is in SAFE (``gear``).
    """

    def update_fn(updates, state, params=None, *, gear=None, lr_factors=None, **extra):
        del params, extra
        if lr_factors is not None:
            scaled = jax.tree_util.tree_map(
                lambda u, f: (u * f).astype(u.dtype), updates, lr_factors
            )
            return scaled, state
        f = jnp.where(_in_safe(gear), factor, 1.0)
        return jax.tree_util.tree_map(lambda u: (u * f).astype(u.dtype), updates), state

    return optax.GradientTransformationExtraArgs(lambda p: optax.EmptyState(), update_fn)


# --------------------------------------------------------------------------- skip


class SkipState(NamedTuple):
    inner: optax.OptState
    skipped: jax.Array  # i32[] steps skipped so far (saturating)
    streak: jax.Array  # i32[] consecutive skipped steps


def skip_nonfinite(inner: optax.GradientTransformation) -> optax.GradientTransformationExtraArgs:
    """Skips the whole update, keeping ``inner``'s state, when the gradients are not finite.

    Unlike ``optax.apply_if_finite``, it never applies a non-finite update, however many come in
    a row: a run that keeps producing NaN stalls visibly (``streak``) instead of poisoning its
    parameters. The skipped branch is not computed (``lax.cond``); a Python bool ``finite``
    picks the branch at trace time (``update_outcomes`` traces both so; ``apply_update`` then
    selects, the train step keeps one by its own verdict).
    """
    inner = optax.with_extra_args_support(inner)

    def init_fn(params):
        # One array per field: a state whose leaves share an array cannot be donated.
        return SkipState(inner.init(params), jnp.zeros([], jnp.int32), jnp.zeros([], jnp.int32))

    def update_fn(updates, state, params=None, *, finite=None, **extra):
        verdict = _verdict(updates, finite)
        ok = jnp.asarray(verdict, bool)

        def apply(args):
            u, s = args
            return inner.update(u, s, params, finite=verdict, **extra)

        def skip(args):
            u, s = args
            return jax.tree_util.tree_map(jnp.zeros_like, u), s

        if isinstance(verdict, bool):
            new_updates, new_inner = (apply if verdict else skip)((updates, state.inner))
        else:
            new_updates, new_inner = jax.lax.cond(ok, apply, skip, (updates, state.inner))
        streak = jnp.where(ok, 0, saturating_add(state.streak))
        skipped = jnp.where(ok, state.skipped, saturating_add(state.skipped))
        return new_updates, SkipState(new_inner, skipped, streak)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


# --------------------------------------------------------------------------- f32 inner


def _to_f32(tree):
    return jax.tree_util.tree_map(
        lambda x: x.astype(jnp.float32) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree
    )


def in_float32(inner: optax.GradientTransformation) -> optax.GradientTransformationExtraArgs:
    """Runs ``inner`` on f32 copies of the gradients and parameters; casts updates back.

    Half-precision optimizer moments are the write-up's second NaN source: Adam's second
    moment of an fp16 gradient underflows to 0 and the update becomes tiny/tiny = inf. Keeping
    the optimizer state in f32 (the usual master-weights recipe) removes it at the price of f32
    moments; the parameters keep their own dtype.
    """
    inner = optax.with_extra_args_support(inner)

    def init_fn(params):
        return inner.init(_to_f32(params))

    def update_fn(updates, state, params=None, **extra):
        dtypes = jax.tree_util.tree_map(lambda u: u.dtype, updates)
        p32 = None if params is None else _to_f32(params)
        new, state = inner.update(_to_f32(updates), state, p32, **extra)
        new = jax.tree_util.tree_map(lambda u, d: u.astype(d), new, dtypes)
        return new, state

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


# --------------------------------------------------------------------------- guard


class GuardState(NamedTuple):
    loss_scale: LossScaleState
    skip: SkipState  # skip.inner = (clip state, inner optimizer state, lr-factor state)


def guard(inner: optax.GradientTransformation, cfg: Config | None = None):
    """Wraps any optimizer: loss scale + geared clip + skip-non-finite + SAFE lr factor.

    Order: the loss scale sees every step (it must back off on a non-finite one); the rest is
    skipped as a whole when the gradients are not finite: geared clip, then ``inner``, then the
    SAFE learning-rate factor on the final update. ``inner`` runs in f32 (``in_float32``), so
    half-precision parameters never get half-precision optimizer moments.

    Args:
      inner: any optax transformation (e.g. ``optax.adamw(3e-4)``).
      cfg: thresholds; defaults to ``Config()``.

    Returns:
      A ``GradientTransformationExtraArgs`` whose ``update`` takes ``gear=`` (a ``GearState``)
      and optionally ``finite=``, ``grad_norm=`` and, for loss-scaled gradients,
      ``grad_unscale=`` (see ``geared_clip``); its state is a ``GuardState``.
    """
    cfg = cfg or Config()
    factors = (1.0, cfg.clip_downshift, cfg.clip_downshift)
    scale_tx = dynamic_loss_scale(cfg)
    body = skip_nonfinite(
        optax.chain(
            geared_clip(cfg.clip_norm, factors),
            in_float32(inner),
            safe_lr_factor(cfg.safe_lr_factor),
        )
    )

    def init_fn(params):
        skip = body.init(params)
        if holds_guard(skip):
            raise ValueError(
                "tx: the optimizer passed to guard (or to TrainState.create / Trainer, which "
                "wrap it in one) already holds a nan2safe guard inside another optax wrapper "
                "(optax.chain, apply_if_finite, MultiSteps ...): the outer guard's loss-scale "
                "argument would unscale the gradients twice. Put the guard outermost, once: "
                "guard(optax.chain(...)), or pass the plain optimizer"
            )
        return GuardState(scale_tx.init(params), skip)

    def update_fn(updates, state, params=None, *, gear=None, finite=None, **extra):
        verdict = _verdict(updates, finite)
        _, ls = scale_tx.update(updates, state.loss_scale, params, gear=gear, finite=verdict)
        new_updates, sk = body.update(
            updates, state.skip, params, gear=gear, finite=verdict, **extra
        )
        return new_updates, GuardState(ls, sk)

    tx = GuardTransformation(init_fn, update_fn)
    tx.cfg = cfg
    return tx


class GuardTransformation(optax.GradientTransformationExtraArgs):
    """What ``guard`` returns: an optax transformation that also says, as ``cfg``, the
    Config its loss scale, clip and SAFE learning-rate factor were made with (read by
    ``TrainState.create``, which refuses a different one for those fields)."""

    cfg: Config


# The Config fields a guard reads: the loss scale, the geared clip, the SAFE lr factor.
GUARD_FIELDS = (
    "loss_scale_init",
    "loss_scale_factor",
    "loss_scale_period",
    "loss_scale_min",
    "loss_scale_max",
    "loss_scale_downshift",
    "clip_norm",
    "clip_downshift",
    "safe_lr_factor",
)


def config_of(tx, cfg: Config | None) -> Config:
    """``cfg``; when it is None, the Config the guard ``tx`` was made with (a guard passed
    without a Config keeps its own, it is not compared with ``Config()``'s defaults), else
    ``Config()``."""
    if cfg is None and isinstance(tx, GuardTransformation):
        cfg = getattr(tx, "cfg", None)
    return Config() if cfg is None else cfg


def check_guard_config(tx, cfg: Config) -> None:
    """Raises when ``tx`` is a guard made with a Config that differs from ``cfg`` in a field
    the guard reads: the guard's would win for those, silently, and the state's ``cfg`` say
    otherwise.

    Raises:
      ValueError: naming each such field with both values.
    """
    made = getattr(tx, "cfg", None)
    if not isinstance(tx, GuardTransformation) or not isinstance(made, Config):
        return  # a guard inside another wrapper: its Config cannot be read
    differ = [f for f in GUARD_FIELDS if getattr(made, f) != getattr(cfg, f)]
    if differ:
        raise ValueError(
            "tx is a nan2safe guard made with another Config than cfg: "
            + ", ".join(
                f"{f} {getattr(made, f)!r} (guard) vs {getattr(cfg, f)!r} (cfg)" for f in differ
            )
            + ". Pass the same Config to both (guard(tx, cfg)), or the plain optimizer, which "
            "is wrapped in guard(tx, cfg)"
        )


def update_outcomes(tx, grads, opt_state, params, **extra):
    """A ``guard`` state's two outcomes of a step, unselected: ``(new params, new optimizer
    state, skipped optimizer state)``.

    The update is traced with the guard's ``finite`` ``True`` (added to the parameters, no
    per-element mask in the clip) and the skip with ``False`` (the inner state as it was, the
    guard's own counters moved: the loss scale backed off, the skip streak counted). Nothing
    is selected here: the caller keeps the parameters and the inner state by the step's own
    verdict. The train step keeps them with one ``cond`` (``train.train_step``; the kept
    branch selects the skip's or the old optimizer state, which differ only in the guard's
    scalar counters), so the new moments are written once and the parameter kernel reads
    them, as in a plain optax step: a select per leaf made each parameter's kernel recompute
    the moments it could not read (the selected ones are not the new ones) and grew every
    optimizer kernel by the selects.

    Args:
      tx: a ``guard(...)`` optimizer.
      grads, opt_state, params, **extra: as ``tx.update`` takes them; only finite gradients
        give finite new parameters (non-finite ones give NaNs, for the caller to drop).

    Returns:
      ``(new_params, new_opt_state, skipped_opt_state)``.
    """
    if not is_guarded(opt_state):
        raise ValueError("update_outcomes: opt_state is not a guard(...) state")
    updates, new_opt = tx.update(grads, opt_state, params, finite=True, **extra)
    _, skipped_opt = tx.update(grads, opt_state, params, finite=False, **extra)
    return optax.apply_updates(params, updates), new_opt, skipped_opt


def apply_update(tx, grads, opt_state, params, applied: jax.Array, **extra):
    """``tx``'s update of ``params``: ``(new params, new optimizer state)``.

    With a ``guard`` state both outcomes are traced with the guard's ``finite`` decided at
    trace time (``update_outcomes``) and selected by ``applied``, leaf by leaf; each select
    fuses into the kernel that computes the new leaf, so the update is never an array of its
    own and the gradients feed the optimizer's kernels directly. A skipped step computes the
    update it drops; skips are rare, and an optimizer fed a NaN gradient only computes NaNs
    that the select discards. Any other state: ``tx.update`` with ``finite=applied``, then
    ``optax.apply_updates``.

    Args:
      tx: the optimizer (``guard(...)`` for the fused form).
      grads: the gradients, as ``tx.update`` takes them.
      opt_state: ``tx``'s state.
      params: the parameters.
      applied: bool[]: apply this step's update; only ever with finite gradients (the train
        step's verdict): the outcome it selects is traced with ``finite=True``, so the clip
        does not mask non-finite elements there.
      **extra: ``tx.update``'s extra arguments (``gear``, ``grad_norm``, ...).

    Returns:
      ``(new_params, new_opt_state)``.
    """
    if not is_guarded(opt_state):
        updates, new_opt = tx.update(grads, opt_state, params, finite=applied, **extra)
        return optax.apply_updates(params, updates), new_opt
    new_params, new_opt, skipped_opt = update_outcomes(tx, grads, opt_state, params, **extra)
    return select_tree(applied, (new_params, new_opt), (params, skipped_opt))


def is_guarded(opt_state) -> bool:
    """True when ``opt_state`` is the state of ``guard``."""
    return isinstance(opt_state, GuardState)


def _states_of(opt_state, kinds: tuple[type, ...]) -> list:
    """The nodes of ``opt_state`` that are instances of ``kinds``, at any depth, in order."""
    nodes = jax.tree_util.tree_leaves(opt_state, is_leaf=lambda x: isinstance(x, kinds))
    return [x for x in nodes if isinstance(x, kinds)]


def holds_guard(opt_state) -> bool:
    """True when a ``guard`` state is anywhere in ``opt_state`` (at its top or nested in the
    state of ``optax.chain``, ``apply_if_finite`` ...)."""
    return bool(_states_of(opt_state, (GuardState,)))


_SCHEDULE_STATES = (
    optax.ScaleByScheduleState,
    optax.InjectHyperparamsState,
    optax.InjectStatefulHyperparamsState,
)


def schedule_count(opt_state) -> jax.Array | None:
    """The step count the optimizer's own learning-rate schedule reads: the ``count`` of the
    first ``optax.scale_by_schedule`` state (``optax.adam(schedule)`` ...) or
    ``inject_hyperparams`` state in ``opt_state``; a skipped step does not advance it, nor does
    a micro-step of ``optax.MultiSteps``. None when ``opt_state`` holds neither."""
    found = _states_of(opt_state, _SCHEDULE_STATES)
    return jnp.asarray(found[0].count, jnp.int32) if found else None


def skipped_of(opt_state) -> jax.Array:
    """Steps a ``guard`` state has skipped so far (0 for any other state)."""
    if isinstance(opt_state, GuardState):
        return opt_state.skip.skipped
    return jnp.zeros([], jnp.int32)


def skip_streak(opt_state) -> jax.Array:
    """Consecutive skipped steps recorded by a ``guard`` state (0 for any other state)."""
    if isinstance(opt_state, GuardState):
        return opt_state.skip.streak
    return jnp.zeros([], jnp.int32)


def loss_scale_of(opt_state) -> jax.Array:
    """The current loss scale held by a ``guard`` state (1.0 for any other state)."""
    if isinstance(opt_state, GuardState):
        return opt_state.loss_scale.scale
    return jnp.ones([], jnp.float32)
