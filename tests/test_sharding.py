"""Sharding: data parallel and FSDP on simulated CPU devices, global gear decisions, locate's
shard attribution, checkpoints restored onto a different mesh.

The main pytest process imported JAX with one device, so each multi-device scenario group runs
in a subprocess (this file run as a script) with ``--xla_force_host_platform_device_count`` set
before JAX starts; it prints one JSON line that the tests assert on.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tiny_models, when run as a script

from tiny_models import LLVM_O0, D, Net, data, loss_fn, make_fragile  # noqa: E402

import nan2safe_jax as nan2safe  # noqa: E402
from nan2safe_jax import numerics, probe, sharding  # noqa: E402
from nan2safe_jax.checkpoint import Checkpointer  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
NAN_ROW = 3  # in data shard 0 (rows 0-15 of 32)
BAD_ROW = 20  # in data shard 1 of 2 (rows 16..31 of a 32-row batch)
STEPS = 20


def _run(scenario: str, devices: int, *args: str) -> dict:
    env = dict(os.environ)
    # LLVM at -O0 (a fifth less time): every comparison here is between programs this process
    # compiled alike (sharded against single-device, at a tolerance)
    env["XLA_FLAGS"] = f"{sharding.cpu_simulation_flags(devices)} {LLVM_O0}"
    env["JAX_PLATFORMS"] = "cpu"
    proc = subprocess.run(
        [sys.executable, __file__, scenario, *args],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-6000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ----------------------------------------------------------------- scenarios (in a subprocess)


def _is_key(x) -> bool:
    return jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def _net_state():
    return nan2safe.TrainState.create(Net(rngs=nnx.Rngs(0)), optax.adam(1e-2))


def _scenario_eight(out: Path) -> dict:
    """8 devices: parity, donation, a global downshift, locate's shards, an FSDP checkpoint."""
    assert jax.device_count() == 8, jax.device_count()
    res: dict = {}
    x, y = data(STEPS)
    mesh = sharding.make_mesh((2, 4), ("data", "fsdp"))
    dp = sharding.data_parallel(sharding.make_mesh((8,), ("data",)))
    runs = {
        "single": (None, False),
        "fsdp": (sharding.fsdp(mesh, min_size=64), True),
        "dp": (dp, False),
    }
    states = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for name, (rules, donate) in runs.items():
            step = nan2safe.make_train_step(loss_fn, rules=rules, donate=donate)
            state, hist = _net_state(), []
            for i in range(STEPS):
                old = state
                state, m = step(state, (x[i], y[i]))
                hist.append({k: float(m[k]) for k in ("loss", "grad_norm", "risk", "next_gear")})
            states[name] = state
            res[name] = hist
            if name == "dp":  # what the FAST-only program communicates
                hlo = step.programs[-1].lower(state, sharding.shard_batch((x[0], y[0]), dp))
                hlo = hlo.compile().as_text()
                res["dp_collectives"] = {
                    op: _count_op(hlo, op)
                    for op in ("all-gather", "all-reduce", "all-to-all", "collective-permute")
                }
            if donate:
                res["donated"] = all(a.is_deleted() for a in jax.tree_util.tree_leaves(old.params))
            res[f"{name}_metrics_replicated"] = all(
                a.sharding.is_fully_replicated for a in jax.tree_util.tree_leaves(m)
            )
    res["warnings"] = [str(w.message) for w in caught if "donat" in str(w.message)]
    # Probe statistics of batch-sharded tensors (NaN, +inf, -inf in one shard's rows).
    rng = np.random.default_rng(0)
    res["sharded_stats"] = []
    for shape in [(32, 7), (16, 4, 5), (8,)]:
        v = rng.normal(size=shape) * 3.0
        v.reshape(shape[0], -1)[5, :3] = [np.nan, np.inf, -np.inf][: v[5].size]
        on_one = np.asarray(jax.jit(probe.stats)(jnp.asarray(v, jnp.float32)))
        spread = jax.device_put(jnp.asarray(v, jnp.float32), dp.batch_sharding(v))
        with probe.partitioned():  # as a sharded step traces it (a fresh jit: see its doc)
            on_eight = np.asarray(jax.jit(lambda v: probe.stats(v))(spread))
        res["sharded_stats"].append([on_one.tolist(), on_eight.tolist()])
    res["split_sums"] = _split_sums(dp, sharding.fsdp(mesh, min_size=64))
    res["zero3_gathers"] = _zero3_gathers(mesh, (x[0], y[0]))
    fs = states["fsdp"]
    res["fsdp_specs"] = {
        jax.tree_util.keystr(p): str(a.sharding.spec)
        for p, a in jax.tree_util.tree_flatten_with_path(fs.params)[0]
    }
    res["fsdp_mu_spec"] = str(
        jax.tree_util.tree_leaves(fs.opt_state.skip.inner[1][0].mu)[1].sharding.spec
    )
    # A partial program under FSDP (one site in SAFE, the background compile on): built while
    # the general program runs the first step, then it runs the next, as the general would.
    rules = sharding.fsdp(mesh, min_size=64)
    site = sorted(_net_state().gear.sites)[0]
    ran, losses = [], {}
    os.environ["NAN2SAFE_BACKGROUND_COMPILE"] = "1"
    for fast_program in (True, False):
        step = nan2safe.make_train_step(loss_fn, rules=rules, fast_program=fast_program)
        state = _net_state()
        state = state.replace(gear=nan2safe.gear.set_site(state.gear, site, nan2safe.Gear.SAFE))
        losses[fast_program] = []
        for i in range(3):
            state, m = step(state, (x[i], y[i]))
            losses[fast_program].append(float(m["loss"]))
            if fast_program:
                ran.append(step.programs[-1].last_program)
                step.wait_compiled()
    os.environ["NAN2SAFE_BACKGROUND_COMPILE"] = "0"
    res["partial"] = {"ran": ran, "losses": losses[True], "general_losses": losses[False]}

    # A checkpoint of the FSDP state, for the 4-device scenario to restore.
    ck = Checkpointer(out / "ckpt", async_save=False)
    ck.save(STEPS, fs)
    leaves = [np.asarray(a) for a in jax.tree_util.tree_leaves(fs) if not _is_key(a)]
    np.savez(out / "ckpt_values.npz", *leaves)

    # A fault in data shard 1's slice (one constant row -> 0/0 in a LayerNorm without eps),
    # through the Trainer: locate on gathered arguments, the shard in the event.
    model, tx, lf, cfg = make_fragile()
    rules = sharding.fsdp(mesh, min_size=64)
    tr = nan2safe.Trainer(model, tx, lf, cfg, out / "run", rules=rules)
    tx_, ty_ = data(12, seed=2)
    batches = []
    for i in range(12):
        xi = np.array(tx_[i])
        if i in (8, 9):
            xi[BAD_ROW, :] = 1.5
        if i == 5:
            xi[NAN_ROW, 3] = np.nan  # a polluted batch: data shard 0's rows
        batches.append((jnp.asarray(xi), ty_[i]))
    hist = tr.fit(batches, steps=12)
    res["trainer"] = {
        "events": [
            {k: e.get(k) for k in ("type", "step", "shards", "site", "cause")} for e in tr.events
        ],
        "report_channels": next(
            (e["report"]["channels"] for e in tr.events if e["type"] == "locate"), None
        ),
        "finite": [h["finite"] for h in hist],
        "state_devices": len(jax.tree_util.tree_leaves(tr.state.params)[0].sharding.device_set),
    }
    # The same fault in one step (the trainer's, compiled already): every device's gear state.
    model, tx, lf, cfg = make_fragile()
    step = tr.step_fn
    state = nan2safe.TrainState.create(model, tx, cfg)
    fx, fy = data(4, seed=1)
    for i in range(3):
        state, m = step(state, (fx[i], fy[i]))
    bad = np.array(fx[3])
    bad[BAD_ROW, :] = 1.5
    new, m = step(state, (jnp.asarray(bad), fy[3]))
    lvl = new.gear.level
    res["fault_step"] = {
        "incident": bool(m["incident"]),
        "next_gear": int(m["next_gear"]),
        "level_shards": [int(s.data) for s in lvl.addressable_shards],
        "level_devices": sorted(d.id for d in lvl.sharding.device_set),
        "level_replicated": sharding.is_replicated(lvl) and lvl.sharding.is_fully_replicated,
        "risk_shards": [float(s.data) for s in m["risk"].addressable_shards],
    }

    res["shards_of"] = sharding.shards_of([1, 17, 30], 32, mesh, "data")
    res["shards_of_zero3"] = sharding.shards_of([9], 32, mesh, ("data", "fsdp"))
    return res


