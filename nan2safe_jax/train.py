"""TrainState and make_train_step: the one jitted step with both gears and tier 1 inside.

One step, as data (docs/design.md): push the gears into the model's sites, run the forward (sites
switch on their gear and write their probes), scale the loss, take gradients, unscale, score
the probes, decide the next gears, and apply a guarded update. Nothing leaves the device.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from nan2safe_jax import detector as det_lib
from nan2safe_jax import gear as gear_lib
from nan2safe_jax import numerics
from nan2safe_jax import optax as guard_lib
from nan2safe_jax import probe as probe_lib
from nan2safe_jax import sharding as sharding_lib
from nan2safe_jax.config import Config
from nan2safe_jax.detector import DetectorState
from nan2safe_jax.gear import Gear, GearState
from nan2safe_jax.ops import dispatch
from nan2safe_jax.programs import MAX_KNOWN, StepPrograms
from nan2safe_jax.site import (
    SITE_VARIABLES,
    Probe,
    ProbeBlock,
    SiteTemplate,
    fill_defaults,
    name_sites,
    param_name,
    path_name,
    probe_blocks,
    probe_rows,
    site_gears,
)

BUILTIN_PROBES = ("loss", "grad_norm", "update_norm")
OVERFLOW_GRACE = 8  # loss-scale overflows in a row (a 256x back-off) before the first downshift


class TrainState(struct.PyTreeNode):
    """Everything the step carries: the model's state, optimizer state, gears and baselines."""

    graphdef: Any = struct.field(pytree_node=False)
    params: Any  # nnx.State of nnx.Param
    rest: Any  # nnx.State of every other variable but the sites' (RNG, batch statistics, ...)
    opt_state: Any  # guard state (see nan2safe_jax.optax.guard)
    gear: GearState
    detector: DetectorState
    step: jax.Array  # i32[]
    update_stats: jax.Array  # f32[NUM_STATS] the previous update's norm, the "update" probe
    lr_scale: jax.Array  # f32[] learning-rate multiplier the host sets (loss-spike recovery)
    tx: Any = struct.field(pytree_node=False)
    cfg: Config = struct.field(pytree_node=False)
    # The site variables (gears, probes) by shape only: the step rebuilds them, gears from
    # ``gear``; they are not carried (``site.SiteTemplate``).
    site_template: SiteTemplate = struct.field(pytree_node=False)

    @classmethod
    def create(cls, model: nnx.Module, tx, cfg: Config | None = None) -> TrainState:
        """Builds the state of ``model`` (an ``nnx.Module``) and optimizer ``tx``.

        Names every site by its module path, so gears and reports refer to it. A ``tx`` that is
        not already ``nan2safe.optax.guard(...)`` is wrapped in one: loss scale, geared clipping,
        skip-non-finite and the SAFE learning-rate factor are the point of the library.

        ``cfg`` defaults to the guard's own Config when ``tx`` is a guard, else ``Config()``.

        Raises:
          ValueError: ``model`` is not an ``nnx.Module``; ``cfg`` is not a ``Config``; ``tx``
            is a guard made with a Config that differs from ``cfg`` in a field the guard reads
            (the loss scale, the clip, the SAFE learning-rate factor).
        """
        if not isinstance(model, nnx.Module):
            raise ValueError(f"model must be a flax.nnx.Module, got {type(model).__name__}")
        cfg = guard_lib.config_of(tx, cfg)
        if not isinstance(cfg, Config):
            raise ValueError(f"cfg must be a nan2safe.Config, got {type(cfg).__name__}")
        sites = name_sites(model)
        if not sites:
            warnings.warn(
                "the model has no sites (no nan2safe.nn modules, no SiteGear variables): tier 2 "
                "can locate a fault but only downshift the whole model, and tier 1 sees only "
                "the loss and gradient probes",
                stacklevel=2,
            )
        # A copy: the state must not share variables with ``model``, which the caller may run
        # (a train-mode forward moves BatchNorm's statistics and Dropout's counter in place).
        # Abstract site variables (a model from ``nnx.eval_shape`` given only its Params) take
        # their defaults in the copy.
        model = fill_defaults(nnx.clone(model))
        graphdef, params, site_vars, rest = nnx.split(model, nnx.Param, SITE_VARIABLES, ...)
        guard_lib.check_guard_config(tx, cfg)
        probe_opt = tx.init(params)
        if not guard_lib.is_guarded(probe_opt):
            tx = guard_lib.guard(tx, cfg)
            probe_opt = tx.init(params)
        names = tuple(watched_probes(model, cfg.probes)) + BUILTIN_PROBES
        return cls(
            graphdef=graphdef,
            params=params,
            rest=rest,
            opt_state=probe_opt,
            gear=GearState.create(sites),
            detector=DetectorState.create(names),
            step=jnp.zeros([], jnp.int32),
            update_stats=probe_lib.zeros(),
            lr_scale=jnp.ones([], jnp.float32),
            tx=tx,
            cfg=cfg,
            site_template=SiteTemplate(site_vars),
        )

    @property
    def model(self) -> nnx.Module:
        """A fresh ``nnx.Module`` holding this state's parameters; each site's gear variable
        holds its effective gear, its probes zeros. Its variables are copies: running it (in
        train mode too) or editing it leaves the state as it was; ``state.replace(params=
        nnx.state(m, nnx.Param))`` takes edits back."""
        return nnx.merge(self.graphdef, self.params, _site_state(self), self.rest, copy=True)

    @property
    def loss_scale(self) -> jax.Array:
        return guard_lib.loss_scale_of(self.opt_state)

    def with_probes(self, names) -> TrainState:
        """The same state with the detector tracking ``names`` (kept baselines carry over)."""
        old = self.detector
        if tuple(names) == old.names:
            return self
        new = DetectorState.create(names)
        idx = {n: i for i, n in enumerate(old.names)}
        take = [idx.get(n, -1) for n in new.names]
        t = jnp.asarray(take)
        keep = t >= 0
        pick = lambda new_v, old_v: jnp.where(keep, old_v[jnp.maximum(t, 0)], new_v)
        new = new.replace(
            ema=pick(new.ema, old.ema),
            emvar=pick(new.emvar, old.emvar),
            prev1=pick(new.prev1, old.prev1),
            prev2=pick(new.prev2, old.prev2),
            count=pick(new.count, old.count),
            last_lr=old.last_lr,
            cooldown=old.cooldown,
        )
        return self.replace(detector=new)


