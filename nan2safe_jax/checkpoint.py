"""Checkpoints that are never poisoned: orbax underneath, finite states only.

A ``TrainState`` is saved as the flat list of its array leaves (the static parts, graphdef and
optimizer, come from the running program), so gears and detector baselines travel with the
parameters and a resumed run keeps its gears. A state that is not finite is refused; on restore
an incomplete or corrupt checkpoint is skipped with a warning, and so is one whose arrays are
not finite, so a run always resumes from the newest *good* one.

The detector's probe names are kept beside each checkpoint (``<dir>_probes/<step>.json``): a run
resumed with a different probe set (a model edited between runs, a probe added) restores the
baselines of the probes both sets share instead of rejecting the checkpoint. So are the saved
arrays' names (``<dir>_paths/<step>.json``, ``leaf_paths``): a state whose arrays are named
otherwise (a renamed layer of the same shapes, another optimizer) is refused, naming the first
array that differs, instead of being filled by position.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from flax import nnx

from nan2safe_jax.gear import SiteValues
from nan2safe_jax.numerics import _inexact, _is_key, tree_is_finite
from nan2safe_jax.site import SITE_VARIABLES

log = logging.getLogger(__name__)


def state_is_finite(tree) -> bool:
    """Whether every floating array of ``tree`` is finite, with the same answer in every process.

    Arrays that span several processes (a state sharded across a ``jax.distributed`` run)
    cannot be read on one host, and each process alone sees only its own shards: a verdict from
    them could differ between processes, and the process that refuses a checkpoint would then
    skip the collectives the others wait in. Such arrays are checked on device instead, by one
    jitted reduction whose result is replicated, so every process reads the same bool. Arrays
    held whole by this process are checked on the host (``tree_is_finite``).

    Args:
      tree: a pytree of arrays (a ``TrainState``).

    Returns:
      True when no floating leaf holds a NaN or inf.
    """
    spanning = [
        x
        for x in jax.tree_util.tree_leaves(tree)
        if isinstance(x, jax.Array) and not x.is_fully_addressable and _inexact(x.dtype)
    ]
    local = jax.tree_util.tree_map(
        lambda x: None if isinstance(x, jax.Array) and not x.is_fully_addressable else x, tree
    )
    if not tree_is_finite(local):
        return False
    if not spanning:
        return True
    mesh = spanning[0].sharding.mesh
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    ok = jax.jit(
        lambda xs: jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in xs])),
        out_shardings=replicated,
    )(spanning)
    return bool(ok)


def _empty(leaf) -> bool:
    """A zero-size array (a model without sites has no per-site gear values): orbax refuses to
    save one, and its shape and dtype are the template's anyway."""
    return not _is_key(leaf) and np.size(leaf) == 0


def _to_saveable(state) -> dict:
    """The state's leaves by flat index, keys as raw key data; zero-size leaves are left out
    (``_from_saved`` takes them from the template)."""
    kept = [leaf for leaf in jax.tree_util.tree_leaves(state) if not _empty(leaf)]
    # Numbered among the kept leaves only: a siteless model's checkpoints from before
    # ``gear.SiteValues`` (empty per-site dicts: no leaves at all) have these very keys.
    return {
        f"{i:05d}": jax.random.key_data(leaf) if _is_key(leaf) else leaf
        for i, leaf in enumerate(kept)
    }


def _from_saved(saved: dict, template):
    leaves, treedef = jax.tree_util.tree_flatten(template)
    kept = sum(not _empty(leaf) for leaf in leaves)
    if len(saved) != kept:
        raise ValueError(f"checkpoint has {len(saved)} arrays, the state has {kept}")
    new = []
    i = -1
    for like in leaves:
        if _empty(like):
            new.append(like)
            continue
        i += 1
        value = saved[f"{i:05d}"]
        if _is_key(like):
            value = jax.random.wrap_key_data(value, impl=jax.random.key_impl(like))
        elif tuple(np.shape(value)) != tuple(np.shape(like)):
            raise ValueError(f"array {i}: shape {np.shape(value)} != {np.shape(like)}")
        if hasattr(like, "sharding") and not _is_key(like):
            value = jax.device_put(jnp.asarray(value, like.dtype), like.sharding)
        new.append(value)
    return jax.tree_util.tree_unflatten(treedef, new)