D_WIDE = 64


class Mlp(nnx.Module):
    """``d`` inputs, ``hidden`` units, one output. ``Mlp(D_WIDE, 4 * D_WIDE)`` has a kernel past
    ``numerics.SMALL_LEAF`` (its sums go through ``Rules.sum_of_squares``); ``Mlp(D, 2 * D)``
    has kernels over ``min_size=64`` (split under FSDP) and biases under it (replicated)."""

    def __init__(self, d, hidden, *, rngs):
        self.up = nnx.Linear(d, hidden, rngs=rngs)
        self.down = nnx.Linear(hidden, 1, rngs=rngs)

    def __call__(self, x):
        return self.down(jax.nn.relu(self.up(x)))


class Tower(nnx.Module):
    """``depth`` layers of ``D_WIDE x D_WIDE`` (kernels of ``numerics.SMALL_LEAF`` elements,
    each an eighth of the large ones' total or less) before ``Mlp(D_WIDE, 4 * D_WIDE)``
    (its kernel more than an eighth): a data-parallel step on 8 devices sums the small
    kernels a whole one per device (``sharding.balanced_bins``) and slices the big one."""

    def __init__(self, depth, *, rngs):
        self.layers = nnx.List([nnx.Linear(D_WIDE, D_WIDE, rngs=rngs) for _ in range(depth)])
        self.head = Mlp(D_WIDE, 4 * D_WIDE, rngs=rngs)

    def __call__(self, x):
        for layer in self.layers:
            x = jax.nn.relu(layer(x))
        return self.head(x)