def _replace(self, **updates) -> TrainState:
    """``TrainState.replace``: ``dataclasses.replace``, except that a ``rest`` holding site
    variables is stripped of them. ``nnx.split(state.model, nnx.Param, ...)`` (the usual way to
    write a model's edited variables back, e.g. a knob) returns them; the step rebuilds them
    (``site.SiteTemplate``), and a ``rest`` with them would change the state's structure."""
    rest = updates.get("rest")
    if isinstance(rest, nnx.State):
        updates["rest"] = nnx.filter_state(rest, nnx.Not(SITE_VARIABLES))
    return dataclasses.replace(self, **updates)


TrainState.replace = _replace  # after the class: flax's dataclass sets its own ``replace``


def _site_state(
    state: TrainState,
    fast_only: bool = False,
    fast_sites: frozenset[str] | None = None,
    known_gears: tuple[tuple[str, int], ...] | None = None,
) -> nnx.State:
    """The model's site variables for a step: every gear variable set to its effective gear,
    every probe zeros (the forward writes the ones it computes).

    ``fast_only``: every gear variable holds ``ops.dispatch.fast_only_gear`` (FAST, known at
    trace time), so each site calls its FAST path directly and traces no gear switch at all.
    ``fast_sites`` (a partial program): those sites' gear variables do, and every other site's
    holds its gear as ``ops.dispatch.switched_gear`` (one plain switch: only the taken path
    runs).
    ``known_gears`` (a replay program, ``programs.known_gears``): each named site's gear
    variable holds ``ops.dispatch.known_gear`` of its gear (that path alone, no switch); any
    other site's holds its gear as ``switched_gear``.
    """
    site = state.site_template.zeros()
    model = nnx.merge(state.graphdef, state.params, site, state.rest, copy=True)
    known = dict(known_gears) if known_gears is not None else None
    for name, var in site_gears(model).items():
        if known is not None and name in known:
            var.set_value(dispatch.known_gear(known[name], jnp.shape(var.get_value())))
        elif fast_only or (fast_sites is not None and name in fast_sites):
            var.set_value(dispatch.fast_only_gear(jnp.shape(var.get_value())))
        elif name in state.gear.sites:
            eff = gear_lib.effective(state.gear, name)
            eff = jnp.broadcast_to(eff, jnp.shape(var.get_value())).astype(jnp.int32)
            switched = fast_sites is not None or known is not None
            var.set_value(dispatch.switched_gear(eff) if switched else eff)
    return nnx.split(model, nnx.Param, SITE_VARIABLES, ...)[2]


def watched_blocks(model: nnx.Module, kinds) -> list[ProbeBlock]:
    """``probe_blocks(model)`` less the probes of a kind not in ``kinds`` (``Config.probes``).

    A site maps its ``Probe`` attributes to kinds in ``probe_kinds``; a probe a module declares
    or sows outside that map is always watched.
    """
    kinds = frozenset(kinds)
    off = set()
    for path, node in nnx.iter_graph(model):
        for attr, kind in getattr(node, "probe_kinds", {}).items():
            if kind not in kinds:
                off.add(path_name((*path, attr)))
    blocks = probe_blocks(model)
    if not off:
        return blocks
    return [b for b in blocks if b.names[0].split("[", 1)[0] not in off]


def watched_probes(model: nnx.Module, kinds) -> dict[str, jax.Array]:
    """``watched_blocks`` row by row: ``{probe name: f32[NUM_STATS]}`` (``collect_probes``
    less the probes of a kind not in ``kinds``)."""
    return probe_rows(watched_blocks(model, kinds))


