"""Tier 2 on the host: from a failing step's inputs to a decision.

``decide`` is a function of the step that failed (the state before it, its batch, the state the
step returned and its host metrics): it returns a ``Decision`` holding one ``replay.Report``
whatever the outcome, the gears to train on from now, and whether the Trainer must roll back to
its newest finite checkpoint. It writes nothing and keeps no state; the Trainer logs and acts
(docs/design.md, "Tier 2").

Outcomes (``Decision.kind``):
  - ``"polluted_input"``: the batch holds a NaN, a ``+inf``, a ``-inf`` or a finite value
    past 2**64 with a non-finite loss or probe (a healthy step trains on either; ``-inf`` is
    a mask fill) or an out-of-range label. The
    step was skipped on device; nothing in the model is at risk, so no gear changes.
  - ``"damaged"``: the state the step started from holds a non-finite value (a flipped bit, a
    poisoned statistic). Training on it is pointless: roll back.
  - ``"located"``: the replay found the culprit equation; its site goes to SAFE and training
    carries on from the skipped step. A culprit in no site (code of the user's own modules, a
    flax layer ``nan2safe.nn.convert`` left alone) is out of every gear's reach: the decision
    says so in ``hint`` (with the nearest site and the fix: ``nan2safe.nn.Site`` or
    ``convert``) and falls back to the whole model in SAFE, which only lowers the learning rate
    and changes the sites' arithmetic, never the culprit's.
  - ``"repeat"``: the culprit's site already ran in SAFE and failed again: SAFE cannot save this
    state, so roll back with the site in SAFE for a longer stay. For a culprit in no site the
    ``action`` says that the gears cannot fix it: the one rollback only rules out a damaged
    state (the Trainer skips a batch that fails again on its replay, so it never loops).
  - ``"transient"``: the deterministic replay stayed finite (suspect hardware or
    non-determinism); the step was skipped, nothing else changes.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from nan2safe_jax import gear as gear_lib
from nan2safe_jax.config import Config
from nan2safe_jax.gear import Gear, GearState
from nan2safe_jax.numerics import (
    _is_key,
    device_view,
    first_huge,
    first_nonfinite,
    huge_values,
)
from nan2safe_jax.replay import _jax_compat as jc
from nan2safe_jax.replay import magnitude
from nan2safe_jax.replay.locate import locate_replayed
from nan2safe_jax.replay.nearest import nearest_site
from nan2safe_jax.replay.report import Report, array_stats, channel_scan
from nan2safe_jax.site import layer_name, param_name

log = logging.getLogger(__name__)

KINDS = ("polluted_input", "damaged", "located", "repeat", "transient")


@dataclasses.dataclass(frozen=True)
class Decision:
    """What tier 2 concluded about one failing step.

    Attributes:
      kind: one of ``KINDS``.
      report: the ``replay.Report`` behind the decision (every outcome has one).
      gear: the gears to train on from now; None keeps the ones the step produced.
      restore: roll back to the newest finite checkpoint and replay from it.
      action: the decision in words (for the event log).
      enter: fields of the ``safe_enter`` event when a site (or the model) entered SAFE;
        ``"also"``: the fields of a second one, for the site that made the culprit's
        near-overflow input (``Report.magnitude``).
      revert: the step treated the fault as the model's (gears down, loss scale cut) but it
        was the data's: go back to the gears and optimizer state the step started from.
      hint: set when the culprit is in no site: that fact, the nearest site, and the fix.
    """

    kind: str
    report: Report
    gear: GearState | None = None
    restore: bool = False
    action: str = ""
    enter: dict[str, Any] | None = None
    revert: bool = False
    hint: str | None = None


def polluted_report(batch) -> Report:
    """The ``"polluted input"`` report of a batch: the first bad leaf and its bad rows.

    Args:
      batch: the host (or gathered) batch.

    Returns:
      A ``Report`` with ``diagnosis == "polluted input"``; ``channels[0]`` lists the bad rows.

    Raises:
      ValueError: the batch holds no NaN, no inf and no value past ``numerics.HUGE_DATA``.

    A leaf holding a NaN or ``+inf`` comes first, and only those values are counted (a ``-inf``
    mask beside them is no fault); then one holding a finite value past ``numerics.HUGE_DATA``
    that is no mask fill (its ``kind`` is ``"huge"``), then a ``-inf``: the last two are named
    when the loss or a probe went non-finite with them (the train step's ``polluted``).
    """
    where, kind = first_nonfinite(batch, minus_inf=False), "nonfinite"
    if where is None:
        where, kind = first_huge(batch), "huge"
    if where is None:
        where, kind = first_nonfinite(batch), "minus_inf"
    if where is None:
        raise ValueError("polluted_report: the batch is finite")
    leaf = _leaf_at(batch, where)
    a = np.asarray(leaf, np.float64)
    if kind == "huge":
        bad = huge_values(device_view(np.asarray(leaf)))
    else:
        bad = ~np.isfinite(a) if kind == "minus_inf" else np.isnan(a) | np.isposinf(a)
    chans, cut = channel_scan(np.where(bad, np.nan, 0.0))
    what = {
        "minus_inf": "-inf value(s), and the loss went non-finite with them (a mask fill the "
        "model could not take, e.g. a fully masked row, or corrupted data)",
        "huge": f"finite value(s) of magnitude 2**64 (~1.8e19) or more (max |x| "
        f"{float(np.max(np.abs(a[bad]))):.3g}), and the loss or a probe went non-finite with "
        "them: they square past float32 (a norm's variance, a sum of squares), corrupted data",
        "nonfinite": "NaN / +inf value(s)",
    }[kind]
    return Report.no_equation(
        kind="huge" if kind == "huge" else "nan" if np.isnan(a).any() else "inf",
        inputs=[array_stats(leaf)],
        channels=chans,
        channels_truncated=cut,
        diagnosis="polluted input",
        explanation=(
            f"batch leaf {where} holds {int(bad.sum())} {what} in rows "
            f"{chans.get(0, [])[:16]}: the data, not the model"
        ),
        replays=0,
        seconds=0.0,
        input_path=where,
        output_shape=tuple(np.shape(leaf)),
    )


def gathered_size(operand_shape, output_shape) -> int:
    """The size of the axis a gather indexes: the one operand axis whose size the output does
    not keep (an embedding table ``[V, D]`` gives ``[..., D]``: ``V``; logits ``[B, T, C]``
    taken along their last axis give ``[B, T]``: ``C``); the last axis when that is ambiguous
    (equal sizes)."""
    left = list(output_shape or ())
    gone = []
    for n in operand_shape:
        if n in left:
            left.remove(n)
        else:
            gone.append(n)
    return gone[0] if len(set(gone)) == 1 else operand_shape[-1]


def out_of_range_labels(batch, size: int, indices=None) -> tuple[str, list[int]] | None:
    """The integer batch leaf holding values outside ``[0, size)``, and its bad rows.

    Args:
      batch: the host batch.
      size: the size of the axis the failing gather indexes.
      indices: the gather's index operand statistics (``min`` / ``max``, from the report), if
        known: the leaf that holds the index's out-of-range extreme is the one the gather read
        (labels with ``-100`` a mask leaves out sat beside the tokens of a Llama-style batch,
        and were named, every row, for a token id past the vocabulary). Without a match, or
        without ``indices``, the first leaf with values out of range.

    Returns:
      ``(key path, rows)`` or None.
    """
    lo = None if indices is None else indices.get("min")
    hi = None if indices is None else indices.get("max")
    extremes = [v for v in (lo, hi) if v is not None and not 0 <= v < size]
    first = None
    for path, leaf in jax.tree_util.tree_flatten_with_path(batch)[0]:
        if _is_key(leaf):
            continue  # a PRNG key: no labels, and NumPy cannot hold it
        a = np.asarray(leaf)
        if a.dtype.kind not in "iu" or a.ndim == 0:
            continue
        bad = (a < 0) | (a >= size)
        if not bad.any():
            continue
        rows = np.nonzero(bad.reshape(a.shape[0], -1).any(axis=1))[0]
        found = (jax.tree_util.keystr(path), [int(r) for r in rows])
        if any(np.any(a == v) for v in extremes):
            return found
        first = first or found
    return first


def _leaf_report(batch, where: str, kind: str, rows: list[int], explanation: str) -> Report:
    """A ``"polluted input"`` report of batch leaf ``where`` (no equation blamed)."""
    leaf = _leaf_at(batch, where)
    return Report.no_equation(
        kind=kind,
        inputs=[array_stats(leaf)],
        channels={0: rows} if rows else {},
        diagnosis="polluted input",
        explanation=explanation,
        replays=0,
        seconds=0.0,
        input_path=where,
        output_shape=tuple(np.shape(leaf)),
    )


def label_report(batch, where: str, rows: list[int], size: int) -> Report:
    """The ``"polluted input"`` report of integer labels outside ``[0, size)``."""
    return _leaf_report(
        batch,
        where,
        "label",
        rows,
        f"batch leaf {where} holds integer labels outside [0, {size}) in rows {rows[:16]}: "
        "the gather over them filled NaN (data, not model)",
    )


def empty_batch(batch) -> str | None:
    """The first array leaf of ``batch`` when every one has 0 rows (an empty batch: a mean over
    it is 0/0, the data's fault, not an op's), else None. PRNG keys and scalars are not rows."""
    first, leaves = None, jax.tree_util.tree_flatten_with_path(batch)[0]
    for path, leaf in leaves:
        if _is_key(leaf) or np.ndim(leaf) == 0:
            continue
        if np.shape(leaf)[0] != 0:
            return None
        first = first or jax.tree_util.keystr(path)
    return first


def empty_report(batch, where: str) -> Report:
    """The ``"polluted input"`` report of a batch with no rows."""
    shape = tuple(np.shape(_leaf_at(batch, where)))
    return _leaf_report(
        batch,
        where,
        "empty",
        [],
        f"the batch has no rows (batch leaf {where} has shape {shape}, and every other leaf 0 "
        "rows too): a mean over it is 0/0 (data, not model)",
    )


def damaged_report(state) -> Report:
    """The report of a state that already holds a non-finite value before the step runs."""
    where = first_nonfinite(state)
    leaf = _leaf_at(state, where) if where is not None else None
    a = None if leaf is None else np.asarray(leaf)
    wide = None if a is None else a.astype(np.complex128 if np.iscomplexobj(a) else np.float64)
    nan = wide is not None and bool(np.isnan(wide).any())
    return Report.no_equation(
        kind="nan" if nan or leaf is None else "inf",
        inputs=[] if leaf is None else [array_stats(leaf)],
        channels={},
        diagnosis="damaged state",
        explanation=(
            f"the training state holds a non-finite value at {where} before the step runs: "
            "a damaged state (bit flip, poisoned statistic); roll back to a finite checkpoint"
        ),
        replays=0,
        seconds=0.0,
        input_path=None if where is None else "state" + where,
    )


def decide(step_fn, before, batch, after, metrics: dict, cfg: Config) -> Decision:
    """Tier 2: classifies the failing step and decides what to do.

    Args:
      step_fn: the ``make_train_step`` step (tier 2 replays the programs
        ``programs.replay_programs`` gives for ``before``), or a jitted step without shardings
        (``make_train_step(...).jitted``: that program is replayed).
      before: the state the failing step started from (whole arrays: gather it under sharding).
      batch: its batch (whole arrays).
      after: the state the step returned (its gears are the base of the new ones).
      metrics: the step's host metrics (``polluted``: the step saw a non-finite batch).
      cfg: thresholds (SAFE stays).

    Returns:
      A ``Decision``.
    """
    if metrics.get("polluted"):
        report = polluted_report(batch)
        return Decision("polluted_input", report, action="skipped the batch (data, not model)")
    if first_nonfinite(before) is not None:
        return Decision(
            "damaged",
            damaged_report(before),
            restore=True,
            action="the state is damaged: roll back to the newest finite checkpoint",
        )
    empty = empty_batch(batch)
    if empty is not None:
        return Decision(
            "polluted_input",
            empty_report(batch, empty),
            action="skipped the batch: it holds no rows (data, not model)",
            revert=True,
        )
    report, step_fn = locate_replayed(step_fn, before, batch)
    if not report.reproducible:
        return Decision("transient", report, action="replay stayed finite: step skipped")
    if report.primitive is None:  # an argument was non-finite after all (e.g. an aux input)
        return Decision("polluted_input", report, action="skipped the batch (data, not model)")
    if report.primitive == "gather" and report.inputs:
        # A gather only copies values: NaN from finite inputs is its out-of-bounds fill, e.g.
        # a cross-entropy's take_along_axis over labels outside [0, vocab), or an embedding
        # lookup of a token outside [0, vocab).
        size = gathered_size(report.inputs[0]["shape"], report.output_shape)
        indices = report.inputs[1] if len(report.inputs) > 1 else None
        bad = out_of_range_labels(batch, size, indices)
        if bad is not None:
            return Decision(
                "polluted_input",
                label_report(batch, *bad, size),
                action="skipped the batch: integer labels out of range (data, not model)",
                revert=True,
            )
    nearest = None
    if in_step_bookkeeping(report):
        nearest = largest_weights(before.params)
    elif report.site is None or report.site not in after.gear.sites:
        try:
            nearest = nearest_site(step_fn, (before, batch), report.eqn_path, after.gear.sites)
        except Exception as err:  # noqa: BLE001 - a hint must never stop tier 2
            log.debug("nearest site not found: %s", err)
    return _downshift(report, before.gear, after.gear, cfg, nearest=nearest)


def largest_weights(params, k: int = 3) -> str | None:
    """The ``k`` parameters with the largest magnitude, as ``"path (max |w|)"``, largest first.

    What the hint of a culprit in the step's own sum of squares names: gradients past ~1e19
    come from the loss or from weights that large, and the sum of squares reads every
    gradient at once (a flat vector: the report names no leaf of it). One host pass over the
    parameters, at an incident only.

    Args:
      params: the state's parameters (whole arrays).
      k: how many to name.

    Returns:
      ``"head.kernel (1e+30), blocks.0.up.kernel (0.56), ..."``, or None when no leaf can be
      read.
    """
    sizes = []
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        try:
            a = np.asarray(leaf)
        except Exception:  # noqa: BLE001 - a leaf this process cannot read names nothing
            continue
        if a.size and jnp.issubdtype(a.dtype, jnp.inexact):  # bfloat16 and float8 too
            sizes.append((float(np.max(np.abs(a.astype(np.float32)))), param_name(path)))
    sizes.sort(key=lambda t: -t[0] if np.isfinite(t[0]) else -np.inf)
    return ", ".join(f"{name} ({v:.3g})" for v, name in sizes[:k]) or None


# The train step's own bookkeeping (norms, loss scale, detector, gears): a culprit there was
# made from finite model values, by a sum or a norm that passes f32's range.
_STEP_FILES = ("numerics.py", "train.py", "optax.py", "detector.py", "probe.py", "gear.py")
_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep
_SQRT_F32_MAX = float(np.sqrt(np.finfo(np.float32).max))  # ~1.8e19


def _narrow(dtype) -> bool:
    """A float whose range is narrower than bfloat16's and f32's (float16, the float8s)."""
    if not jax.numpy.issubdtype(dtype, jax.numpy.floating):  # (a PRNG key's dtype too)
        return False
    return float(jax.numpy.finfo(dtype).max) < 1e38


def holds_narrow_float(jaxpr) -> bool:
    """Whether any value of ``jaxpr`` (its inputs, every equation's outputs, in every nested
    jaxpr) is a float16 or float8: the only dtypes whose gradients a loss scale keeps in range
    (bfloat16 and f32 reach ~3.4e38)."""
    stack, seen = [getattr(jaxpr, "jaxpr", jaxpr)], set()
    while stack:
        j = stack.pop()
        if id(j) in seen:
            continue
        seen.add(id(j))
        if any(_narrow(v.aval.dtype) for v in j.invars if hasattr(v.aval, "dtype")):
            return True
        for eqn in j.eqns:
            if any(_narrow(v.aval.dtype) for v in eqn.outvars if hasattr(v.aval, "dtype")):
                return True
            stack.extend(jc.sub_jaxprs(eqn))
    return False


def loss_scale_matters(step_fn, before, batch) -> bool:
    """Whether the step computes any value in float16 or float8 (one trace, nothing run).

    The train step takes a finite loss with non-finite gradients for the dynamic loss scale's
    overflow: it halves the scale and skips, and only the 17th in a row is an incident. Where
    no value is narrower than bfloat16 (an f32 or bf16 model), no scale keeps a gradient in
    range that does not fit unscaled: such a step is a fault (a ``0/0`` in a backward rule, a
    zero-variance norm whose NaN the compiled forward dropped), and tier 2 is due at once.

    Args:
      step_fn: the program that ran the step (``programs.program_for``).
      before, batch: its arguments (only their shapes and dtypes are read).

    Returns:
      True when the loss scale can matter, and when the step cannot be traced (the step's own
      rule then stands).
    """
    try:
        return holds_narrow_float(jax.make_jaxpr(step_fn)(before, batch))
    except Exception as err:  # noqa: BLE001 - a check that fails keeps the step's verdict
        log.debug("loss_scale_matters: trace failed: %s", err)
        return True


def in_step_bookkeeping(report: Report) -> bool:
    """Whether the culprit is an equation of the train step's own bookkeeping (not a site's)."""
    path = (report.source or "").rsplit(":", 1)[0]
    return path.startswith(_PACKAGE) and os.path.basename(path) in _STEP_FILES


def no_scale_cures(report: Report, scale: float, scale_min: float) -> bool:
    """Whether the step's own sum of squares that ``report`` names overflows at every loss scale.

    Only a ``square`` says so: it read the scaled gradients, and brought down to
    ``scale_min`` the largest of them still squares past f32's range (past ~1.8e19), so
    halving the scale is no cure. A ``reduce_sum`` or ``add`` of the squares (the norm past
    f32 before any one gradient is) is what halving does cure. A weight
    grown ×1e15 gives gradients of ~1e30: before, a bf16 or f32 model skipped 16 steps as the
    scale's overflow, halving it each time, and a checkpoint written among them kept the
    damage (newuser46).

    Args:
      report: a report that ``in_step_bookkeeping`` holds.
      scale: the loss scale the step ran with.
      scale_min: ``Config.loss_scale_min``.
    """
    if report.primitive != "square":  # a sum of squares past f32 is what halving cures
        return False
    return _largest_input(report) / max(scale, 1e-30) * scale_min > _SQRT_F32_MAX


def _largest_input(report: Report) -> float:
    """The largest finite magnitude among the culprit's inputs (0 when none was recorded)."""
    return max((s.get("max_abs") or 0.0 for s in report.inputs), default=0.0)