def _slice_sizes(hlo: str) -> list[int]:
    """The element counts of the ``dynamic-slice``s in a compiled program's text."""
    return [
        int(np.prod([int(d) for d in m.group(1).split(",") if d]))
        for m in re.finditer(r"= f32\[([\d,]*)\][^\n]*? dynamic-slice\(", hlo)
    ]


def _split_sums(dp, fsdp) -> dict:
    """``Rules.sum_of_squares`` against float64, and a data-parallel step whose gradient and
    update sums take that path against the single-device step."""
    rng = np.random.default_rng(1)
    # One size not divisible by 8; eight of 16 elements that the FSDP rules (min_size=64)
    # replicate over both mesh axes, so 8 devices share them out there too.
    shapes = [(64, 128), (8, 4, 32), (7, 9), (16, 64)] + [(2, 8)] * 8
    xs = [rng.normal(size=s).astype(np.float32) for s in shapes]
    ys = [x * 0.5 + 0.1 for x in xs]
    f64 = lambda a: np.asarray(a, np.float64)  # noqa: E731
    out = {
        "want": float(sum(np.sum(np.square(f64(x))) for x in xs)),
        "want_minus": float(
            sum(np.sum(np.square(f64(x) - f64(y))) for x, y in zip(xs, ys, strict=True))
        ),
    }
    for name, rules in (("dp", dp), ("fsdp", fsdp)):
        put = lambda arrs, rules=rules: [jax.device_put(a, rules.param_sharding(a)) for a in arrs]
        f = jax.jit(rules.sum_of_squares)
        bad = [x.copy() for x in xs]
        bad[0][-1, -1] = np.nan  # in the last device's slice
        bad_share = [x.copy() for x in xs]
        bad_share[-1][-1, -1] = np.nan  # in an array one device sums whole
        out[name] = {
            "sum": float(f(put(xs))),
            "sum_minus": float(f(put(xs), put(ys))),
            "nan": float(f(put(bad))),
            "nan_share": float(f(put(bad_share))),
        }
    # What each device reduces under data parallelism: a slice of an array larger than its
    # share (an eighth of the elements), never a whole one; the smaller arrays whole, one
    # device each: not sliced.
    one = [jax.device_put(xs[0], dp.replicated)]
    hlo = jax.jit(dp.sum_of_squares).lower(one).compile().as_text()
    out["dp_slices"] = _slice_sizes(hlo)
    every = [jax.device_put(x, dp.replicated) for x in xs]
    out["dp_slices_every"] = _slice_sizes(
        jax.jit(dp.sum_of_squares).lower(every).compile().as_text()
    )
    out["size"] = xs[0].size
    # A step of a model with a large parameter: the same gradient and update norms.
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.normal(size=(32, D_WIDE)), jnp.float32)
    y = jnp.asarray(rng.normal(size=(32, 1)), jnp.float32)
    norms = {}
    for name, rules in (("single", None), ("dp", dp)):
        state = nan2safe.TrainState.create(Tower(8, rngs=nnx.Rngs(0)), optax.adam(1e-2))
        assert max(a.size for a in jax.tree_util.tree_leaves(state.params)) >= numerics.SMALL_LEAF
        step = nan2safe.make_train_step(loss_fn, rules=rules)
        state, m = step(state, (x, y))
        state, m2 = step(state, (x, y))
        norms[name] = [float(m["grad_norm"]), float(m2["probes"]["update_norm"][probe.MAX_ABS])]
        if rules is not None:
            batch = sharding.shard_batch((x, y), rules)
            hlo = step.programs[-1].lower(state, batch).compile().as_text()
            out["step_slices"] = _slice_sizes(hlo)
    out["norms"] = norms
    out["wide_size"] = D_WIDE * 4 * D_WIDE
    out["layer_size"] = D_WIDE * D_WIDE
    return out