def _forward(state: TrainState, site, params, batch, loss_fn, has_aux: bool = False):
    model = nnx.merge(state.graphdef, params, site, state.rest, copy=True)
    declared = {path for path, node in nnx.iter_graph(model) if isinstance(node, Probe)}
    with probe_lib.probe_set(state.cfg.probes), dispatch.hoisting():
        out = loss_fn(model, batch)
    if has_aux:
        if not (isinstance(out, tuple) and len(out) == 2):
            raise ValueError(
                f"has_aux=True: loss_fn must return (loss, aux), got {type(out).__name__}"
            )
        loss, aux = out
    elif isinstance(out, tuple):
        raise ValueError(
            f"loss_fn returned a tuple of {len(out)}; if it is (loss, aux), pass has_aux=True "
            "(to make_train_step or Trainer) and aux lands in metrics['aux']"
        )
    else:
        loss, aux = out, None
    if not hasattr(loss, "shape") or jnp.ndim(loss) != 0:
        raise ValueError(
            f"loss_fn must return a scalar loss, got shape {getattr(loss, 'shape', type(loss))}; "
            "reduce it (e.g. with .mean()) inside loss_fn"
        )
    probes = watched_blocks(model, state.cfg.probes)
    # Probes sown during the call are new variables: drop them so the state keeps its structure.
    sown = lambda path, node: isinstance(node, Probe) and tuple(path) not in declared
    nnx.pop(model, sown)
    new_rest = nnx.split(model, nnx.Param, SITE_VARIABLES, ...)[3]
    return loss, probes, new_rest, aux


def lr_factors(params, gs: GearState, factor: float):
    """Per-parameter SAFE learning-rate factor: ``factor`` where the parameter's site runs in
    SAFE, else 1 (docs/design.md, "Gears": the cut goes where the fault is).

    A parameter belongs to the innermost site whose module path prefixes its own; one in no site
    follows the global level. A stacked site's gear ``[L]`` broadcasts over the parameter's
    leading layer axis, so one layer in SAFE slows only that layer.

    Args:
      params: the model's ``nnx.Param`` state.
      gs: the gears the step runs with.
      factor: ``cfg.safe_lr_factor``.

    Returns:
      A tree like ``params`` of f32 factors (scalars, or ``[L, 1, ...]`` for stacked sites).
    """
    names = sorted(gs.sites, key=len, reverse=True)

    def one(path, leaf):
        pname = param_name(path)
        site = next((n for n in names if pname == n or pname.startswith(n + ".")), None)
        g = gs.level if site is None else gear_lib.effective(gs, site)
        f = jnp.where(g >= Gear.SAFE, factor, 1.0).astype(jnp.float32)
        if f.ndim and jnp.ndim(leaf) >= f.ndim and jnp.shape(leaf)[: f.ndim] == f.shape:
            f = f.reshape(f.shape + (1,) * (jnp.ndim(leaf) - f.ndim))
        elif f.ndim:
            f = jnp.where(jnp.any(g >= Gear.SAFE), factor, 1.0).astype(jnp.float32)
        return f

    return jax.tree_util.tree_map_with_path(one, params)