def unsited_hint(report: Report, sites, nearest: str | None = None) -> str:
    """Says plainly that the culprit is in no site, where it is, and how to make it one.

    Args:
      report: the tier-2 report (its culprit is in no site).
      sites: the model's site names.
      nearest: the site nearest to the culprit in program order (``replay.nearest_site``);
        for a culprit in the step's own bookkeeping, the largest weights (``largest_weights``).
    """
    if in_step_bookkeeping(report):
        big = _largest_input(report)
        return (
            f"the culprit `{report.primitive}` at {report.source} is the train step's own "
            f"bookkeeping (its f32 sum of squares of the gradients or of the update): every "
            f"value the model computed is finite, but its inputs reach {big:.3g} and square "
            "past f32's range (a norm past ~1.8e19). Gradients that large come from the loss "
            "or from a layer's weights, not from an op a gear can change: look at the loss and "
            "the largest weights" + ("" if nearest is None else f" (the largest: {nearest})")
        )
    where = report.user_source or report.source or "an unknown line"
    scope = "" if report.site is None else f" (its scope names {report.site!r}, no site's gear)"
    text = (
        f"the culprit `{report.primitive}` ({report.direction}) at {where} is outside every "
        f"site{scope}: no gear reaches it"
    )
    if not sites:
        return text + (
            " (the model has no sites at all). To make it downshiftable, run "
            "nan2safe.nn.convert(model) if it is a flax layer convert has a site for (Linear, "
            "LinearGeneral, Conv, Embed, LayerNorm, RMSNorm, BatchNorm, MultiHeadAttention; its "
            "report lists the layers it left alone, e.g. nnx.ConvTranspose), or wrap that code in "
            "nan2safe.nn.Site(fast, safe=...)"
        )
    if nearest is not None:
        text += f"; the nearest site is {nearest!r}"
    # The model has sites (it was converted, or has sites of its own): what is left is a
    # layer convert has no site for, or the user's own code.
    return text + (
        ". To make it downshiftable, wrap that code in nan2safe.nn.Site(fast, safe=...) (a flax "
        "layer with no nan2safe.nn counterpart, e.g. nnx.ConvTranspose or nnx.Dropout, is listed "
        "as left alone in nan2safe.nn.convert's report)"
    )