def _count_op(hlo: str, op: str) -> int:
    """How many ``op`` instructions (or their async ``-start`` halves) a program's text holds."""
    return len(re.findall(rf" {op}(?:-start)?\(", hlo))


def _zero3_gathers(mesh, batch) -> dict:
    """All-gathers of a ZeRO-3 step (batch and parameters over every device; the biases
    replicated) of a plain flax model: nan2safe's FAST-only program and the plain optax step
    with the same placements."""
    rules = sharding.fsdp(mesh, data_axis=("data", "fsdp"), min_size=64)
    tx = optax.adam(1e-2)
    step = nan2safe.make_train_step(loss_fn, rules=rules)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a model without sites, on purpose
        state, _ = step(nan2safe.TrainState.create(Mlp(D, 2 * D, rngs=nnx.Rngs(0)), tx), batch)
    sharded_batch = sharding.shard_batch(batch, rules)
    ours = _count_op(
        step.programs[-1].lower(state, sharded_batch).compile().as_text(), "all-gather"
    )

    graphdef, params = nnx.split(Mlp(D, 2 * D, rngs=nnx.Rngs(0)))
    opt = tx.init(params)

    def plain_step(params, opt, batch):
        g = jax.grad(lambda p: loss_fn(nnx.merge(graphdef, p), batch))(params)
        updates, opt = tx.update(g, opt, params)
        return optax.apply_updates(params, updates), opt

    place = lambda tree: jax.tree_util.tree_map(rules.param_sharding, tree)  # noqa: E731
    batch_sh = jax.tree_util.tree_map(rules.batch_sharding, batch)
    plain = jax.jit(
        plain_step,
        in_shardings=(place(params), place(opt), batch_sh),
        out_shardings=(place(params), place(opt)),
    )
    plain_hlo = plain.lower(params, opt, batch).compile().as_text()
    return {"ours": ours, "plain": _count_op(plain_hlo, "all-gather")}


def _scenario_four(out: Path) -> dict:
    """4 devices: the 8-device checkpoint restores onto a 1x4 mesh; the Trainer resumes."""
    assert jax.device_count() == 4, jax.device_count()
    res: dict = {}
    mesh = sharding.make_mesh((1, 4), ("data", "fsdp"))
    rules = sharding.fsdp(mesh, min_size=64)
    template = sharding.shard_state(_net_state(), rules)
    ck = Checkpointer(out / "ckpt", async_save=False)
    state = ck.restore(STEPS, template)
    saved = np.load(out / "ckpt_values.npz")
    leaves = [a for a in jax.tree_util.tree_leaves(state) if not _is_key(a)]
    res["values_equal"] = len(leaves) == len(saved.files) and all(
        np.array_equal(np.asarray(a), saved[f"arr_{i}"]) for i, a in enumerate(leaves)
    )
    kernel = state.params["blocks"][0]["up"]["kernel"][...]
    res["kernel_spec"] = str(kernel.sharding.spec)
    res["kernel_devices"] = len(kernel.sharding.device_set)
    res["kernel_shard_shape"] = list(kernel.addressable_shards[0].data.shape)
    x, y = data(1, seed=3)
    state, m = nan2safe.make_train_step(loss_fn, rules=rules)(state, (x[0], y[0]))
    res["step_after_restore"] = {"finite": bool(m["finite"]), "step": int(state.step)}

    # The trainer's FSDP checkpoints resume under plain data parallelism on 4 devices.
    model, tx, lf, cfg = make_fragile()
    dp = sharding.data_parallel(sharding.make_mesh((4,), ("data",)))
    tr = nan2safe.Trainer(model, tx, lf, cfg, out / "run", rules=dp)
    res["resumed_replicated"] = all(
        a.sharding.is_fully_replicated for a in jax.tree_util.tree_leaves(tr.state.params)
    )
    res["resume"] = [e for e in tr.events if e["type"] == "resume"]
    res["resumed_devices"] = len(jax.tree_util.tree_leaves(tr.state.params)[0].sharding.device_set)
    hist = tr.fit([(x[0], y[0])] * 2, steps=2)
    res["resumed_fit_finite"] = [h["finite"] for h in hist]
    # A process whose batch its devices cannot split (a last short batch, newuser37): JAX's
    # IndivisibleError named a global size no process passed; the error names the rows. The
    # multi-process branch of shard_batch is taken with process_count patched (4 devices: 3
    # rows cannot split).
    real = jax.process_count
    jax.process_count = lambda: 2
    try:
        dp4 = sharding.data_parallel(sharding.make_mesh((4,), ("data",)))
        sharding.shard_batch({"x": np.zeros((3, 4), np.float32)}, dp4)
        res["short_batch"] = None
    except ValueError as err:
        res["short_batch"] = str(err)
    finally:
        jax.process_count = real
    return res