def train_step(
    state: TrainState,
    batch,
    loss_fn: Callable,
    lr_schedule: Callable | None = None,
    has_aux: bool = False,
    fast_only: bool = False,
    fast_sites: frozenset[str] | None = None,
    known_gears: tuple[tuple[str, int], ...] | None = None,
    partitioned: bool = False,
    large_sum: Callable | None = None,
    replicated: Callable | None = None,
) -> tuple[TrainState, dict]:
    """One step (un-jitted); ``make_train_step`` jits it. See the module docstring.

    ``fast_only``: the step specialised to a state whose gears are all FAST
    (``programs.all_fast``): every site runs its FAST path as plain code, with no gear switch
    to trace or compile (``ops.dispatch.fast_only_gear``). The gear logic itself (detector,
    transitions, learning-rate factors) still runs, on the gears such a state holds as
    constants (``gear.known_fast``), so it computes what the general step computes for it,
    next gears included.

    ``fast_sites`` (without ``fast_only``): a *partial* program, for a state whose level and
    these sites are FAST while the other sites are not (one site in SAFE after an incident):
    these sites run their FAST path as plain code, the others one plain switch per op (only
    the taken path runs), and the gear logic is the general step's (``nan2safe_jax.programs``).

    ``known_gears`` (without ``fast_only``): tier 2's replay program for one state
    (``programs.known_gears`` of its gears): each named site runs the path of its gear as plain
    code, with no switch, and the gear logic is the general step's.

    ``partitioned``: the step is for a program sharded over devices (``make_train_step``
    passes it with a mesh or rules): probes reduce in the form XLA's SPMD partitioner
    all-reduces (``probe.partitioned``); the same statistics. ``large_sum`` (with it,
    ``sharding.Rules.sum_of_squares``): the gradient and update sums of squares split each
    replicated parameter-sized array over the devices (``numerics.sum_of_squares``);
    ``replicated`` (``sharding.Rules.replicates``): which leaves the devices hold whole, the
    only small leaves those sums concatenate.

    A step that is not applied (``metrics["skipped"]``) returns every variable of the state as
    it was — parameters, the optimizer's own state (Adam's moments), the model's other
    variables (BatchNorm statistics), detector baselines — except the gears, the step counter
    and, after non-finite gradients, the guard's counters (the loss scale backs off, the skip
    count and streak grow). After a bad update (finite gradients, a non-finite change) the
    whole optimizer state is kept. A batch with a NaN or ``+inf`` is data, not a fault
    (``metrics["polluted"]``): it is skipped with the gears and the whole optimizer state,
    loss scale included, untouched. A ``-inf`` in the batch (an additive mask's fill) is a
    value, as it is to the probes: the step trains on it, and only a step whose loss (or a
    probe) goes non-finite with it is a polluted batch; so is a finite value past 2**64
    that is no mask fill (``numerics.huge_values``: it squares past f32).
    """
    if partitioned:
        with probe_lib.partitioned():
            return train_step(
                state,
                batch,
                loss_fn,
                lr_schedule,
                has_aux,
                fast_only,
                fast_sites,
                known_gears,
                large_sum=large_sum,
                replicated=replicated,
            )
    cfg = state.cfg
    gs = gear_lib.known_fast(state.gear) if fast_only else state.gear
    site = _site_state(state, fast_only, fast_sites, known_gears)
    scale = guard_lib.loss_scale_of(state.opt_state)
    # Reductions over the batch's floating leaves; under sharding global reductions in the one
    # SPMD program, so every process reads the same verdict (``polluted`` below).
    batch_bad, batch_minus_inf, batch_huge = numerics.nonfinite_kinds(batch)

    def scaled_loss(params):
        loss, probes, new_rest, aux = _forward(state, site, params, batch, loss_fn, has_aux)
        return loss.astype(jnp.float32) * scale, (loss, probes, new_rest, aux)

    (_, (loss, probes, new_rest, aux)), sgrads = jax.value_and_grad(scaled_loss, has_aux=True)(
        state.params
    )
    inv_scale = 1.0 / scale
    # The guard unscales the gradients behind its skip ``cond``, fused with its clip
    # (``optax.geared_clip``); without a guard there is no loss scale (``scale`` is 1).
    unscale = {"grad_unscale": inv_scale} if guard_lib.is_guarded(state.opt_state) else {}
    loss32 = jnp.asarray(loss, jnp.float32)
    # One sweep over the scaled gradients gives both their finiteness (a NaN or inf anywhere
    # makes the sum non-finite) and the gradient norm. A sum that overflows f32 with finite
    # gradients means scaled gradients past ~1e19: an overflow for the loss scale all the same.
    sgrad_sq = numerics.sum_of_squares(sgrads, large_sum=large_sum, replicated=replicated)
    grads_finite = jnp.isfinite(sgrad_sq)
    outputs_finite = jnp.isfinite(loss32) & grads_finite
    grad_norm = jnp.where(grads_finite, jnp.sqrt(sgrad_sq) * inv_scale, jnp.inf)

    builtin = (
        probe_lib.stats(loss),
        # No headroom on the gradient probe: the scaled gradients live near the dtype's max by
        # design (dynamic loss scaling bounces off it), and the loss scale already handles that.
        probe_lib.scalar_stats(grad_norm, jnp.zeros([], jnp.float32), ~outputs_finite),
        state.update_stats,
    )
    own = zip(BUILTIN_PROBES, builtin, strict=True)
    blocks = [*probes, *(ProbeBlock((n,), v[None]) for n, v in own)]
    # Every probe's statistics in one array, for the detector and the metrics alike.
    probes = det_lib.stack_blocks(state.detector, blocks)
    # A non-finite value a model probe reads is a fault even when the loss and gradients stay
    # finite: a bf16 LayerNorm input past ~1e19 squares to an inf variance whose rsqrt is 0, so
    # the norm outputs zeros and only its probe saw the overflow. Tier 2 locates it.
    probes_bad = model_probes_nonfinite(probes)
    finite = outputs_finite & ~probes_bad
    # A NaN or +inf in the batch is data, not a fault. A -inf is the conventional mask fill
    # (an additive attention bias): data only when the loss or a probe went non-finite with it
    # (a mask the model could not take, or corrupted data), so a healthy masked batch trains,
    # scaled gradients that overflow are the loss scale's as in any batch, and a failing one
    # is blamed on the batch, never on an op. So is a finite value past 2**64
    # (``numerics.HUGE_DATA``, which squares past f32: newuser52's batch of 1e30 was blamed on
    # the first LayerNorm's square, which went to SAFE for it).
    polluted = batch_bad | ((batch_minus_inf | batch_huge) & (~jnp.isfinite(loss32) | probes_bad))
    # A finite loss whose scaled gradients overflow is the dynamic loss scale's business: skip
    # and back off. Only when that repeats (or the loss itself is bad) is it an incident.
    # After OVERFLOW_GRACE overflows in a row the first downshift also cuts the scale by
    # 1/256 (a loss scale far too large, e.g. 2**24 in fp16); only past twice that is it an
    # incident for tier 2.
    streak = guard_lib.skip_streak(state.opt_state)
    overflow = (
        ~polluted
        & jnp.isfinite(loss32)
        & ~grads_finite
        & ~probes_bad  # the forward never sees the scale: no scale cures what a probe read
        & (scale > cfg.loss_scale_min)
        & (streak < 2 * OVERFLOW_GRACE)
    )
    incident = ~finite & ~overflow & ~polluted
    downshift_now = incident | (overflow & (streak >= OVERFLOW_GRACE))
    lr = None
    if lr_schedule is not None:
        # The count the optimizer's schedule reads: ``state.step`` also counts skipped steps
        # (and MultiSteps' micro-steps), and drifted ahead of the rate really applied.
        count = guard_lib.schedule_count(state.opt_state)
        if count is None:
            count = state.step - guard_lib.skipped_of(state.opt_state)
        lr = lr_schedule(count)
    det, risk = det_lib.update(state.detector, probes, cfg, lr=lr)

    # A step skipped for gradients that overflowed is not calm, whatever its probes read: the
    # model did not train on it, so it never counts toward leaving STABLE.
    calm = risk.calm & finite

    def decide(nonfinite):
        return gear_lib.decide(gs, risk.risk, nonfinite, cfg, calm=calm, sites_fast=fast_only)

    decided = decide(downshift_now)

    # The SAFE learning-rate cut follows the gears this step ran with (so the last SAFE step
    # gets it too), per parameter: only the SAFE site's own parameters slow down. Nothing is
    # in SAFE when every gear is FAST: the FAST-only program compiles no per-leaf factor.
    if fast_only:
        factors = jax.tree_util.tree_map(lambda _: state.lr_scale, state.params)
    else:
        factors = jax.tree_util.tree_map(
            lambda f: f * state.lr_scale, lr_factors(state.params, gs, cfg.safe_lr_factor)
        )
    applied = finite & ~polluted
    # ``value``: the loss, for optimizers that read it (``optax.contrib.reduce_on_plateau``);
    # the others drop it (optax's extra-arguments convention).
    extra = dict(gear=decided, grad_norm=grad_norm, lr_factors=factors, value=loss32, **unscale)
    if guard_lib.is_guarded(state.opt_state):
        # The update is added to the parameters in the optimizer's own kernels (never an array
        # of its own) and kept or dropped below with the parameters; a skip's outcome differs
        # from the old state only in the guard's counters.
        new_params, new_opt, skipped_opt = guard_lib.update_outcomes(
            state.tx, sgrads, state.opt_state, state.params, **extra
        )
    else:
        new_params, new_opt = guard_lib.apply_update(
            state.tx, sgrads, state.opt_state, state.params, applied, **extra
        )
        skipped_opt = state.opt_state
    # Its norm is that of the change the update made, in f32, with one pass and no
    # overflow-safe rescale (``numerics.global_norm`` compiles a second pass per leaf for it):
    # an update whose norm passes ~1.8e19 reads as non-finite, a fault all the same.
    update_norm = jnp.where(
        applied,
        jnp.sqrt(
            numerics.sum_of_squares(
                new_params, minus=state.params, large_sum=large_sum, replicated=replicated
            )
        ),
        0.0,
    )
    # Finite gradients whose update is not finite (an optimizer fault: a moment that
    # underflowed, a 0/0 in a custom transform) are skipped like a NaN gradient, with the
    # optimizer state kept, and escalate like any other incident.
    # The model's own variables that are not parameters (BatchNorm's running statistics, a
    # user's monitor) are written by the forward pass, not by the update: a statistic that
    # overflows while the loss stays finite would otherwise be kept, and trained on, until the
    # next checkpoint refuses it. Such a step is skipped like a bad update, and tier 2 finds
    # the equation that made the value (this check observes it). The library's probes are not
    # checked, and a model with no such variable compiles no check at all.
    checked = numerics.floating_leaves(nnx.filter_state(new_rest, nnx.Not(Probe)))
    if checked:
        bad_rest = applied & ~numerics.all_finite(checked)
        bad_update = applied & (~jnp.isfinite(update_norm) | bad_rest)
    else:
        bad_rest = jnp.zeros([], bool)
        bad_update = applied & ~jnp.isfinite(update_norm)
    ok = applied & ~bad_update
    incident = incident | bad_update
    new_gs = numerics.select_tree(bad_update, decide(True), decided)
    new_gs = numerics.select_tree(polluted, gs, new_gs)  # data faults never move the gears
    # Parameters and optimizer state are kept by one ``cond``: the new ones only after an
    # applied, finite update; else the parameters as they were, with the skip's optimizer
    # state (the guard's counters moved) or, after a data fault or a bad update, the old one.
    # A select per leaf was a kernel per parameter, or grew the optimizer's kernels (each
    # parameter's recomputed the moments); the parameters alone in a cond of their own made
    # XLA copy every parameter ahead of it on every step (an entry parameter that a branch
    # may return); with the optimizer state, the copies are in the kept branch only.
    kept_opt = numerics.select_tree(polluted | bad_update, state.opt_state, skipped_opt)
    params, opt_state = jax.lax.cond(
        ~ok,
        lambda: (state.params, kept_opt),
        lambda: (new_params, new_opt),
    )
    # A cond for the same reason: the model's other variables (its probes among them), the
    # detector baselines and the update probe, kept without a select kernel per array.
    new_stats = probe_lib.scalar_stats(update_norm, jnp.zeros([], jnp.float32), ~ok)
    new_rest, det, update_stats = jax.lax.cond(
        ok,
        lambda: (new_rest, det, new_stats),
        lambda: (state.rest, state.detector, state.update_stats),
    )

    new_step = state.step + 1
    new_state = state.replace(
        params=params,
        rest=new_rest,
        opt_state=opt_state,
        gear=new_gs,
        detector=det,
        step=new_step,
        update_stats=update_stats,
    )
    metrics = {
        "step": state.step,
        "loss": loss32,
        "risk": risk.risk,
        "gear": gs.level,
        "next_gear": new_gs.level,
        "loss_scale": scale,
        "grad_norm": grad_norm,
        "nonfinite": risk.nonfinite + (~finite).astype(jnp.float32),
        "finite": finite,
        "overflow": overflow,
        "incident": incident,
        "polluted": polluted,
        "bad_update": bad_update,
        "bad_rest": bad_rest,
        "skipped": ~ok,
        "calm": risk.calm,
        "probes": probes,
        "probe_risk": probe_lib.NamedValues(det.names, risk.per_probe),
        # Every site's effective gear as one vector (a ``gear.SiteValues``, one output, not
        # one per site); with every gear FAST (the FAST-only program) it is its own.
        "site_gears": gs.sites
        if fast_only
        else gs.sites.with_flat(jnp.maximum(gs.level, gs.sites.flat).astype(jnp.int32)),
        # Read by ``make_train_step`` to pick the next step's program without reading the gears.
        "next_all_fast": ~gear_lib.any_below_fast(new_gs),
    }
    if has_aux:
        metrics["aux"] = aux
    return new_state, metrics