def downshift_in_place(report: Report, ran: GearState, gs: GearState, cfg: Config) -> Decision:
    """The gear decision for ``report`` as if its near-overflow input did not come from a
    parameter of the state: SAFE for the culprit's site (and the site that made its input),
    the whole model for an unsited culprit. For a weight no rollback can remove (every
    checkpoint kept holds it, ``Trainer``): SAFE's f32 arithmetic, saturated back, may still
    carry the run (a dense layer's fp16 output past 65504 from a kernel grown too large)."""
    return _downshift(report, ran, gs, cfg, roll_back_huge=False)


def _downshift(
    report: Report,
    ran: GearState,
    gs: GearState,
    cfg: Config,
    nearest: str | None = None,
    roll_back_huge: bool = True,
) -> Decision:
    """SAFE for the culprit's site; a repeat in SAFE means roll back. A culprit in no site:
    the whole model in SAFE, said plainly to be a fallback that cannot fix it.

    A culprit whose input was already near overflow (``Report.magnitude``) made by an equation
    of another site: that site goes to SAFE too (alone, when the culprit is in no site), since
    any arithmetic on such a value overflows and SAFE at the culprit alone does not stop it
    (newuser48: a router weight x1e38 blamed on the next LayerNorm). One that comes from a
    parameter of the state: a rollback alone, at the checkpoint's gears."""
    huge = _huge_parameter(report) if roll_back_huge else None
    if huge is not None:
        # The rollback removes the cause; no site's gear would (newuser49: the whole model
        # went to SAFE for an unsited culprit, and stayed at STABLE after, and the hint said
        # to wrap gelu in a Site).
        action = (
            f"its near-overflow input comes from the parameter {huge}: a weight that large is "
            "damage no gear undoes (a bad update): roll back to the newest finite checkpoint, "
            "at its gears"
        )
        return Decision("located", report, None, True, action)
    site = report.site
    made = _origin_site(report, gs)
    hint = None
    made_in_safe = made is not None and bool(np.max(gear_lib.effective(ran, made)) >= Gear.SAFE)
    if site is None or site not in gs.sites:
        hint = unsited_hint(report, gs.sites, nearest)
        if made is not None and not made_in_safe:
            # the maker alone (one already in SAFE saturated its output there: the fallback's)
            site, made = made, None
    elif made == site:
        made = None
    if site is None or site not in gs.sites:
        repeat = int(ran.level) >= Gear.SAFE
        new = gear_lib.set_level(gs, Gear.SAFE, cfg)
        enter = dict(site=None, steps=cfg.safe_max_steps, scope="global", fallback=True)
        if repeat:
            action = (
                f"{hint}. It failed again with the whole model in SAFE: the gears cannot fix "
                "it. Rolling back once, to rule out a damaged state; if the batch fails again "
                "on the replay it is skipped"
            )
        else:
            action = (
                f"{hint}. Fallback: whole model -> SAFE for {cfg.safe_max_steps} steps (every "
                f"site in SAFE, learning rate x{cfg.safe_lr_factor}); that cannot change the "
                "culprit's own arithmetic"
            )
        kind = "repeat" if repeat else "located"
        return Decision(kind, report, new, repeat, action, enter, hint=hint)
    index = None
    shape = gs.sites[site].shape
    iters = [p[1] for p in report.eqn_path if isinstance(p, tuple) and p[0] == "iter"]
    if len(shape) == 1 and len(iters) == 1 and 0 <= iters[0] < shape[0]:
        index = int(iters[0])
    ran_site = np.asarray(gear_lib.effective(ran, site))
    repeat = bool(np.max(ran_site if index is None else ran_site[index]) >= Gear.SAFE)
    if made is not None:  # a repeat once both ran in SAFE: the maker's SAFE is new to it
        repeat = repeat and made_in_safe
    new = gear_lib.set_site(gs, site, Gear.SAFE, index=index, cfg=cfg)
    left = int(np.max(np.asarray(new.safe_left[site])))
    where = layer_name(site, index)
    action = f"site {where} -> SAFE for {left} steps"
    if hint is not None:  # the culprit is in no site: its input's maker is
        action = (
            f"{hint}. Site {where}, which made the culprit's near-overflow input, -> SAFE for "
            f"{left} steps"
        )
    if made is not None:
        new = gear_lib.set_site(new, made, Gear.SAFE, cfg=cfg)
        action += f"; site {made}, which made its near-overflow input, -> SAFE too"
    if repeat:
        action = f"site {where} failed again in SAFE: roll back, {action}"
    enter = dict(site=site, steps=left, layer=index)
    if made is not None:  # the trainer logs a safe_enter of its own for it
        enter["also"] = dict(
            site=made, steps=int(np.max(np.asarray(new.safe_left[made]))), layer=None
        )
    origin = (report.magnitude or {}).get("origin")
    if origin is not None and made is None and hint is None and origin.get("site") != site:
        where_made = origin.get("user_source") or origin.get("source")
        action += f"; its near-overflow input was made by `{origin['primitive']}` at {where_made}"
    kind = "repeat" if repeat else "located"
    return Decision(kind, report, new, repeat, action, enter, hint=hint)