_PER_SITE = ("sites", "safe_left", "safe_entries")


def _per_site_dicts(state):
    """``state`` with its gears' per-site fields as dicts of one array per site, the layout
    checkpoints were written in before ``gear.SiteValues`` (None when ``state`` has no such
    fields): an older checkpoint restores into it, then ``_packed`` packs it."""
    gs = getattr(state, "gear", None)
    if not all(isinstance(getattr(gs, f, None), SiteValues) for f in _PER_SITE):
        return None
    unpacked = {f: {k: jnp.asarray(v) for k, v in getattr(gs, f).items()} for f in _PER_SITE}
    return state.replace(gear=gs.replace(**unpacked))


def _packed(state, like):
    """``state`` (restored in ``_per_site_dicts``' layout) with its per-site fields packed in
    ``like``'s site order and placement."""
    fields = {}
    for f in _PER_SITE:
        ref = getattr(like.gear, f)
        flat = SiteValues.of({k: getattr(state.gear, f)[k] for k in ref}).flat
        sharding = getattr(ref.flat, "sharding", None)
        fields[f] = ref.with_flat(flat if sharding is None else jax.device_put(flat, sharding))
    return state.replace(gear=state.gear.replace(**fields))


def _with_site_variables(state):
    """``state`` with the model's site variables (``site.SITE_VARIABLES``) back in ``rest``,
    the layout checkpoints were written in before ``site.SiteTemplate`` (None when ``state``
    has no template)."""
    if getattr(state, "site_template", None) is None:
        return None
    # ``dataclasses.replace``: ``TrainState.replace`` would drop the site variables again
    return dataclasses.replace(state, rest=nnx.split(state.model, nnx.Param, ...)[2])


def _without_site_variables(state, like):
    """``state`` (restored in ``_with_site_variables``' layout) with ``like``'s ``rest``
    layout: the site variables dropped (the step rebuilds them)."""
    model = nnx.merge(like.graphdef, state.params, state.rest)
    return state.replace(rest=nnx.split(model, nnx.Param, SITE_VARIABLES, ...)[3])


def _layouts(like):
    """``(layout, back)`` pairs a checkpoint of ``like`` may have been written in: today's,
    then those of earlier versions (built only when asked for: a restore of today's layout
    builds none); ``back`` turns a state restored in ``layout`` into ``like``'s."""
    yield like, lambda st: st
    with_sites = _with_site_variables(like)
    if with_sites is not None:
        yield with_sites, lambda st: _without_site_variables(st, like)
        old = _per_site_dicts(with_sites)
        if old is not None:
            yield old, lambda st: _without_site_variables(_packed(st, with_sites), like)


class CheckpointMismatchError(ValueError):
    """A readable checkpoint that was written for another state: a model whose parameters
    changed shape or number since the run saved it. Not corruption, so it is never skipped:
    skipping would start the run again and its saves would replace the old run's checkpoints."""


class CheckpointSaveError(OSError):
    """A checkpoint could not be written (a full disk, a lost mount): an ``OSError``, whatever
    orbax's background writer raised (its ``ValueError: RESOURCE_EXHAUSTED ...`` for a full
    disk). The checkpoints written before it are intact; ``step`` is the one that failed."""

    def __init__(self, message: str, step: int | None):
        super().__init__(message)
        self.step = step
        self.logged = False  # the Trainer logs it once (``Trainer._log_save_error``)


