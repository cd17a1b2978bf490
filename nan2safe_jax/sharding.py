"""Sharding rules for the train step: data parallel and FSDP under ``jax.sharding``.

JAX's SPMD partitioner is the distributed engine; this module only says where each array of a
``TrainState`` and of a batch lives on a ``Mesh``:

- the batch is split along its leading (batch) dimension over the data axis;
- parameters and optimizer state are replicated (``data_parallel``) or split over a second,
  FSDP axis on their largest dimension divisible by its size (``fsdp``, ZeRO-3 style);
- everything small — gear state, detector baselines, site gears and probes, scalars — is
  replicated.

Why every device takes the same gear decision, with no code of ours to coordinate it: the step
is one SPMD program over global arrays. A probe statistic such as ``max(|h|)`` of a
batch-sharded activation is a reduction over a *global* array, so the partitioner computes it as
a local reduction followed by an all-reduce, and its result is the same value on every device.
The detector, the risk score and ``gear.decide`` then run on replicated inputs and produce
replicated outputs (the step's ``out_shardings`` say so), so each device holds the same risk and
the same next gear. There is no rank-0 "brain" and no collective written by hand. Under
multi-host ``jax.distributed`` the same program runs on every process, so the host loops (which
only read those replicated metrics) take the same branches too. The host decisions that are not
read from the step's metrics are made alike on purpose: the checkpoint verdict on a state split
across processes is a replicated device reduction (``checkpoint.state_is_finite``), tier 2's
decision (a replay every process runs on the same gathered arguments) is checked with
``agree``, and a process that dies ends the others with an error (``distributed_options``,
``lost_process_error``) instead of leaving them in a collective.

    mesh = nan2safe.sharding.make_mesh((2, 4), ("data", "fsdp"))
    rules = nan2safe.sharding.fsdp(mesh)                  # or data_parallel(mesh)
    step = nan2safe.make_train_step(loss_fn, rules=rules)   # shards state and batch itself
    trainer = nan2safe.Trainer(model, tx, loss_fn, cfg, workdir, rules=rules)
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

T = TypeVar("T")

# Fields of a TrainState whose leaves follow the parameter rule (Adam's mu/nu have the params'
# shapes); every other field is small and replicated.
_PARAM_FIELDS = ("params", "opt_state")

__all__ = [
    "Rules",
    "agree",
    "batch_shardings",
    "check_agreement",
    "cpu_simulation_flags",
    "data_parallel",
    "distributed_options",
    "fsdp",
    "host_arrays",
    "init_cpu",
    "is_replicated",
    "log_dir",
    "lost_process_error",
    "make_mesh",
    "resolve",
    "shard_batch",
    "shard_state",
    "shards_of",
    "state_shardings",
    "to_local",
]


def cpu_simulation_flags(devices: int) -> str:
    """``XLA_FLAGS`` for ``devices`` simulated CPU devices (set before JAX is imported).

    Besides the device count, turns off XLA:CPU's concurrency-optimized scheduler: with it, the
    per-device programs of an FSDP step can issue independent collectives in different orders
    and, on a machine with few cores, deadlock in the all-reduce rendezvous (seen with the
    example transformer on 8 simulated devices). Real accelerators are not affected.
    """
    return (
        f"--xla_force_host_platform_device_count={int(devices)} "
        "--xla_cpu_enable_concurrency_optimized_scheduler=false"
    )


def init_cpu(
    local_devices: int,
    *,
    coordinator: str | None = None,
    num_processes: int = 1,
    process_id: int = 0,
    heartbeat_timeout_s: int = 10,
    init_timeout_s: int = 60,
) -> None:
    """Sets up JAX on CPU: ``local_devices`` devices in this process, and optionally a
    ``jax.distributed`` run of ``num_processes`` processes over ``coordinator``.

    Call it before anything touches a JAX backend (``jax.devices()``, any computation). The
    same call serves a single-process simulation (``coordinator=None``: just the device count)
    and a real multi-process run: every process calls it with the same coordinator and count
    and its own ``process_id``. Collectives between processes use gloo (XLA:CPU has no other
    cross-process transport). XLA:CPU's concurrency-optimized scheduler is turned off for the
    reason given in :func:`cpu_simulation_flags`.

    Args:
      local_devices: CPU devices in this process (``jax_num_cpu_devices``).
      coordinator: ``"host:port"`` of process 0's coordination service, or None for one
        process.
      num_processes: processes in the run.
      process_id: this process, ``0 <= process_id < num_processes``.
      heartbeat_timeout_s: a process that stops answering is declared dead after this long,
        and the others stop with an error instead of waiting forever in a collective (see
        :func:`distributed_options` for how a lost process ends the run).
      init_timeout_s: how long to wait for every process to join.

    Raises:
      ValueError: a count or id is out of range, or ``coordinator`` is not ``host:port``.
      RuntimeError: a JAX backend is already initialized (too late to set the device count).
    """
    import os

    if int(local_devices) < 1:
        raise ValueError(f"local_devices must be >= 1, got {local_devices!r}")
    options = distributed_options(
        coordinator,
        num_processes,
        process_id,
        heartbeat_timeout_s=heartbeat_timeout_s,
        init_timeout_s=init_timeout_s,
    )
    from nan2safe_jax.replay._jax_compat import backends_initialized

    if backends_initialized():
        raise RuntimeError(
            "init_cpu must run before JAX initializes a backend (before jax.devices() or any "
            "computation)"
        )
    flag = "--xla_cpu_enable_concurrency_optimized_scheduler=false"
    if flag not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flag}".strip()
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", int(local_devices))
    if options is None:
        return
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(**options)


def distributed_options(
    coordinator: str | None,
    num_processes: int = 1,
    process_id: int = 0,
    *,
    heartbeat_timeout_s: int = 10,
    init_timeout_s: int = 60,
) -> dict | None:
    """The keyword arguments ``init_cpu`` passes to ``jax.distributed.initialize``.

    The timeouts are what bounds a run that loses a process. A process blocked in a collective
    with a dead peer gets an error from gloo as soon as the peer's socket closes; one that is
    not (computing, writing a checkpoint) is stopped by the coordination service once the dead
    peer has missed ``heartbeat_timeout_s`` of heartbeats, and ``jax.distributed.shutdown`` at
    exit waits at most ``3 * heartbeat_timeout_s`` for the others. JAX's defaults (100 s and
    300 s) would leave a survivor waiting minutes. A peer that hangs without dying keeps its
    heartbeats going, so none of this stops the others: the ``Trainer``'s watchdog does
    (``Trainer(hang_timeout_s=)``, ``nan2safe_jax.watchdog``).

    Args:
      coordinator: ``"host:port"`` of process 0, or None for a single process.
      num_processes: processes in the run.
      process_id: this process, ``0 <= process_id < num_processes``.
      heartbeat_timeout_s: seconds without a heartbeat after which a process counts as dead.
      init_timeout_s: seconds to wait for every process to join.

    Returns:
      The keyword arguments, or None for a single process (no ``jax.distributed``).

    Raises:
      ValueError: a count, id or timeout is out of range, or ``coordinator`` is not
        ``host:port``.
    """
    if int(num_processes) < 1:
        raise ValueError(f"num_processes must be >= 1, got {num_processes!r}")
    if not 0 <= int(process_id) < int(num_processes):
        raise ValueError(f"process_id must be in [0, {num_processes}), got {process_id!r}")
    if coordinator is None and num_processes > 1:
        raise ValueError("coordinator is required when num_processes > 1")
    if coordinator is not None and not str(coordinator).rpartition(":")[2].isdigit():
        raise ValueError(f"coordinator must look like 'host:port', got {coordinator!r}")
    if int(heartbeat_timeout_s) < 1:
        raise ValueError(f"heartbeat_timeout_s must be >= 1, got {heartbeat_timeout_s!r}")
    if int(init_timeout_s) < 1:
        raise ValueError(f"init_timeout_s must be >= 1, got {init_timeout_s!r}")
    if coordinator is None:
        return None
    return {
        "coordinator_address": str(coordinator),
        "num_processes": int(num_processes),
        "process_id": int(process_id),
        "initialization_timeout": int(init_timeout_s),
        "heartbeat_timeout_seconds": int(heartbeat_timeout_s),
        "shutdown_timeout_seconds": 3 * int(heartbeat_timeout_s),
    }


def lost_process_error(err: BaseException, *, process=None, count=None) -> RuntimeError | None:
    """A clear error for a collective that failed because another process is gone, or None.

    When a process of a ``jax.distributed`` run dies, the others learn it from the transport
    (``JaxRuntimeError: Gloo all-reduce failed ... Connection closed by peer``) or from the
    coordination service (heartbeat timeout). The Trainer re-raises the first as this error,
    which says what happened and how to go on.

    Args:
      err: the exception a step or a device-to-host read raised.
      process: this process's index (default ``jax.process_index()``).
      count: processes in the run (default ``jax.process_count()``).

    Returns:
      A ``RuntimeError`` to raise ``from err``, or None when ``err`` is something else (or the
      run has one process).
    """
    count = jax.process_count() if count is None else int(count)
    if count < 2:
        return None
    text = str(err)
    markers = ("Gloo", "Connection closed by peer", "Connection reset by peer", "heartbeat")
    if not any(m in text for m in markers):
        return None
    process = jax.process_index() if process is None else int(process)
    return RuntimeError(
        f"process {process} of {count}: a collective with another process failed; a process "
        "of the jax.distributed run has most likely died or lost its connection. This "
        "process stops here; restart every process to resume from the newest checkpoint. "
        f"(JAX: {text.splitlines()[0][:300]})"
    )


def agree(value: T, what: str) -> T:
    """``value`` after checking that every process of the run computed the same one.

    Host-side decisions taken from values each process computes itself (tier 2's replay of a
    failing step on the gathered arguments) must be identical everywhere: a process that takes
    another branch skips collectives the others then wait in forever. The replay is
    deterministic, so this holds; ``agree`` turns a violation into an immediate error instead
    of a hang. One small all-gather of a digest; free with one process.

    Args:
      value: a JSON-serializable value (e.g. ``(decision.kind, site, primitive)``).
      what: names the decision in the error.

    Returns:
      ``value``.

    Raises:
      RuntimeError: processes disagree (names them).
    """
    if jax.process_count() == 1:
        return value
    from jax.experimental import multihost_utils

    digests = multihost_utils.process_allgather(np.asarray(_digest(value), np.int64))
    check_agreement([int(d) for d in np.ravel(digests)], what)
    return value


def _digest(value) -> int:
    import hashlib
    import json

    text = json.dumps(value, sort_keys=True, default=str)
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:7], "little")


def check_agreement(digests: Sequence[int], what: str) -> None:
    """Raises RuntimeError naming the processes whose digest differs from process 0's.

    Args:
      digests: one digest per process, in process order (what ``agree`` gathers).
      what: names the decision in the error.
    """
    differ = [i for i, d in enumerate(digests) if d != digests[0]]
    if differ:
        raise RuntimeError(
            f"processes {differ} took another {what} than process 0; the run cannot go on "
            "(each would wait in collectives the others skip)"
        )


def agree_fields(record: dict, what: str) -> None:
    """Checks that every process of the run holds the same ``record`` (e.g. the ``Config``),
    field by field.

    Processes given different settings (a ``checkpoint_every`` of 5 here, 7 there) take their
    host decisions at different steps and each waits in a collective the other skips: both
    hang, silently. One all-gather of one digest per field; free with one process.

    Args:
      record: field name -> JSON-serializable value.
      what: names the record in the error.

    Raises:
      ValueError: names the fields that differ and the processes that hold another value
        than process 0.
    """
    if jax.process_count() == 1:
        return
    from jax.experimental import multihost_utils

    names = sorted(record)
    mine = np.asarray([_digest(_canonical(record[n])) for n in names], np.int64)
    table = multihost_utils.process_allgather(mine)
    check_field_agreement(np.asarray(table).reshape(-1, len(names)).tolist(), names, what)


def _canonical(value):
    """``value`` with equal numbers spelled alike (``5`` and ``5.0``, NumPy scalars), so that
    settings that compare equal have one digest."""
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, dict):
        return {str(k): _canonical(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_canonical(v) for v in value]
    return value


def check_field_agreement(table: Sequence[Sequence[int]], names: Sequence[str], what: str):
    """Raises ValueError naming the fields whose digest differs from process 0's, with the
    processes holding another value.

    Args:
      table: per process, one digest per field of ``names`` (what ``agree_fields`` gathers).
      names: the fields, in ``table``'s column order.
      what: names the record in the error.
    """
    differ = {
        name: [i for i, row in enumerate(table) if row[j] != table[0][j]]
        for j, name in enumerate(names)
    }
    differ = {k: v for k, v in differ.items() if v}
    if differ:
        said = "; ".join(f"{k} (processes {v})" for k, v in differ.items())
        raise ValueError(
            f"{what} differs between the processes of the run: {said} hold another value than "
            "process 0. Give every process the same settings (each would otherwise wait, at a "
            "different step, in collectives the others skip)"
        )


def log_dir(workdir):
    """Where this process writes its event and metric logs.

    Process 0 writes ``workdir`` itself (the run's one ``events.jsonl``); every other process
    of a ``jax.distributed`` run writes ``workdir/process_<i>``, so the logs are never two
    interleaved writers of one file. All processes take the same decisions (from replicated
    values), so their logs hold the same events.
    """
    from pathlib import Path

    i = jax.process_index()
    return Path(workdir) if i == 0 else Path(workdir) / f"process_{i}"


def host_arrays(tree: T) -> T:
    """``tree`` with its fully addressable ``jax.Array`` leaves as numpy arrays when the run has
    more than one process (unchanged otherwise).

    Orbax refuses to save a host-local ``jax.Array`` in a multi-process run; numpy arrays it
    treats as replicated and writes once. Used for values every process holds whole and alike
    (the gathered state of an incident).
    """
    if jax.process_count() == 1:
        return tree

    def one(x):
        if isinstance(x, jax.Array) and x.is_fully_addressable:
            if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
                return x
            return np.asarray(x)
        return x

    return jax.tree_util.tree_map(one, tree)


def make_mesh(shape: Sequence[int], axis_names: Sequence[str], *, devices=None) -> Mesh:
    """A ``Mesh`` whose axes are ``Auto`` (the partitioner propagates shardings in the step).

    ``jax.make_mesh`` defaults to ``Explicit`` axes, which require every op of the model to be
    written for explicit sharding; nan2safe only fixes the shardings at the step's boundary.

    Args:
      shape: devices along each axis, e.g. ``(2, 4)``; its product must be the device count
        (or ``len(devices)``).
      axis_names: e.g. ``("data", "fsdp")``.
      devices: the devices to use (default: all of ``jax.devices()``).
    """
    shape, names = tuple(int(s) for s in shape), tuple(axis_names)
    if len(shape) != len(names):
        raise ValueError(f"mesh shape {shape} and axis names {names} differ in length")
    devs = jax.devices() if devices is None else list(devices)
    if math.prod(shape) != len(devs):
        raise ValueError(
            f"mesh shape {shape} needs {math.prod(shape)} devices, have {len(devs)}; on CPU "
            "set XLA_FLAGS=--xla_force_host_platform_device_count=N before importing jax"
        )
    return jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(shape), devices=devs)


def _auto(mesh: Mesh) -> Mesh:
    if not isinstance(mesh, Mesh):
        raise ValueError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
    if all(t == AxisType.Auto for t in mesh.axis_types):
        return mesh
    return Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * mesh.devices.ndim)


def _axes(axis) -> tuple[str, ...]:
    return (axis,) if isinstance(axis, str) else tuple(axis)


# ``Rules.sum_of_squares`` shares whole arrays out over at least this many devices holding the
# same shards, and slices each array over fewer. A device's share runs in one conditional,
# after every array in it is ready, where slices run as each array is; over 8 devices that
# share is an eighth of the sweep, over 2 a half. Measured (one-process A/B, demo model,
# 8 simulated CPU devices, 2026-12-06): over 8 (data parallel) the shares ran 0.96-0.99x the
# slices at 1 and 8 sequences per device; over 2 (ZeRO-3's data axis) 0.97x at 1 sequence
# per device but 1.03x at 8.
SHARE_MIN_DEVICES = 4


def balanced_bins(sizes: Sequence[int], k: int) -> list[list[int]]:
    """``k`` bins of the indices of ``sizes``, each index in one, the bins' totals balanced.

    Largest first, each into the bin with the smallest total so far (the longest-processing-
    time rule: the fullest bin holds at most 4/3 of the best possible split's). Ties go to
    the lowest bin, so every process builds the same bins.

    Args:
      sizes: a size per item (e.g. elements of an array).
      k: the number of bins (>= 1).

    Returns:
      ``k`` lists of indices into ``sizes`` (some empty when there are fewer items than bins).
    """
    bins: list[list[int]] = [[] for _ in range(k)]
    load = [0] * k
    for item in sorted(range(len(sizes)), key=lambda n: (-sizes[n], n)):
        j = load.index(min(load))
        bins[j].append(item)
        load[j] += sizes[item]
    return bins


@dataclasses.dataclass(frozen=True)
class Rules:
    """Where each array goes on ``mesh``. Build with ``data_parallel`` or ``fsdp``.

    Attributes:
      mesh: the device mesh (its axes are made ``Auto``).
      data_axis: mesh axis (or tuple of axes) the batch's leading dimension is split over.
      fsdp_axis: mesh axis parameters and optimizer state are split over; None replicates them.
      min_size: arrays with fewer elements than this stay replicated (not worth splitting).
    """

    mesh: Mesh
    data_axis: str | tuple[str, ...] = "data"
    fsdp_axis: str | None = None
    min_size: int = 1024

    def __post_init__(self):
        object.__setattr__(self, "mesh", _auto(self.mesh))
        names = self.mesh.axis_names
        for ax in _axes(self.data_axis) + ((self.fsdp_axis,) if self.fsdp_axis else ()):
            if ax not in names:
                raise ValueError(f"axis {ax!r} is not in the mesh's axes {names}")
        if self.min_size < 0:
            raise ValueError(f"min_size must be >= 0, got {self.min_size!r}")

    @property
    def replicated(self) -> NamedSharding:
        """The sharding of small state and of the step's metrics: a full copy on every device."""
        return NamedSharding(self.mesh, PartitionSpec())

    @property
    def num_data_shards(self) -> int:
        """How many pieces the batch is cut into."""
        return math.prod(self.mesh.shape[a] for a in _axes(self.data_axis))

    def batch_sharding(self, x) -> NamedSharding:
        """Leading dimension over the data axis; a scalar is replicated.

        Raises:
          ValueError: the leading dimension is not divisible by the number of data shards.
        """
        shape = np.shape(x)
        if not shape:
            return self.replicated
        n = self.num_data_shards
        if shape[0] % n:
            raise ValueError(
                f"batch leading dimension {shape[0]} is not divisible by the {n} data shards "
                f"of mesh axis {self.data_axis!r}; use a global batch size that is a multiple "
                f"of {n}"
            )
        axis = self.data_axis if isinstance(self.data_axis, str) else tuple(self.data_axis)
        return NamedSharding(self.mesh, PartitionSpec(axis))

    def param_sharding(self, x) -> NamedSharding:
        """Replicated, or (FSDP) split on the largest dimension divisible by the FSDP axis."""
        shape = np.shape(x)
        if self.fsdp_axis is None or math.prod(shape) < max(self.min_size, 1):
            return self.replicated
        n = self.mesh.shape[self.fsdp_axis]
        fits = [d for d in range(len(shape)) if shape[d] % n == 0 and shape[d] >= n]
        if not fits:
            return self.replicated
        dim = max(fits, key=lambda d: (shape[d], -d))
        spec = [None] * len(shape)
        spec[dim] = self.fsdp_axis
        return NamedSharding(self.mesh, PartitionSpec(*spec))

    def replicates(self, x) -> bool:
        """Whether ``param_sharding`` keeps ``x`` whole on every device."""
        return self.param_sharding(x).is_fully_replicated

    def sum_of_squares(self, xs: Sequence[jax.Array], ys: Sequence[jax.Array] | None = None):
        """f32[] the sum of the squares of every array of ``xs`` (of ``x - y`` with ``ys``), in
        f32, each device summing a distinct share.

        The train step's gradient and update sums read every parameter-sized array of the
        step. An array the rules replicate over some mesh axes (every axis under data
        parallelism, the data axis under FSDP) was summed whole on each device of those axes:
        the same sweep on every device (+42% bytes per device over a plain data-parallel step
        of the demo model). Here, inside a ``shard_map`` that takes each array as the rules
        place it (so nothing upstream changes layout), the ``k`` devices that hold the same
        shards share them out, and one all-reduce adds the partial sums (XLA merges it with
        the step's others). With ``k >= SHARE_MIN_DEVICES`` each device sums whole shards,
        about a ``1/k`` share of the elements (``balanced_bins``; one ``lax.switch`` on the
        device's index picks its share), so only the kernels of its own share run. Below
        that, and for a shard larger than a device's share, each device sums a ``1/k`` slice
        of the shard: XLA:CPU writes each dynamic slice out in a kernel of its own (84 slices
        in a data-parallel step of the demo model before 2026-12-06, 137 of its 1,030 kernels
        with their reductions, each run on every device; 893 kernels with the shares). A
        shard that does not divide by ``k`` is summed whole on every device.

        Args:
          xs: arrays (any float dtype; summed in f32), laid out as ``param_sharding`` says.
          ys: optional arrays like ``xs``: the sum is of ``(x - y)**2``.

        Returns:
          f32[].
        """
        ys = [None] * len(xs) if ys is None else list(ys)
        f32 = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
        sq = lambda x, y: jnp.sum(jnp.square(f32(x) if y is None else f32(x) - f32(y)))  # noqa: E731
        total = jnp.zeros([], jnp.float32)
        shared, specs = [], []  # the (x, y) pairs summed in the shard_map, and their placements
        # the axes holding copies -> (k, [(pair index, shard size)])
        groups: dict[tuple[str, ...], tuple[int, list[tuple[int, int]]]] = {}
        for x, y in zip(xs, ys, strict=True):
            spec = self.param_sharding(x).spec
            used = {a for part in spec if part for a in _axes(part)}
            rest = tuple(a for a in self.mesh.axis_names if a not in used)
            k = math.prod(self.mesh.shape[a] for a in rest)
            shard = math.prod(np.shape(x)) // math.prod(self.mesh.shape[a] for a in used)
            if k > 1 and shard % k == 0:
                groups.setdefault(rest, (k, []))[1].append((len(shared), shard))
                shared.append((x, y))
                specs.append(spec)
            else:
                total = total + sq(x, y)
        if not shared:
            return total
        axes = tuple(self.mesh.axis_names)

        def sliced(x, y, rest, k):
            """The sum over this device's ``1/k`` of the shards ``x`` (and ``y``): ``k``
            devices along ``rest`` hold them."""
            at = jax.lax.axis_index(rest)
            cut = lambda a: jax.lax.dynamic_index_in_dim(a.reshape(k, -1), at, 0, keepdims=False)  # noqa: E731
            return sq(cut(x), None if y is None else cut(y))

        def share(n, shares):
            """Device ``n``'s share: the sum over the pairs ``shares[n]``, each summed whole."""
            return sum((sq(x, y) for x, y in shares[n]), jnp.zeros([], jnp.float32))

        def local(pairs):
            s = jnp.zeros([], jnp.float32)
            for rest, (k, members) in groups.items():
                group_total = sum(n for _, n in members)
                fits = k >= SHARE_MIN_DEVICES
                whole = [(i, n) for i, n in members if fits and n * k <= group_total]
                taken = {i for i, _ in whole}
                for i, _ in members:
                    if i not in taken:
                        s = s + sliced(*pairs[i], rest, k)
                if whole:
                    bins = balanced_bins([n for _, n in whole], k)
                    shares = [[pairs[whole[j][0]] for j in b] for b in bins]
                    branches = [functools.partial(share, n) for n in range(k)]
                    s = s + jax.lax.switch(jax.lax.axis_index(rest), branches, shares)
            return jax.lax.psum(s, axes)

        in_specs = (
            [
                (spec, None if y is None else spec)
                for (_, y), spec in zip(shared, specs, strict=True)
            ],
        )
        summed = jax.shard_map(
            local, mesh=self.mesh, in_specs=in_specs, out_specs=PartitionSpec(), check_vma=False
        )(shared)
        return total + summed


def data_parallel(mesh: Mesh, data_axis: str | tuple[str, ...] = "data") -> Rules:
    """Batch split over ``data_axis``; parameters, optimizer state and the rest replicated."""
    return Rules(mesh, data_axis=data_axis, fsdp_axis=None)


def fsdp(
    mesh: Mesh,
    data_axis: str | tuple[str, ...] = "data",
    fsdp_axis: str = "fsdp",
    *,
    min_size: int = 1024,
) -> Rules:
    """Batch split over ``data_axis``; parameters and optimizer state split over ``fsdp_axis``.

    Each parameter (and each optimizer-state array of the same shape) is split on its largest
    dimension divisible by the FSDP axis size; arrays under ``min_size`` elements or with no
    such dimension are replicated. To also split the batch over the FSDP axis (ZeRO-3: every
    device computes on a different slice), pass ``data_axis=("data", "fsdp")``.
    """
    if fsdp_axis is None:
        raise ValueError("fsdp_axis is required; use data_parallel(mesh) to replicate parameters")
    return Rules(mesh, data_axis=data_axis, fsdp_axis=fsdp_axis, min_size=min_size)


def _field(path) -> str | None:
    if not path:
        return None
    k = path[0]
    return getattr(k, "name", getattr(k, "key", None))


def state_shardings(state: T, rules: Rules) -> T:
    """A tree like ``state`` whose leaves are the ``NamedSharding`` each array goes to.

    Leaves under ``state.params`` and ``state.opt_state`` follow ``rules.param_sharding``;
    every other leaf (gears, detector, site state, step) is replicated.
    """

    def one(path, leaf):
        if _field(path) in _PARAM_FIELDS:
            return rules.param_sharding(leaf)
        return rules.replicated

    return jax.tree_util.tree_map_with_path(one, state)


def batch_shardings(batch: T, rules: Rules) -> T:
    """A tree like ``batch`` of ``NamedSharding``: leading dimension over the data axis.

    Raises:
      ValueError: a leaf's leading dimension is not divisible by the data shards; names the
        leaf (a side array of another length reads as a wrong batch size otherwise).
    """

    def one(path, x):
        try:
            return rules.batch_sharding(x)
        except ValueError as err:
            raise ValueError(f"batch leaf {jax.tree_util.keystr(path)}: {err}") from None

    return jax.tree_util.tree_map_with_path(one, batch)


def shard_state(state: T, rules: Rules) -> T:
    """``state`` placed on ``rules.mesh`` (a no-op for arrays already placed so).

    Every process must pass the same values (the state is global; ``jax.device_put`` keeps
    only each process's own shards).
    """
    return jax.device_put(state, state_shardings(state, rules))


def shard_batch(batch: T, rules: Rules) -> T:
    """``batch`` as global arrays split over the data axis.

    Single process: ``batch`` is the global batch. Multi-process (``jax.distributed``): each
    process passes its own rows (the global batch is their concatenation in process order) and
    ``jax.make_array_from_process_local_data`` assembles the global array — no gather.
    """
    if jax.process_count() == 1:
        return jax.device_put(batch, batch_shardings(batch, rules))

    def one(x):
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            return x  # already global
        x = np.asarray(x)
        if x.ndim == 0:
            return jax.device_put(x, rules.replicated)
        # Global shape: the local rows times the number of processes the data axis spans.
        sharding = NamedSharding(rules.mesh, PartitionSpec(rules.data_axis))
        try:
            return jax.make_array_from_process_local_data(sharding, x)
        except ValueError as err:  # JAX's IndivisibleError names a global size no one passed
            if type(err).__name__ != "IndivisibleError":
                raise
            raise ValueError(
                f"process {jax.process_index()} passed a batch leaf of {x.shape[0]} rows "
                f"(shape {x.shape}), which the data shards on its devices cannot split evenly: "
                "every process must pass the same number of rows each step, a multiple of its "
                "data shards (drop a last short batch); the other processes wait in the step's "
                f"collective until jax.distributed stops them ({err})"
            ) from err

    return jax.tree_util.tree_map(one, batch)


def to_local(tree: T) -> T:
    """A copy of ``tree`` whose arrays are whole on one local device.

    Used to replay a sharded step on one device (``replay.locate_step``): arrays that are not
    fully addressable (multi-host) are first replicated by a jitted identity, so each process
    then holds the whole value and replays it alone, with the same result everywhere.
    """
    dev = jax.local_devices()[0]

    def one(x):
        if not isinstance(x, jax.Array):
            return x
        if not x.is_fully_addressable:
            mesh = getattr(x.sharding, "mesh", None)
            if mesh is None:
                raise ValueError(f"cannot gather an array with sharding {x.sharding}")
            full = NamedSharding(mesh, PartitionSpec())
            x = jax.jit(lambda a: a, out_shardings=full)(x)
            return x.addressable_shards[0].data
        return jax.device_put(x, dev)

    return jax.tree_util.tree_map(one, tree)


def is_replicated(x: jax.Array) -> bool:
    """Whether every addressable shard of ``x`` is a full copy holding the same values."""
    shards = x.addressable_shards
    if any(s.data.shape != x.shape for s in shards):
        return False
    first = np.asarray(shards[0].data)
    return all(np.array_equal(np.asarray(s.data), first, equal_nan=True) for s in shards[1:])


def shards_of(
    rows: Sequence[int],
    batch_size: int,
    mesh: Mesh,
    data_axis: str | tuple[str, ...] = "data",
) -> dict[str, Any]:
    """Which data shard, devices and processes hold the given batch rows.

    Args:
      rows: indices along the batch (leading) dimension, e.g. ``report.channels[0]``.
      batch_size: the global batch size.
      mesh: the mesh the batch was split on.
      data_axis: the mesh axis (or axes) the batch was split over.

    Returns:
      ``{"data_axis", "num_shards", "rows_per_shard", "shards": [shard indices],
      "devices": [device ids], "processes": [process indices],
      "by_shard": [{"shard", "rows", "devices", "processes"}, ...]}``. Shard ``k`` holds rows
      ``[k * rows_per_shard, (k + 1) * rows_per_shard)``; each is held by every device of the
      mesh at that data coordinate (all of them along the other axes).

    Raises:
      ValueError: ``batch_size`` is not divisible by the number of shards, or a row is out of
        range.
    """
    rules = Rules(mesh, data_axis=data_axis)
    sharding = rules.batch_sharding(np.empty((batch_size,), np.int8))
    n = rules.num_data_shards
    per = batch_size // n
    rows = sorted({int(r) for r in rows})
    bad = [r for r in rows if not 0 <= r < batch_size]
    if bad:
        raise ValueError(f"rows {bad} are outside a batch of {batch_size}")
    holders: dict[int, list] = {}
    for dev, idx in sharding.devices_indices_map((batch_size,)).items():
        start = idx[0].start or 0
        holders.setdefault(start // per, []).append(dev)
    by_shard = []
    for k in sorted({r // per for r in rows}):
        devs = sorted(holders.get(k, []), key=lambda d: d.id)
        by_shard.append(
            {
                "shard": k,
                "rows": [r for r in rows if r // per == k],
                "devices": [d.id for d in devs],
                "processes": sorted({d.process_index for d in devs}),
            }
        )
    return {
        "data_axis": data_axis if isinstance(data_axis, str) else list(data_axis),
        "num_shards": n,
        "rows_per_shard": per,
        "shards": [s["shard"] for s in by_shard],
        "devices": sorted({d for s in by_shard for d in s["devices"]}),
        "processes": sorted({p for s in by_shard for p in s["processes"]}),
        "by_shard": by_shard,
    }


def resolve(mesh: Mesh | None, rules: Rules | None) -> Rules | None:
    """The rules for ``make_train_step`` / ``Trainer`` given either or both arguments.

    ``mesh`` alone means ``data_parallel(mesh)`` over its first axis; ``rules`` alone uses its
    mesh; neither means no sharding (None).

    Raises:
      ValueError: both are given and ``rules.mesh`` is a different mesh.
    """
    if rules is None and mesh is None:
        return None
    if rules is None:
        return data_parallel(mesh, data_axis=_auto(mesh).axis_names[0])
    if not isinstance(rules, Rules):
        raise ValueError(f"rules must be nan2safe.sharding.Rules, got {type(rules).__name__}")
    if mesh is not None and (
        _auto(mesh).devices.tolist() != rules.mesh.devices.tolist()
        or tuple(mesh.axis_names) != tuple(rules.mesh.axis_names)
    ):
        raise ValueError(f"mesh {mesh} differs from the rules' mesh {rules.mesh}; pass one")
    return rules