def model_probes_nonfinite(probes: probe_lib.NamedValues) -> jax.Array:
    """bool[]: some probe of the model (not the step's own ``BUILTIN_PROBES``) read a NaN or
    a ``+inf`` (``probe.rows_finite``; a ``-inf`` mask fill is neither).

    Args:
      probes: the step's stacked probes (``detector.stack_blocks``), the model's rows first,
        then ``BUILTIN_PROBES``.

    Returns:
      bool[], one reduction over the stack's model rows.
    """
    rows = len(probes.names) - len(BUILTIN_PROBES)
    if not rows:
        return jnp.zeros([], bool)
    return ~jnp.all(probe_lib.rows_finite(probes.values[:rows]))


def state_is_finite(state: TrainState) -> jax.Array:
    """bool[]: parameters, optimizer state, the model's other variables and the detector
    baselines are all finite (what a checkpoint must be)."""
    return numerics.all_finite(
        (state.params, state.opt_state, state.rest, state.detector, state.update_stats)
    )


def _unalias(state: TrainState) -> TrainState:
    """``state`` with no array object in two leaves (``create`` shares its zero scalars), so
    that every leaf can be donated: XLA refuses to donate one buffer twice."""
    seen: set[int] = set()

    def one(x):
        if isinstance(x, jax.Array) and id(x) in seen:
            return jax.device_put(x, x.sharding, may_alias=False)
        seen.add(id(x))
        return x

    return jax.tree_util.tree_map(one, state)