def leaf_paths(state) -> list[str]:
    """The path of each array a checkpoint of ``state`` holds, in saved order.

    A checkpoint stores arrays by position; these names, kept beside it, let a restore tell a
    renamed or reordered layer (the same shapes in another order: the weights would land in
    the wrong layer) and a changed optimizer from the run's own state. nnx's ``.value`` ending
    is left out, so the names do not depend on how a Variable exposes its array.
    """
    return [
        re.sub(r"\.(value|raw_value)$", "", jax.tree_util.keystr(k))
        for k, v in jax.tree_util.tree_flatten_with_path(state)[0]
        if not _empty(v)
    ]


def _first_name_difference(saved: list[str], here: list[str]) -> str:
    """Where the saved array names and today's first differ."""
    for i, (a, b) in enumerate(zip(saved, here, strict=False)):
        if a != b:
            return f"array {i} is {a} there, {b} here"
    longer, which = (saved, "there") if len(saved) > len(here) else (here, "here")
    n = min(len(saved), len(here))
    return (
        f"it holds {len(saved)} arrays, this state {len(here)}; the first array only {which} "
        f"is {longer[n]}"
    )


def _layout_of(shapes, like, path, names=None):
    """The ``(layout, back)`` of ``_layouts(like)`` whose arrays have exactly ``shapes`` and,
    when ``names`` are known, those names (today's when the shapes are unknown: restoring it
    then reports what is wrong).

    ``names``: the saved arrays' ``leaf_paths`` (None for checkpoints written before they were
    kept: shapes alone decide).

    Raises:
      CheckpointMismatchError: no layout has ``shapes`` and ``names``; names the first
        difference with today's layout.
    """
    if shapes is None and names is None:
        return like, lambda st: st
    for layout, back in _layouts(like):
        if names is not None and leaf_paths(layout) != names:
            continue
        leaves = jax.tree_util.tree_leaves(_abstract(layout))
        if shapes is None or (
            len(leaves) == len(shapes)
            and all(tuple(a.shape) == s for a, s in zip(leaves, shapes, strict=True))
        ):
            return layout, back
    here = leaf_paths(like)
    if names is not None and names != here:
        why = _first_name_difference(names, here)
    else:
        why = _first_difference(shapes, like)
    raise CheckpointMismatchError(
        f"checkpoint {path} was written for a different model: {why}. Resume with the model, "
        "optimizer (and probe set) the run was made with, or give this one a new workdir; "
        "checkpoints of a changed model are not restored, and are kept"
    )


def _first_difference(shapes, like) -> str:
    """Where the saved ``shapes`` and ``like``'s arrays first differ, by the state's leaf path."""
    named = [(k, v) for k, v in jax.tree_util.tree_flatten_with_path(like)[0] if not _empty(v)]
    if len(named) != len(shapes):
        return f"it holds {len(shapes)} arrays, this state {len(named)}"
    for (key, leaf), saved in zip(named, shapes, strict=True):
        have = tuple(np.shape(jax.random.key_data(leaf) if _is_key(leaf) else leaf))
        if have != saved:
            return f"{jax.tree_util.keystr(key)} has shape {saved} there, {have} here"
    return "the arrays differ"


def _probe_names(state) -> tuple[str, ...] | None:
    """The detector's probe names of a ``TrainState`` (None for any other tree)."""
    det = getattr(state, "detector", None)
    names = getattr(det, "names", None)
    return None if names is None or not hasattr(state, "with_probes") else tuple(names)


def _abstract(template) -> dict:
    def spec(leaf):
        if _is_key(leaf):
            leaf = jax.random.key_data(leaf)
        sharding = getattr(leaf, "sharding", None)
        return jax.ShapeDtypeStruct(np.shape(leaf), leaf.dtype, sharding=sharding)

    return {k: spec(v) for k, v in _to_saveable(template).items()}


class SkippedCheckpoint(UserWarning):
    """Warned by ``Checkpointer.restore_latest`` for each checkpoint it skips (incomplete,
    corrupt or not finite); ``step`` is the checkpoint's, so a log of it can say where."""

    def __init__(self, message: str, step: int):
        super().__init__(message)
        self.step = int(step)