# ----------------------------------------------------------------- tests


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("sharding")
    eight = _run("eight", 8, str(out))
    four = _run("four", 4, str(out))
    return eight, four


def test_sharded_runs_match_the_single_device_run(runs):
    eight, _ = runs
    single = eight["single"]
    for name in ("fsdp", "dp"):
        for a, b in zip(single, eight[name], strict=True):
            np.testing.assert_allclose(b["loss"], a["loss"], rtol=1e-4, atol=1e-6)
            np.testing.assert_allclose(b["grad_norm"], a["grad_norm"], rtol=1e-4, atol=1e-6)
            assert b["risk"] == a["risk"] and b["next_gear"] == a["next_gear"]
        assert eight[f"{name}_metrics_replicated"]
    assert len(single) == STEPS


def test_probe_statistics_of_a_sharded_batch_match_one_device(runs):
    eight, _ = runs
    for on_one, on_eight in eight["sharded_stats"]:
        np.testing.assert_allclose(on_eight, on_one, rtol=1e-5, atol=1e-30)
    assert eight["sharded_stats"][0][0][probe.NONFINITE] == 2  # NaN and +inf, not -inf


def test_a_data_parallel_step_gathers_nothing(runs):
    """Replicated parameters: the step's only collectives are all-reduces (the gradients', the
    loss's, the probes' sums and maxima, merged by XLA), no gather of probe partial results
    (``probe.partitioned``)."""
    eight, _ = runs
    c = eight["dp_collectives"]
    assert c["all-gather"] == 0 and c["all-to-all"] == 0 and c["collective-permute"] == 0
    assert 1 <= c["all-reduce"] <= 8, c


def test_a_zero3_step_gathers_no_more_than_the_plain_step(runs):
    """The step's sums concatenate only the replicated small leaves
    (``numerics.sum_of_squares(replicated=)``): a split kernel concatenated with the biases made
    XLA split the biases' updates too and gather each back (3 all-gathers here before the fix,
    against the plain step's 1; 207 against 31 in the demo model)."""
    eight, _ = runs
    g = eight["zero3_gathers"]
    assert 0 < g["ours"] <= g["plain"], g