def _huge_parameter(report: Report) -> str | None:
    """``"path (max |x| ...)"`` of the state's parameter the culprit's near-overflow input
    comes from (``Report.magnitude``; the replayed step's arguments are ``(state, batch)``), or
    None. Trained on, it overflows again after every SAFE stay: the weight stays huge
    (newuser48's router weight x1e38 took three incidents and a rollback)."""
    m = report.magnitude or {}
    arg = m.get("argument")
    if arg is None or not arg.startswith("[0].params"):
        return None
    share = f"{100 * m['origin_fraction']:.2g}% of the range the step reads it in"
    layer = f", layer {m['layer']} of the stack" if m.get("layer") is not None else ""
    return f"{arg[len('[0].params') :]} (max |x| {m['max_abs']:.3g}, {share}{layer})"


def huge_state_leaf(report: Report) -> tuple[str, float] | None:
    """What a rollback must not restore again: the ``keystr`` in the train state of the
    parameter ``report``'s near-overflow input comes from (``_huge_parameter``), and the
    largest finite value of the range the walk measured it in (the dtype the step reads it
    in: an f32 master weight cast to fp16 is measured in fp16's); None when there is none."""
    if _huge_parameter(report) is None:
        return None
    m = report.magnitude
    top = m["max_abs"] / m["origin_fraction"] if m["origin_fraction"] > 0 else float("inf")
    return m["argument"][len("[0]") :], top


def holds_huge(state, keystr: str, top: float) -> bool:
    """Whether ``state``'s leaf at ``keystr`` is still huge in the range whose largest finite
    value is ``top`` (``huge_state_leaf``; ``magnitude.is_huge`` for an argument): a checkpoint
    saved after the bad update (it is finite). Measured on the device, by one reduction whose
    result every process reads alike (a leaf sharded across processes cannot be read on one
    host)."""
    try:
        leaf = _leaf_at(state, keystr)
    except KeyError:
        return False
    sharding = getattr(leaf, "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    if mesh is None:
        biggest = jax.jit(magnitude.max_abs)(leaf)
    else:
        whole = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
        biggest = jax.jit(magnitude.max_abs, out_shardings=whole)(leaf)
    return magnitude.is_huge(float(biggest), top, argument=True)


def _origin_site(report: Report, gs: GearState) -> str | None:
    """The site whose equation made the culprit's near-overflow input (``Report.magnitude``),
    when it is one of ``gs``'s; else None."""
    origin = (report.magnitude or {}).get("origin") or {}
    site = origin.get("site")
    return site if site in gs.sites else None


def _leaf_at(tree, keystr: str):
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if jax.tree_util.keystr(path) == keystr:
            return leaf
    raise KeyError(keystr)