def committed(state: TrainState) -> TrainState:
    """``state`` with every array committed to the device it is on (a no-op for those that are).

    A jitted function's compiled program is keyed on whether each argument is committed to a
    device, not only on shapes: a state restored from a checkpoint holds committed arrays, a
    fresh one and anything the host sets (``gear.set_site`` after a located fault, a new
    learning-rate scale) uncommitted ones, and each mix of the two compiled the whole step
    again. The single-device step commits every state it did not return itself, so a
    program compiles once per run and a restarted run asks the persistent compilation cache
    for the same one (``nan2safe_jax.compile_cache``).

    Args:
      state: a ``TrainState`` (any pytree).

    Returns:
      The same tree, every ``jax.Array`` leaf committed (its buffer reused, not copied).
    """

    def one(x):
        if isinstance(x, jax.Array) and not x.committed:
            return jax.device_put(x, x.sharding)
        return x

    return jax.tree_util.tree_map(one, state)


def make_train_step(
    loss_fn: Callable,
    *,
    lr_schedule: Callable | None = None,
    jit: bool = True,
    donate: bool = False,
    mesh: Any = None,
    rules: Any = None,
    has_aux: bool = False,
    fast_program: bool = True,
) -> Callable:
    """The jitted ``(state, batch) -> (state, metrics)`` step.

    Gears are values in ``state.gear``: changing them (by the detector, by ``gear.set_level`` /
    ``gear.set_site``, or by the trainer) never retraces or recompiles the program that runs.
    With ``fast_program`` the step is compiled twice, a FAST-only program for states whose
    gears are all FAST and the general one for any gear; the one not needed first compiles in
    a background thread (``nan2safe_jax.programs``), and so does, for each new set of sites in
    SAFE, a partial program that the steps take over from the general one once it is ready.

    Args:
      loss_fn: ``loss_fn(model, batch) -> scalar``; ``model`` is the ``nnx.Module``.
      lr_schedule: the optimizer's schedule ``step -> lr``, for the detector's cool-down after a
        learning-rate jump (optional). It is called with the count the optimizer's own schedule
        reads (``nan2safe.optax.schedule_count``: skipped steps and ``optax.MultiSteps``
        micro-steps do not advance it), or, for an optimizer without a schedule state, the
        steps the guard did not skip.
      jit: compile the step (default). The compiled step runs on the host (it commits the
        state and picks a program), so ``jax.jit`` cannot trace it (a ``TypeError`` says so):
        False gives the bare step function, run eagerly (for debugging) or jitted by you, e.g.
        ``jax.jit(make_train_step(loss_fn, jit=False), donate_argnums=0)``.
      donate: donate the old state's buffers to the new one. A state fresh from
        ``TrainState.create(model, ...)`` shares its arrays with ``model`` (the graph is
        copied, not the arrays): the first donated step deletes ``model``'s parameters too.
      mesh: a ``jax.sharding.Mesh``; alone it means ``nan2safe.sharding.data_parallel(mesh)``.
      rules: ``nan2safe.sharding.data_parallel(...)`` or ``fsdp(...)``. With a mesh or rules the
        step places the state and the batch on the mesh (a no-op when they already are) and is
        jitted with those ``in_shardings``/``out_shardings``; metrics come out replicated. Every
        statistic is a reduction over the global arrays inside the one SPMD program, so each
        device holds the same risk and next gear (see ``nan2safe_jax.sharding``).
      has_aux: ``loss_fn`` returns ``(loss, aux)``; ``aux`` comes back as ``metrics["aux"]``.
        Without it a tuple from ``loss_fn`` is a ``ValueError`` that says so.
      fast_program: run all-FAST states with the FAST-only program (default). It costs one bool
        read per step (the previous step's ``metrics["next_all_fast"]``); False keeps the one
        general program and fully asynchronous dispatch.

    Returns:
      ``step(state, batch)``. Its metrics hold ``loss``, ``risk``, ``gear`` (the level this step
      ran with), ``loss_scale``, ``grad_norm``, ``nonfinite``, ``skipped``, ``probes`` and
      ``probe_risk`` (each a ``probe.NamedValues``, one array read as a mapping: probe ->
      ``f32[NUM_STATS]`` statistics, in the detector's order; probe -> risk),
      ``site_gears`` and ``next_all_fast`` (the next step's program); the flags ``finite``
      (the loss, the gradients and every probe of the model finite: a norm whose variance
      overflowed outputs finite zeros, and only its probe reads the inf),
      ``overflow``, ``incident`` (a non-finite step the model made: tier 2's case),
      ``polluted`` (a NaN or ``+inf`` in the batch, or a ``-inf`` or a value past 2**64
      there with a non-finite loss or probe; a healthy step trains on either), ``bad_update``,
      ``bad_rest`` and ``next_gear``. A skipped step's ``loss`` is what it computed (NaN or
      inf, or finite when only a probe read a non-finite value): a loop of your own
      averages the losses of the steps with ``skipped`` False. The step does not undo a
      downshift that a data fault it cannot see as data caused (an empty mask's 0/0, a token
      past the vocabulary): the ``Trainer``'s tier 2 does.
      ``step.jitted`` is the general step jitted without shardings and ``step.jitted_fast``
      the FAST-only one (what ``replay.locate_step`` traces; give it arguments gathered with
      ``nan2safe.sharding.to_local``); ``step.rules`` the rules; ``step.programs`` the
      ``StepPrograms`` in use; ``step.wait_compiled()`` blocks until background compiles are
      done. A state's finiteness before a checkpoint is ``checkpoint.state_is_finite``'s to
      check (the step computes no ``state_finite``).
    """
    rules = sharding_lib.resolve(mesh, rules)
    fn = functools.partial(train_step, loss_fn=loss_fn, lr_schedule=lr_schedule, has_aux=has_aux)
    fast_fn = functools.partial(fn, fast_only=True)
    donate_argnums = (0,) if donate else ()
    compiled = jax.jit(fn, donate_argnums=donate_argnums) if jit else fn
    compiled_fast = jax.jit(fast_fn, donate_argnums=donate_argnums) if jit else fast_fn
    programs: list[StepPrograms] = []

    def partial_programs(base: Callable, **kw) -> Callable:
        """``sites -> `` the partial program (``base(fast_sites=sites)``) jitted with ``kw``."""
        return lambda sites: jax.jit(functools.partial(base, fast_sites=sites), **kw)

    def with_fast_program(general: Callable, fast: Callable, partial: Callable) -> Callable:
        if not (jit and fast_program):
            return general
        programs.append(StepPrograms(fast, general, partial=partial))
        return programs[-1]

    run = with_fast_program(
        compiled, compiled_fast, partial_programs(fn, donate_argnums=donate_argnums)
    )
    checked: dict[tuple, tuple] = {}
    sharded: dict[tuple, Callable] = {}
    last_out = [lambda: None]  # the state this step returned last (a weak reference)

    def returned_last(state) -> bool:
        """``state`` is the one this step returned last: on the mesh, committed."""
        return state is last_out[0]()

    def remember(state) -> None:
        last_out[0] = weakref.ref(state)

    def run_sharded(state, batch):
        if not returned_last(state):
            if donate:
                state = _unalias(state)
            state = sharding_lib.shard_state(state, rules)
        batch = sharding_lib.shard_batch(batch, rules)
        key = (
            jax.tree_util.tree_structure(state),
            jax.tree_util.tree_structure(batch),
            tuple(jnp.shape(x) for x in jax.tree_util.tree_leaves(batch)),
        )
        f = sharded.get(key)
        if f is None:
            state_sh = sharding_lib.state_shardings(state, rules)
            batch_sh = sharding_lib.batch_shardings(batch, rules)
            kw = dict(
                in_shardings=(state_sh, batch_sh),
                out_shardings=(state_sh, rules.replicated),
                donate_argnums=donate_argnums,
            )
            part = functools.partial(
                fn, partitioned=True, large_sum=rules.sum_of_squares, replicated=rules.replicates
            )
            f = sharded[key] = with_fast_program(
                jax.jit(part, **kw),
                jax.jit(functools.partial(part, fast_only=True), **kw),
                partial_programs(part, **kw),
            )
        new_state, metrics = f(state, batch)
        remember(new_state)
        return new_state, metrics

    def probe_names(state, batch):
        seen = []

        # The batch's arrays are arguments, as in the step: closed over, a NumPy leaf is a
        # constant of the trace, which a site's ``custom_vjp`` under ``vmap`` refuses. Its
        # other leaves (a Python bool the loss branches on) stay as they are, as in an eager
        # step (``jit=False``).
        leaves, treedef = jax.tree_util.tree_flatten(batch)
        is_array = [isinstance(x, (np.ndarray, np.generic, jax.Array)) for x in leaves]

        def trace(params, site, arrays):
            given = iter(arrays)
            full = [next(given) if a else x for x, a in zip(leaves, is_array, strict=True)]
            batch = jax.tree_util.tree_unflatten(treedef, full)
            _, blocks, _, _ = _forward(state, site, params, batch, loss_fn, has_aux)
            seen.append(tuple(n for b in blocks for n in b.names))
            return 0

        arrays = [x for x, a in zip(leaves, is_array, strict=True) if a]
        jax.eval_shape(trace, state.params, _site_state(state), arrays)
        return seen[0] + BUILTIN_PROBES

    def step(state: TrainState, batch):
        # A traced state is never the one returned last: the state's leaves are read only
        # when it is new (a step's hot path skips them), the batch's every time.
        fresh = () if returned_last(state) else jax.tree_util.tree_leaves(state)
        traced = [*fresh, *jax.tree_util.tree_leaves(batch)]
        if jit and any(isinstance(x, jax.core.Tracer) for x in traced):
            raise TypeError(
                "make_train_step: the step runs on the host (it commits the state and picks a "
                "compiled program) and cannot be traced by jax.jit / vmap / grad: pass "
                "donate=True for donation, or build it with jit=False and jit that yourself"
            )
        key = (state.detector.names, jax.tree_util.tree_structure(batch))
        if key not in checked:
            checked[key] = probe_names(state, batch)
        names = checked[key]
        checked.setdefault((names, key[1]), names)
        if names != state.detector.names:
            state = state.with_probes(names)
        if rules is not None and jit:
            return run_sharded(state, batch)
        if jit and not returned_last(state):
            state = committed(_unalias(state) if donate else state)
        new_state, metrics = run(state, batch)
        remember(new_state)
        return new_state, metrics

    def wait_compiled() -> None:
        for p in programs:
            p.wait()

    known: dict[tuple, Callable] = {}

    def jitted_known(gears: tuple[tuple[str, int], ...]) -> Callable | None:
        """The step jitted for a state whose site gears are ``gears`` (``programs.known_gears``):
        what tier 2 replays for a state that is not all FAST (one per gear set, kept). None
        once ``programs.MAX_KNOWN`` other gear sets have one: each is a program of its own,
        whose replays compile cold, while the general program's stay compiled for every gear
        set after its first (``programs.replay_programs`` then replays that one)."""
        if gears not in known:
            if len(known) >= MAX_KNOWN:
                return None
            known[gears] = jax.jit(functools.partial(fn, known_gears=gears)) if jit else fn
        return known[gears]

    step.jitted = compiled
    step.jitted_fast = compiled_fast
    step.jitted_known = jitted_known
    step.programs = programs  # the StepPrograms made so far (one per sharding layout)
    step.rules = rules
    step.wait_compiled = wait_compiled
    return step