def test_replicated_parameters_are_shared_out_over_the_devices(runs):
    """``Rules.sum_of_squares``: the float64 sums under data parallelism and FSDP; a NaN in
    one device's slice, or in an array one device sums whole (data parallel: 8 devices hold
    each array, ``sharding.SHARE_MIN_DEVICES`` or more), reaches every device; under data
    parallelism an array larger than a device's share is reduced an eighth per device and
    the others whole (no slice of them); a data-parallel step of a model with both kinds has
    the single-device step's gradient and update norms, and slices only the large one."""
    eight, _ = runs
    sp = eight["split_sums"]
    for name in ("dp", "fsdp"):
        assert sp[name]["sum"] == pytest.approx(sp["want"], rel=1e-5)
        assert sp[name]["sum_minus"] == pytest.approx(sp["want_minus"], rel=1e-5)
        assert np.isnan(sp[name]["nan"])
        assert np.isnan(sp[name]["nan_share"])
    assert sp["dp_slices"] and max(sp["dp_slices"]) == sp["size"] // 8, sp["dp_slices"]
    assert set(sp["dp_slices_every"]) == {sp["size"] // 8}, sp["dp_slices_every"]
    np.testing.assert_allclose(sp["norms"]["dp"], sp["norms"]["single"], rtol=1e-5)
    assert sp["wide_size"] // 8 in sp["step_slices"], sp["step_slices"]  # the step's sums, too
    assert sp["layer_size"] // 8 not in sp["step_slices"], sp["step_slices"]


def test_a_partial_program_runs_a_sharded_step_with_a_site_in_safe(runs):
    eight, _ = runs
    p = eight["partial"]
    assert p["ran"] == ["general", "partial", "partial"]
    np.testing.assert_allclose(p["losses"], p["general_losses"], rtol=1e-5)


def test_fsdp_splits_parameters_and_optimizer_state(runs):
    eight, _ = runs
    specs = eight["fsdp_specs"]
    assert specs["['blocks'][0]['up']['kernel'].value"] == "P(None, 'fsdp')"
    assert specs["['blocks'][0]['down']['kernel'].value"] == "P('fsdp', None)"
    assert specs["['blocks'][0]['up']['bias'].value"] == "P()"  # under min_size
    assert eight["fsdp_mu_spec"] == "P('fsdp', None)"  # Adam's mu follows its param


def test_donation_of_the_sharded_state(runs):
    eight, _ = runs
    assert eight["donated"]
    assert eight["warnings"] == []


def test_fault_in_one_shard_downshifts_every_device_alike(runs):
    eight, _ = runs
    f = eight["fault_step"]
    assert f["incident"] and f["next_gear"] == nan2safe.Gear.STABLE
    assert f["level_devices"] == list(range(8))
    assert f["level_shards"] == [nan2safe.Gear.STABLE] * 8
    assert f["level_replicated"]
    assert len(set(f["risk_shards"])) == 1


def test_locate_names_the_data_shard(runs):
    eight, _ = runs
    t = eight["trainer"]
    types = [e["type"] for e in t["events"]]
    assert "downshift" in types and "locate" in types and "safe_enter" in types
    loc = next(e for e in t["events"] if e["type"] == "locate")
    assert loc["step"] == 8
    assert BAD_ROW in t["report_channels"]["0"]
    shards = loc["shards"]
    assert shards["shards"] == [1] and shards["num_shards"] == 2
    (polluted,) = [e for e in t["events"] if e["type"] == "polluted_input"]
    assert polluted["step"] == 5 and polluted["shards"]["shards"] == [0]
    assert polluted["shards"]["by_shard"][0]["rows"] == [NAN_ROW]
    assert shards["by_shard"][0]["rows"] == [BAD_ROW]
    assert shards["devices"] == [4, 5, 6, 7]  # mesh row 1 of the 2x4 mesh
    assert t["finite"][9]  # the site went SAFE: the repeated fault is absorbed
    assert t["state_devices"] == 8


def test_shards_of(runs):
    eight, _ = runs
    s = eight["shards_of"]
    assert s["shards"] == [0, 1] and s["rows_per_shard"] == 16
    assert [b["rows"] for b in s["by_shard"]] == [[1], [17, 30]]
    assert s["by_shard"][0]["devices"] == [0, 1, 2, 3] and s["processes"] == [0]
    z = eight["shards_of_zero3"]  # batch over both axes: 8 shards of 4 rows
    assert z["num_shards"] == 8 and z["shards"] == [2] and z["devices"] == [2]


def test_checkpoint_from_8_devices_restores_on_a_1x4_mesh(runs):
    _, four = runs
    assert four["values_equal"]
    assert four["kernel_devices"] == 4 and four["kernel_spec"] == "P(None, 'fsdp')"
    assert four["kernel_shard_shape"] == [16, 8]
    assert four["step_after_restore"] == {"finite": True, "step": STEPS + 1}
    assert four["resume"] and four["resume"][0]["from_step"] == 10
    assert four["resumed_devices"] == 4 and four["resumed_replicated"]
    assert four["resumed_fit_finite"] == [True, True]
    said = four["short_batch"]
    assert said and "passed a batch leaf of 3 rows" in said and "same number of rows" in said


# ----------------------------------------------------------------- one device, in process


def _best_makespan(sizes: list[int], k: int) -> int:
    """The reference: the smallest possible fullest bin, by exhaustive search (largest item
    first; bins holding the same total are interchangeable, so one of them is tried)."""
    best = sum(sizes)
    items = sorted(sizes, reverse=True)

    def place(n: int, loads: list[int]) -> None:
        nonlocal best
        if n == len(items):
            best = min(best, max(loads))
            return
        for j in range(k):
            if loads[j] in loads[:j] or loads[j] + items[n] >= best:
                continue
            loads[j] += items[n]
            place(n + 1, loads)
            loads[j] -= items[n]

    place(0, [0] * k)
    return best


@pytest.mark.parametrize("k", [1, 2, 3, 5, 8])
def test_balanced_bins_is_a_partition_within_the_lpt_bound_of_the_best(k):
    """``sharding.balanced_bins`` (the devices' shares of ``Rules.sum_of_squares``): ``k`` bins
    holding every index once, the fullest within the longest-processing-time bound
    (4/3 - 1/(3k)) of the best split found by exhaustive search, with up to twice as many
    items as bins; ties go to the lowest bin (every process of a multi-host run must build
    the same program)."""
    rng = np.random.default_rng(k)
    for _ in range(20):
        n = int(rng.integers(0, min(2 * k, 10) + 1))
        sizes = [int(v) for v in rng.integers(1, 1000, size=n)]
        bins = sharding.balanced_bins(sizes, k)
        assert len(bins) == k
        assert sorted(i for b in bins for i in b) == list(range(n))
        if n:
            fullest = max(sum(sizes[i] for i in b) for b in bins)
            assert fullest <= (4 / 3 - 1 / (3 * k)) * _best_makespan(sizes, k) + 1e-9
    assert sharding.balanced_bins([5] * (k + 1), k) == [[0, k]] + [[j] for j in range(1, k)]


def test_rules_validate_their_axes():
    mesh = sharding.make_mesh((1,), ("data",))
    with pytest.raises(ValueError, match="not in the mesh"):
        sharding.fsdp(mesh)
    with pytest.raises(ValueError, match="devices"):
        sharding.make_mesh((2, 4), ("data", "fsdp"))
    with pytest.raises(ValueError, match="Mesh"):
        sharding.data_parallel("data")
    rules = sharding.resolve(mesh, None)
    assert rules.data_axis == "data" and rules.fsdp_axis is None


def test_explicit_mesh_axes_become_auto():
    mesh = jax.make_mesh((1,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
    rules = sharding.data_parallel(mesh)
    assert rules.mesh.axis_types == (jax.sharding.AxisType.Auto,)


def test_donated_steps_with_and_without_a_mesh_agree():
    # TrainState.create shares zero scalars between leaves; XLA refuses to donate a buffer twice.
    rules = sharding.data_parallel(sharding.make_mesh((1,), ("data",)))
    plain = nan2safe.make_train_step(loss_fn, donate=True)
    sharded = nan2safe.make_train_step(loss_fn, rules=rules, donate=True)
    x, y = data(3)
    a, b = _net_state(), _net_state()
    for i in range(3):
        old = a
        a, ma = plain(a, (x[i], y[i]))
        b, mb = sharded(b, (x[i], y[i]))
        assert bool(ma["finite"]) and bool(mb["finite"])
        np.testing.assert_allclose(float(mb["loss"]), float(ma["loss"]), rtol=1e-6)
    assert jax.tree_util.tree_leaves(old.params)[0].is_deleted()
    assert sharded.rules is rules and plain.rules is None


if __name__ == "__main__":
    scenario, out_dir = sys.argv[1], Path(sys.argv[2])
    fn = {"eight": _scenario_eight, "four": _scenario_four}[scenario]
    print(json.dumps(fn(out_dir), default=str))


def test_a_batch_leaf_that_does_not_split_over_the_data_shards_is_named():
    """A side array of another length read as a wrong global batch size; the leaf is named."""
    import types

    def batch_sharding(x):
        if np.shape(x) and np.shape(x)[0] % 2:
            raise ValueError(f"batch leading dimension {np.shape(x)[0]} is not divisible")
        return None

    rules = types.SimpleNamespace(batch_sharding=batch_sharding)
    batch = {"x": np.zeros((8, 4)), "lengths": np.zeros(3)}
    with pytest.raises(ValueError, match=r"batch leaf \['lengths'\]: batch leading dimension 3"):
        sharding.batch_shardings(batch, rules)