class Checkpointer:
    """Saves finite ``TrainState``s and restores the newest complete, finite one.

    Args:
      directory: where checkpoints go (created).
      max_to_keep: orbax's retention.
      async_save: let orbax write in the background (``wait()`` joins it).
    """

    def __init__(self, directory: str | os.PathLike, *, max_to_keep: int = 3, async_save=True):
        self.directory = Path(directory).absolute()
        self.directory.mkdir(parents=True, exist_ok=True)
        options = ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep, enable_async_checkpointing=async_save, create=True
        )
        # One fixed item handler: without it orbax infers single or multi item from the first
        # step folder it reads, and one stray folder (empty, or missing ``default/``) would
        # make every good checkpoint unreadable.
        self._manager = ocp.CheckpointManager(
            self.directory, options=options, item_handlers=ocp.StandardCheckpointHandler()
        )
        self._probes = self.directory.parent / f"{self.directory.name}_probes"
        self._paths = self.directory.parent / f"{self.directory.name}_paths"
        self._writing: int | None = None  # the step of the save in flight (for its error)

    def steps(self) -> list[int]:
        """Steps of the checkpoints orbax considers complete, oldest first."""
        self._manager.reload()
        return sorted(self._manager.all_steps())

    def unfinished(self) -> list[int]:
        """Steps of saves that never finished (orbax's ``N.orbax-checkpoint-tmp*`` folders: the
        run, or one of its processes, ended while a background save was being written)."""
        if not self.directory.is_dir():
            return []
        out = set()
        for p in self.directory.iterdir():
            head, sep, _ = p.name.partition(".orbax-checkpoint-tmp")
            if sep and head.isdigit() and int(head) not in self._manager.all_steps():
                out.add(int(head))
        return sorted(out)

    def save(self, step: int, state, *, finite: bool | None = None) -> bool:
        """Saves ``state`` as ``step`` unless it is not finite.

        Args:
          step: the step number the state is at.
          state: a ``TrainState`` (or any pytree of arrays).
          finite: a finiteness verdict the caller already holds; ``None`` (what the Trainer
            passes) checks here with ``state_is_finite``, a host pass over the arrays the save
            reads back anyway, so the train step compiles no check of its own.

        Returns:
          Whether it was saved. A non-finite state is never written.
        """
        ok = state_is_finite(state) if finite is None else bool(finite)
        if not ok:
            log.warning("step %d: state is not finite; checkpoint refused", step)
            return False
        self.wait()  # orbax would, in ``save``: a failure of the last save is named as its own
        if int(step) in self._manager.all_steps():
            # A step saved on a timeline a rollback abandoned: the new state replaces it.
            self._manager.delete(int(step))
        names = _probe_names(state)
        if names is not None:
            self._probes.mkdir(parents=True, exist_ok=True)
            (self._probes / f"{int(step)}.json").write_text(json.dumps(list(names)))
        self._paths.mkdir(parents=True, exist_ok=True)
        (self._paths / f"{int(step)}.json").write_text(json.dumps(leaf_paths(state)))
        self._writing = int(step)
        try:
            self._manager.save(
                int(step), args=ocp.args.StandardSave(_to_saveable(state)), force=True
            )
        except Exception as err:
            raise self._save_error(err) from err
        self._prune_side_files()
        return True

    def _prune_side_files(self) -> None:
        """Deletes the probe-name and array-name files of checkpoints older than the oldest
        orbax keeps (its ``max_to_keep`` deletes the checkpoints themselves, not these)."""
        kept = self._manager.all_steps()
        if not kept:
            return
        oldest = min(kept)
        for folder in (self._probes, self._paths):
            for f in folder.glob("*.json") if folder.is_dir() else ():
                if f.stem.isdigit() and int(f.stem) < oldest:
                    f.unlink(missing_ok=True)

    def restore(self, step: int, template):
        """Restores checkpoint ``step`` into the structure (and shardings) of ``template``.

        A ``TrainState`` saved with another probe set is restored with the probes it was saved
        with, then carried over to ``template``'s (shared probes keep their baselines, new ones
        start fresh).
        """
        saved_names = self._saved_names(step)
        names = _probe_names(template)
        like = template
        if saved_names is not None and names is not None and saved_names != names:
            like = template.with_probes(saved_names)
        layout, back = _layout_of(
            self._saved_shapes(step), like, self.path(step), self._saved_paths(step)
        )
        saved = self._manager.restore(int(step), args=ocp.args.StandardRestore(_abstract(layout)))
        state = back(_from_saved(saved, layout))
        return state if like is template else state.with_probes(names)

    def _saved_shapes(self, step: int) -> list[tuple[int, ...]] | None:
        """The shapes of checkpoint ``step``'s arrays in saved order (None if unreadable)."""
        try:
            meta = ocp.StandardCheckpointHandler().metadata(epath.Path(self.path(step)) / "default")
            return [tuple(meta[k].shape) for k in sorted(meta)]
        except Exception:  # noqa: BLE001 - no metadata: restore as today's layout, which reports
            return None

    def _saved_paths(self, step: int) -> list[str] | None:
        """The saved arrays' ``leaf_paths`` (None for a checkpoint written before they were
        kept, or without its file)."""
        try:
            return list(json.loads((self._paths / f"{int(step)}.json").read_text()))
        except (OSError, ValueError):
            return None

    def _saved_names(self, step: int) -> tuple[str, ...] | None:
        path = self._probes / f"{int(step)}.json"
        try:
            return tuple(json.loads(path.read_text()))
        except (OSError, ValueError):
            return None

    def restore_latest(self, template, *, before: int | None = None):
        """The newest complete and finite checkpoint as ``(state, step)``, or None.

        Args:
          template: a state of the same structure (e.g. a freshly created ``TrainState``).
          before: only consider checkpoints at steps ``<= before``.

        A checkpoint that fails to restore (truncated, corrupt) or holds non-finite values is
        skipped with a warning.

        Raises:
          CheckpointMismatchError: the newest checkpoint was written for a different state (a
            changed model): an error, since nothing older of the same run would fit either.
        """
        self.wait()
        for step in reversed(self.steps()):
            if before is not None and step > before:
                continue
            try:
                state = self.restore(step, template)
            except CheckpointMismatchError:
                raise
            except Exception as err:  # orbax raises many types for a damaged directory
                said = (
                    f"checkpoint {self.directory / str(step)} is incomplete or corrupt "
                    f"({type(err).__name__}: {str(err)[:120]}); skipped"
                )
                warnings.warn(SkippedCheckpoint(said, step), stacklevel=2)
                continue
            if not state_is_finite(state):
                said = f"checkpoint at step {step} is not finite; skipped"
                warnings.warn(SkippedCheckpoint(said, step), stacklevel=2)
                continue
            return state, step
        return None

    def delete_after(self, step: int) -> list[int]:
        """Deletes every checkpoint after ``step`` (a timeline abandoned by a rollback).

        Returns:
          The deleted steps.
        """
        self.wait()
        gone = [s for s in self.steps() if s > step]
        for s in gone:
            self._manager.delete(s)
            (self._probes / f"{s}.json").unlink(missing_ok=True)
            (self._paths / f"{s}.json").unlink(missing_ok=True)
        return gone

    def path(self, step: int) -> Path:
        return self.directory / str(int(step))

    def wait(self) -> None:
        """Blocks until background saves are written.

        Raises:
          CheckpointSaveError: the save in the background failed.
        """
        try:
            self._manager.wait_until_finished()
        except Exception as err:
            raise self._save_error(err) from err
        self._writing = None

    def _save_error(self, err: Exception) -> CheckpointSaveError:
        step, self._writing = self._writing, None
        what = "a checkpoint" if step is None else f"checkpoint {step}"
        return CheckpointSaveError(
            f"{what} in {str(self.directory)!r} could not be written "
            f"({type(err).__name__}: {str(err)[:300]}); the checkpoints before it are intact",
            step,
        )

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self._manager.close()
