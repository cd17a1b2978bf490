"""replay.magnitude: a culprit whose input was already near overflow is walked back to where
that value was made (an equation whose inputs were far from their range, or an argument).

References: the chain each function is written as (which equation makes the large value, from
which inputs), and NumPy's ``max |x|`` of those values.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import nan2safe_jax as nan2safe
from nan2safe_jax import incidents, nn, replay
from nan2safe_jax.config import Config
from nan2safe_jax.gear import Gear
from nan2safe_jax.replay import magnitude
from nan2safe_jax.report import read_metrics
from nan2safe_jax.supervisor import NanIncidentError

DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]


def _mean_sq(h):
    """A norm's statistic: the sum of ``h**2`` overflows for any ``h`` near the range."""
    return jnp.sum(h.astype(jnp.float32) ** 2 if h.dtype == jnp.float32 else h * h, axis=-1)


def _line(fn, text: str) -> str:
    """``"file.py:LINE"`` of the line of ``fn``'s source that holds ``text``."""
    import inspect

    lines, first = inspect.getsourcelines(fn)
    k = next(i for i, line in enumerate(lines) if text in line)
    return f"{inspect.getsourcefile(fn)}:{first + k}"


def _exp_then_square(x):
    h = jnp.exp(x)  # lands near the top of the dtype
    return _mean_sq(h * 1)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_an_exp_that_lands_near_the_range_is_named_where_the_square_overflows(dtype):
    top = float(jnp.finfo(dtype).max)
    u = np.random.default_rng(0).uniform(0.0, 0.5, size=(3, 4))
    x = jnp.asarray(np.log(0.3 * top) + u, dtype)  # exp(x) in [0.3, 0.5] of the range
    r = replay.locate(jax.make_jaxpr(_exp_then_square)(x), (x,))
    assert r.primitive in ("mul", "integer_pow", "reduce_sum"), r  # the first inf, as before
    m = r.magnitude
    want = float(np.abs(np.exp(np.asarray(x, np.float64))).max())
    assert m is not None and m["origin"]["primitive"] == "exp", m
    assert m["origin"]["source"] == _line(_exp_then_square, "jnp.exp(x)")
    np.testing.assert_allclose(m["max_abs"], want, rtol=2e-2)
    np.testing.assert_allclose(m["inputs_max_abs"], float(np.asarray(x, np.float64).max()))
    assert m["argument"] is None and m["fraction"] >= magnitude.NEAR
    assert "`exp`" in r.explanation and "near overflow" in str(r)


_SQ = jax.jit(_mean_sq)


def _twice(x):
    first = _SQ(x)  # the same jitted jaxpr, called twice: its equations are shared objects
    h = jnp.exp(x + 87.5)  # near the top of f32
    return first + _SQ(h)


def test_a_culprit_in_the_second_call_of_a_jitted_function_is_walked_from_its_own_inputs():
    """The two calls of ``_SQ`` hold the same equation objects: the walk starts from the
    culprit's position (the second call), not the first object equal to it. Located twice:
    the second locate reuses the compiled replays and says the same."""
    x = jnp.asarray(np.random.default_rng(2).uniform(0.0, 0.4, size=(3, 4)), jnp.float32)
    jaxpr = jax.make_jaxpr(_twice)(x)
    first = replay.locate(jaxpr, (x,))
    again = replay.locate(jaxpr, (x,))
    for r in (first, again):
        assert r.magnitude is not None and r.magnitude["origin"]["primitive"] == "exp", r
        assert r.magnitude["origin"]["source"] == _line(_twice, "jnp.exp")
    assert first.magnitude == again.magnitude
    assert first.eqn_path[0] > first.magnitude["origin"]["eqn_path"][0]  # the second call


def _upcast_then_square(x16):
    h = x16.astype(jnp.float32) * 3e35  # 1000 * 3e35: 88% of f32's range
    return jnp.sum(h * h)


def test_a_value_is_measured_in_the_dtype_the_next_equation_reads_it_in():
    """An f16 input of 1000 (1.5% of f16's range) read by f32 arithmetic is far from f32's
    range: the walk stops at the f32 ``mul`` that made the large value, not at the argument."""
    x = jnp.full((2, 3), 1000.0, jnp.float16)
    r = replay.locate(jax.make_jaxpr(_upcast_then_square)(x), (x,))
    m = r.magnitude
    assert m is not None and m["origin"]["primitive"] == "mul" and m["argument"] is None, m
    np.testing.assert_allclose(m["inputs_max_abs"], 1000.0)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_a_mask_fill_at_the_dtypes_minimum_is_not_near_overflow(dtype):
    """flax fills masked logits with ``finfo.min``: such values are no near-overflow input."""
    fill = jnp.asarray([float(jnp.finfo(dtype).min), 1.0, 2.0], dtype)
    assert magnitude.near_input([fill]) == pytest.approx(2.0 / float(jnp.finfo(dtype).max))
    near = jnp.asarray([0.5 * float(jnp.finfo(dtype).max), 1.0], dtype)
    assert magnitude.near_input([near]) == pytest.approx(0.5, rel=1e-2)


def _matmul_then_square(params, x):
    return _mean_sq(x @ params["w"])


def test_a_weight_near_the_range_is_named_as_the_argument_it_is():
    rng = np.random.default_rng(1)
    params = {"w": jnp.asarray(rng.normal(size=(4, 4)) * 3e37, jnp.float32)}
    x = jnp.asarray(rng.normal(size=(2, 4)), jnp.float32)
    r = replay.locate(jax.make_jaxpr(_matmul_then_square)(params, x), (params, x))
    m = r.magnitude
    assert m is not None and m["argument"] == "[0]['w']" and m["origin"] is None, m
    np.testing.assert_allclose(m["max_abs"], np.abs(np.asarray(params["w"])).max(), rtol=1e-6)
    np.testing.assert_allclose(m["origin_fraction"], m["max_abs"] / np.finfo(np.float32).max)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_an_ordinary_overflow_is_not_walked_back(dtype):
    """Inputs far from the range (a square of values at 0.5% of it): the culprit made the
    overflow itself; no magnitude."""
    top = float(jnp.finfo(dtype).max)
    x = jnp.full((2, 4), 0.005 * top, dtype)
    r = replay.locate(jax.make_jaxpr(lambda x: _mean_sq(x * 1))(x), (x,))
    assert r is not None and r.magnitude is None and "near overflow" not in str(r)


def _cast_matmul_then_square(params, x):
    return _mean_sq(x @ params["w"].astype(x.dtype))  # a bf16 layer's f32 master weight


@pytest.mark.parametrize(
    "dtype, scale, named, fn",
    [
        (jnp.float32, 1e35, True, _matmul_then_square),
        (jnp.bfloat16, 1e35, True, _matmul_then_square),
        (jnp.bfloat16, 1e35, True, _cast_matmul_then_square),
        (jnp.float16, 150.0, False, _matmul_then_square),
    ],
    ids=["float32", "bfloat16", "bfloat16-cast-f32-weight", "float16"],
)
def test_a_weight_past_any_healthy_value_is_named_in_a_wide_dtype(dtype, scale, named, fn):
    """A weight at 1e35 (3e-4 of f32's and bf16's range: past anything training makes) read by
    the matmul that made the near-overflow value is named as the argument it is; an fp16
    weight of 150 (0.2% of fp16's range) is an ordinary one: the matmul is the origin."""
    rng = np.random.default_rng(3)
    w_dtype = jnp.float32 if fn is _cast_matmul_then_square else dtype
    params = {"w": jnp.asarray(rng.normal(size=(4, 4)) * scale, w_dtype)}
    lift = 100.0 if scale > 1e30 else 1.0  # x @ w near the range: 1e37 in f32, 1e3 in fp16
    x = jnp.asarray((np.abs(rng.normal(size=(2, 4))) + 1.0) * lift, dtype)
    r = replay.locate(jax.make_jaxpr(fn)(params, x), (params, x))
    m = r.magnitude
    assert m is not None, r
    if named:
        assert m["argument"] == "[0]['w']" and m["origin"] is None, m
    else:
        assert m["origin"]["primitive"] == "dot_general" and m["argument"] is None, m
        assert m["origin_input"] == "[0]['w']", m  # the largest input it read, named


def _exp_layer(c, w):
    h = jnp.exp(c * w)  # iteration 2 lands near the top of f32
    return c, jnp.sum(h * h)


def _weight_layer(c, w):
    return c, jnp.sum((c * w) ** 2)


@pytest.mark.parametrize("layer", [_exp_layer, _weight_layer], ids=["exp", "weight"])
def test_inside_a_scan_the_walk_stays_in_the_culprits_iteration(layer):
    """A scanned stack: the culprit is in iteration 2's body; the walk names the body's ``exp``
    (with the iteration in its path), or the stacked argument whose slice the body's input
    is (a scanned layer's weight)."""
    ws = jnp.asarray([0.1, 0.2, 1.0, 0.3], jnp.float32)
    c = jnp.full((3,), 87.0, jnp.float32)
    if layer is _weight_layer:
        ws, c = ws.at[2].set(1e37), jnp.full((3,), 2.0, jnp.float32)
    f = lambda ws, c: jax.lax.scan(layer, c, ws)[1].sum()  # noqa: E731
    r = replay.locate(jax.make_jaxpr(f)(ws, c), (ws, c))
    assert ("iter", 2) in r.eqn_path, r.eqn_path
    m = r.magnitude
    if layer is _exp_layer:
        assert m["origin"]["primitive"] == "exp" and ["iter", 2] in m["origin"]["eqn_path"]
        assert m["origin"]["source"] == _line(_exp_layer, "jnp.exp")
        np.testing.assert_allclose(m["max_abs"], np.exp(np.float64(87.0)), rtol=1e-5)
    else:  # the body's input is slice 2 of the stacked argument ``ws``: named as such
        assert m["origin"] is None and (m["argument"], m["layer"]) == ("[0]", 2), m
        assert "layer 2 of the stack" in str(r)
        np.testing.assert_allclose(m["max_abs"], 1e37, rtol=1e-6)
        # a body input no argument's slice equals: named as the body's input
        g = lambda ws, c: jax.lax.scan(layer, c, ws * 2)[1].sum()  # noqa: E731
        m = replay.locate(jax.make_jaxpr(g)(ws, c), (ws, c)).magnitude
        assert m["origin"] is None and "iter=2" in m["argument"] and "layer" not in m, m


def _nested(ws, c):
    """A scan of scanned blocks: ``ws[g, l]`` is block ``g``'s layer ``l``."""
    group = lambda c, wg: (c, jax.lax.scan(_weight_layer, c, wg)[1].sum())  # noqa: E731
    return jax.lax.scan(group, c, ws)[1].sum()


def _whole(ws, c):
    """Every iteration reads the whole ``ws[0]`` (closed over), scanned over ``ws[1]``."""
    w, xs = ws
    return jax.lax.scan(lambda c, x: (c, jnp.sum((c * w[2] * x) ** 2)), c, xs)[1].sum()


def _cast_first(ws, c):
    """The f32 stack cast to bfloat16 once, then scanned: the body reads the cast's slice."""
    return jax.lax.scan(_weight_layer, c.astype(jnp.bfloat16), ws.astype(jnp.bfloat16))[1].sum()


def _microbatches(ws, c):
    """A scan over microbatches around a scan over the layers: only the inner one slices
    ``ws``."""
    micro = lambda c, m: (c, jax.lax.scan(_weight_layer, c * m, ws)[1].sum())  # noqa: E731
    return jax.lax.scan(micro, c, jnp.ones((2,), jnp.float32))[1].sum()


def _copies(ws, c):
    """Two equal leaves, neither a parameter: no name."""
    return jax.lax.scan(_weight_layer, c, ws["a"])[1].sum() + 0 * ws["b"].sum()


def _twins(ws, c):
    """The stack and an equal copy (an EMA of the parameters, say): scanned over the first."""
    return jax.lax.scan(_weight_layer, c, ws["params"])[1].sum() + 0 * ws["ema"].sum()


@pytest.mark.parametrize(
    "f, named",
    [
        (_nested, ("[0]", [1, 2])),
        (_whole, ("[0][0]", None)),
        (_cast_first, ("[0]", 2)),
        (_twins, ("[0]['params']", 2)),
        (_microbatches, ("[0]", 2)),
        (_copies, None),
    ],
    ids=["nested", "whole", "cast", "twins", "microbatches", "copies"],
)
def test_a_body_input_is_named_as_the_argument_it_is_through_nested_scans_casts_and_copies(
    f, named
):
    """helper-80: the walk's body input is named as the program's argument it is in each
    layout (nested scans: both layers; a scan over microbatches around the scan over layers:
    the inner one's; a weight every iteration reads: the whole argument; a stack cast before
    the scan; a parameter with an equal copy: the parameter; two equal copies of which none
    is a parameter: none, the body's input). Each was
    named the body's input before, so a huge stacked weight was never rolled back."""
    ws = jnp.asarray([0.1, 0.2, 1e37, 0.3], jnp.float32)
    if f is _nested:
        ws = jnp.stack([jnp.asarray([0.1, 0.2, 0.5, 0.3]), ws])
    elif f is _whole:
        ws = (ws, jnp.ones((4,), jnp.float32))
    elif f is _twins:
        ws = {"params": ws, "ema": ws}
    elif f is _copies:
        ws = {"a": ws, "b": ws}
    c = jnp.full((3,), 2.0, jnp.float32)
    r = replay.locate(jax.make_jaxpr(f)(ws, c), (ws, c))
    m = r.magnitude
    assert m is not None and m["origin"] is None, (r, m)
    if named is None:  # ambiguous: the body's input, as before
        assert "of the body at" in m["argument"] and "layer" not in m, m
        return
    assert (m["argument"], m.get("layer")) == named, m
    np.testing.assert_allclose(m["max_abs"], 1e37, rtol=1e-2)


class _Two(nnx.Module):
    """A Linear whose output lands near the range (neither its input nor its weight is), then
    a LayerNorm whose statistics overflow on it: two sites."""

    def __init__(self, *, rngs):
        self.lin = nn.Linear(4, 4, rngs=rngs)
        self.norm = nn.LayerNorm(4, rngs=rngs)

    def __call__(self, x):
        return self.norm(self.lin(x))


def test_the_site_that_made_the_near_overflow_input_goes_to_safe_with_the_culprits(
    tmp_path, monkeypatch
):
    """The decision puts both sites in SAFE; the Trainer logs a ``safe_enter`` for each, the
    second with ``cause: "magnitude origin"``, and runs on with both at SAFE."""
    model = _Two(rngs=nnx.Rngs(0))
    model.lin.kernel[...] = jnp.full((4, 4), 3e34, jnp.float32)  # 1e-4 of the range
    state = nan2safe.TrainState.create(model, optax.sgd(1e-3))
    step = nan2safe.make_train_step(lambda m, b: jnp.mean(m(b) ** 2))
    x = jnp.full((2, 4), 1e3, jnp.float32)  # output 4 * 1e3 * 3e34 = 1.2e38: 35% of the range
    _, metrics = step(state, x)
    assert not bool(metrics["finite"])
    cfg = Config()
    decision = incidents.decide(step, state, x, state, {}, cfg)
    r = decision.report
    assert r.site == "norm" and r.magnitude is not None, r
    assert r.magnitude["origin"]["site"] == "lin" and r.magnitude["origin"]["primitive"] == (
        "dot_general"
    )
    new = decision.gear
    assert int(np.max(np.asarray(new.sites["norm"]))) == Gear.SAFE
    assert int(np.max(np.asarray(new.sites["lin"]))) == Gear.SAFE
    assert decision.enter["site"] == "norm" and decision.enter["also"]["site"] == "lin"
    assert "site lin, which made its near-overflow input" in decision.action

    # The Trainer, given this decision for the same failing step (its replay is the one above).
    monkeypatch.setattr(incidents, "decide", lambda *a, **k: decision)
    cfg = Config(checkpoint_every=5, safe_max_steps=3, recovery_window=8, min_history=8)
    with nan2safe.Trainer(
        model, optax.sgd(1e-3), lambda m, b: jnp.mean(m(b) ** 2), cfg, tmp_path
    ) as tr:
        tr.fit([x], steps=1)
        ev = tr.events
        gear = tr.state.gear
    enters = [e for e in ev if e["type"] == "safe_enter"]
    assert [(e["site"], e.get("cause")) for e in enters] == [
        ("norm", None),
        ("lin", "magnitude origin"),
    ], enters
    assert enters[1]["steps"] == decision.enter["also"]["steps"] and enters[1]["step"] == 0
    assert [int(np.max(np.asarray(gear.sites[s]))) for s in ("norm", "lin")] == [Gear.SAFE] * 2


def test_a_weight_a_bad_update_made_huge_is_rolled_back_at_the_first_incident(tmp_path):
    """newuser48: a weight x1e37 (finite) makes the next LayerNorm's statistics overflow. The
    culprit stays the norm's; its input comes from that parameter, which no gear undoes: the
    first incident rolls back (it was three incidents, SAFE stays at the norm, and the weight
    kept), past checkpoint 7, which holds the weight too, to checkpoint 5."""
    rng = np.random.default_rng(0)
    batches = [jnp.asarray(rng.normal(size=(4, 4)), jnp.float32) for _ in range(14)]
    cfg = Config(checkpoint_every=5, safe_max_steps=3, recovery_window=8, min_history=8)
    loss = lambda m, x: jnp.mean(m(x) ** 2)  # noqa: E731
    with nan2safe.Trainer(_Two(rngs=nnx.Rngs(0)), optax.adam(1e-3), loss, cfg, tmp_path) as tr:
        tr.fit(batches[:7], steps=7)
        huge = jax.tree_util.tree_map_with_path(
            lambda p, a: a * 1e37 if "lin" in str(p) and "kernel" in str(p) else a,
            tr.state.params,
        )
        tr.state = tr.state.replace(params=huge)
        assert tr.save()  # checkpoint 7 holds the weight (finite), as one due after it would
        hist = tr.fit(batches[7:], steps=7)
        ev = tr.events
    (loc,) = [e for e in ev if e["type"] == "locate"]
    assert loc["report"]["site"] == "norm", loc["report"]
    assert loc["report"]["magnitude"]["argument"] == "[0].params['lin']['kernel'].value"
    (rb,) = [e for e in ev if e["type"] == "rollback"]
    assert rb["step"] == 7 and rb["to_step"] == 5 and tr.incidents == 1
    assert rb["passed_over"] == [7] and rb["deleted_checkpoints"] == [7], rb
    assert all(np.isfinite(h["loss"]) for h in hist[1:])
    assert float(jnp.abs(tr.state.params["lin"]["kernel"][...]).max()) < 10


@pytest.mark.parametrize("past_max", [False, True], ids=["rollback", "max_incidents"])
def test_a_weight_huge_in_every_checkpoint_stops_the_run_once_safe_did_not_help(tmp_path, past_max):
    """The fp16 kernel is huge from the start (+5e3: 8% of fp16's range), so every checkpoint
    kept (2, 4, 6: three are kept) holds it; the steps pass while the inputs are small
    (x0.001) and step 6, the first full batch, overflows in the square after the layer (no
    gear reaches it). No rollback removes the weight (helper-80): step 6 tries the gears in
    place instead (the whole model to SAFE: an ``error`` event says why), step 7 fails in
    SAFE, and the run stops with ``NanIncidentError`` naming the weight and the checkpoints,
    restoring and deleting nothing, the trainer left before step 7 (``fit`` had already run
    step 8 on the failed step's result). Before, the newest ones were passed over and
    deleted, checkpoint 2 restored all the same, and the run stopped two incidents later,
    saying the fault followed the step count. The stop at ``max_incidents`` (incidents
    before this one counted in) finds every checkpoint holding it at step 6 and leaves the
    trainer before that step."""
    rng = np.random.default_rng(0)
    xs = [jnp.asarray(rng.normal(size=(4, 4)), jnp.float32) for _ in range(10)]
    batches = [(x * (1e-3 if i < 6 else 1.0), 0.0) for i, x in enumerate(xs)]
    cfg = Config(checkpoint_every=2, safe_max_steps=3, recovery_window=8, min_history=8)
    held = r"every checkpoint kept \(steps 2, 4, 6\).*SAFE in place did not help"
    stop = 7
    if past_max:
        held, stop = r"left before step 6: every checkpoint \(2, 4, 6\) holds it", 6
    loss = lambda m, b: jnp.mean(m(b[0])) + b[1] * m.t[...]  # noqa: E731
    model = _Fp16Square(rngs=nnx.Rngs(0))
    model.lin.kernel[...] = model.lin.kernel[...] + jnp.float16(5e3)
    with nan2safe.Trainer(model, optax.sgd(1e-3), loss, cfg, tmp_path) as tr:
        tr.incidents = cfg.max_incidents if past_max else 0  # earlier incidents, elsewhere
        with pytest.raises(NanIncidentError, match=held):
            tr.fit(batches, steps=10)
        ev = tr.events
        counted = tr.incidents - (cfg.max_incidents if past_max else 0)
        assert counted == stop - 5 and tr.step == stop and tr.checkpoints.steps() == [2, 4, 6]
        assert int(tr.state.step) == stop and all(s < stop for s, _ in tr.ring)
        assert float(jnp.abs(tr.state.params["lin"]["kernel"][...]).max()) > 4e3
    assert not [e for e in ev if e["type"] in ("rollback", "stop_restore")], ev
    locs = [e for e in ev if e["type"] == "locate"]
    assert locs[0]["step"] == 6, locs
    assert locs[0]["report"]["magnitude"]["argument"] == "[0].params['lin']['kernel'].value"
    if not past_max:
        tried, stopped = [e for e in ev if e["type"] == "error"]
        assert "no rollback removes it; instead" in tried["detail"] and tried["step"] == 6
        enter = [e for e in ev if e["type"] == "safe_enter"]
        assert enter[0]["step"] == 6 and enter[0]["scope"] == "global", enter
        assert "trainer.save()" in stopped["detail"] and stopped["step"] == 7, stopped


class _Fp16Dense(nnx.Module):
    """An fp16 Linear (f32 parameters) whose output the loss reads in f32."""

    def __init__(self, *, rngs):
        self.lin = nn.Linear(16, 4, dtype=jnp.float16, rngs=rngs)

    def __call__(self, x):
        return self.lin(x).astype(jnp.float32)


def _held_fp16_kernel():
    """``(batches, cfg, model, loss)``: an fp16 layer whose f32 kernel is x3e4 from the start
    (every checkpoint holds it), and 8 batches whose 16-term dot products then pass 65504."""
    rng = np.random.default_rng(0)
    batches = [jnp.asarray(rng.normal(size=(8, 16)), jnp.float32) for _ in range(8)]
    cfg = Config(checkpoint_every=2, safe_max_steps=20, recovery_window=8, min_history=8)
    model = _Fp16Dense(rngs=nnx.Rngs(0))
    model.lin.kernel[...] = model.lin.kernel[...] * 3e4
    return batches, cfg, model, lambda m, x: jnp.mean(m(x) ** 2) * 1e-9


def test_a_weight_huge_in_every_checkpoint_is_carried_by_safe_in_place(tmp_path):
    """The f32 kernel of an fp16 layer is grown too large from the start (x3e4: its fp16 cast
    at ~30% of the range, examples/nnx_cnn.py's fault), so every checkpoint holds it, and the
    layer's 16-term dot products pass 65504. No rollback removes it; SAFE at the layer, in
    place (f32 arithmetic, saturated back to fp16), carries the run: one incident, the
    ``error`` event saying why, the layer in SAFE, every later loss finite. Before, the
    oldest checkpoint was restored and replayed into the same fault until the run stopped.
    With short SAFE and STABLE stays, the layer returns to FAST and fails again: each time
    the gears are tried in place again, never a rollback or a stop (review helper-84)."""
    batches, cfg, model, loss = _held_fp16_kernel()
    with nan2safe.Trainer(model, optax.sgd(1e-3), loss, cfg, tmp_path) as tr:
        hist = tr.fit(batches, steps=8)
        ev = tr.events
    assert tr.incidents == 1 and not [e for e in ev if e["type"] == "rollback"], ev
    (tried,) = [e for e in ev if e["type"] == "error"]
    assert "['lin']['kernel']" in tried["detail"] and "site lin -> SAFE" in tried["detail"]
    assert [e["site"] for e in ev if e["type"] == "safe_enter"] == ["lin"]
    bad = [i for i, h in enumerate(hist) if not np.isfinite(h["loss"])]
    assert len(bad) == 1 and tried["step"] == hist[bad[0]]["step"] and bad[0] < len(hist) - 2

    short = cfg.replace(safe_max_steps=1, recovery_window=2)
    model = _held_fp16_kernel()[2]
    with nan2safe.Trainer(model, optax.sgd(1e-3), loss, short, tmp_path / "short") as tr:
        tr.fit(batches * 3, steps=24)
        ev = tr.events
    tried = [e for e in ev if e["type"] == "error"]
    assert tr.incidents >= 2 and len(tried) == tr.incidents, [e["type"] for e in ev]
    assert all("no rollback removes it; instead" in e["detail"] for e in tried), tried
    assert not [e for e in ev if e["type"] in ("rollback", "stop_restore")]


def test_a_damaged_state_is_rolled_back_while_a_weight_every_checkpoint_held_is_still_huge(
    tmp_path,
):
    """The layer of the test above is carried by SAFE in place (its kernel huge in every
    checkpoint), then its bias turns NaN (a flipped bit): the damaged state is rolled back to
    the newest finite checkpoint all the same, which still holds the huge kernel, and the run
    goes on finite. Before, the damage took the held weight's path (the gears in place, the
    NaN kept), and that path read the weight's range from the damage report, which names no
    weight: a ``TypeError`` out of ``fit``."""
    batches, cfg, model, loss = _held_fp16_kernel()
    with nan2safe.Trainer(model, optax.sgd(1e-3), loss, cfg, tmp_path) as tr:
        tr.fit(batches[:4], steps=4)
        assert [e["type"] for e in tr.events if e["type"] == "error"] == ["error"]
        saved = tr.checkpoints.steps()[-1]
        params = tr.state.params
        params["lin"]["bias"] = params["lin"]["bias"].at[0].set(jnp.nan)
        tr.state = tr.state.replace(params=params)
        hist = tr.fit(batches[4:], steps=4)
        ev = tr.events
        assert np.isfinite(np.asarray(tr.state.params["lin"]["bias"])).all()
        assert float(jnp.abs(tr.state.params["lin"]["kernel"][...]).max()) > 1e3
    (damaged,) = [e for e in ev if e["type"] == "damaged"]
    (rb,) = [e for e in ev if e["type"] == "rollback"]
    assert rb["cause"] == "damaged" and rb["step"] == damaged["step"] and rb["to_step"] == saved
    assert len([e for e in ev if e["type"] == "error"]) == 1, ev
    assert all(np.isfinite(h["loss"]) for h in hist[1:]), hist


def _report(site, origin_site=None, argument=None):
    """A report of a culprit at ``site`` whose near-overflow input came from an equation of
    ``origin_site`` or from ``argument``."""
    from nan2safe_jax.replay.report import Report

    origin = None if origin_site is None else {"primitive": "dot_general", "site": origin_site}
    magnitude_ = {
        "fraction": 0.5, "max_abs": 1e37, "origin_fraction": 0.03, "inputs_max_abs": 1.0,
        "steps": 1, "origin": origin, "argument": argument,
    }  # fmt: skip
    return Report.no_equation(
        kind="inf", inputs=[], channels={}, diagnosis="overflow", explanation="", replays=0,
        seconds=0.0, primitive="reduce_sum", site=site, magnitude=magnitude_,
    )  # fmt: skip


def test_an_unsited_culprits_decision_follows_the_maker_or_the_huge_parameter():
    gs = nan2safe.TrainState.create(_Two(rngs=nnx.Rngs(0)), optax.sgd(1e-3)).gear
    cfg = Config()
    # The culprit is in no site, its input's maker is: the maker alone goes to SAFE, the hint
    # (culprit outside every site) kept.
    d = incidents._downshift(_report(None, origin_site="lin"), gs, gs, cfg)
    assert d.enter["site"] == "lin" and d.hint is not None and not d.restore
    assert int(np.max(np.asarray(d.gear.sites["lin"]))) == Gear.SAFE
    assert int(np.max(np.asarray(d.gear.sites["norm"]))) == Gear.FAST
    # A maker already in SAFE saturated its output there: the whole-model fallback.
    ran = nan2safe.gear.set_site(gs, "lin", Gear.SAFE, cfg=cfg)
    d = incidents._downshift(_report(None, origin_site="lin"), ran, ran, cfg)
    assert d.enter["scope"] == "global"
    # A parameter as the origin: a rollback, whether the culprit is in a site or not.
    arg = "[0].params['lin']['kernel'].value"
    for site in (None, "norm"):  # the rollback alone, at the checkpoint's gears, no hint
        d = incidents._downshift(_report(site, argument=arg), gs, gs, cfg)
        assert d.restore and d.kind == "located" and "['lin']['kernel']" in d.action, d.action
        assert d.gear is None and d.enter is None and d.hint is None
    # The batch as the origin is no damage of the state.
    d = incidents._downshift(_report("norm", argument="[1]"), gs, gs, cfg)
    assert not d.restore and d.enter["site"] == "norm"


class _Fp16Square(nnx.Module):
    """An fp16 Linear whose output is squared; ``t``'s gradient is the batch's second leaf
    (the trigger of ``_kernel_made_huge``)."""

    def __init__(self, *, rngs):
        self.lin = nn.Linear(4, 4, dtype=jnp.float16, param_dtype=jnp.float16, rngs=rngs)
        self.t = nnx.Param(jnp.zeros((), jnp.float32))

    def __call__(self, x):
        h = self.lin(x.astype(jnp.float16))
        return (h * h).astype(jnp.float32)


def _kernel_made_huge():
    """An optimizer's last stage with a bug: when ``t`` moves (a batch whose second leaf is
    1), it adds 5e3 to ``lin``'s fp16 kernel (8% of fp16's range; an update far below the
    step's own limit on update norms). A replay of that batch makes the weight again."""

    def update(updates, state, params=None):
        del params
        bad = jnp.abs(updates["t"][...]) > 1e-4
        kernel = updates["lin"]["kernel"]
        kernel[...] = kernel[...] + jnp.where(bad, 5e3, 0.0).astype(kernel[...].dtype)
        return updates, state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def test_a_bad_update_the_replay_makes_again_drops_the_replayed_batches_the_second_time(tmp_path):
    """Batch 6 makes ``lin``'s kernel huge (an optimizer bug); step 7's square overflows on
    it. The first rollback, to checkpoint 5, replays batches 5-7 and batch 6 makes the weight
    again; the second rollback to checkpoint 5 for the same weight drops the replayed batches
    (as a second "damaged" rollback does) and the run goes on. Before, each rollback replayed
    them, until ``max_incidents``."""
    rng = np.random.default_rng(1)
    batches = [(jnp.asarray(rng.normal(size=(4, 4)), jnp.float32), 0.0) for _ in range(10)]
    batches[6] = (batches[6][0], 1.0)
    cfg = Config(checkpoint_every=5, safe_max_steps=3, recovery_window=8, min_history=8)
    loss = lambda m, b: jnp.mean(m(b[0])) + b[1] * m.t[...]  # noqa: E731
    tx = optax.chain(optax.sgd(1e-3), _kernel_made_huge())
    with nan2safe.Trainer(_Fp16Square(rngs=nnx.Rngs(0)), tx, loss, cfg, tmp_path) as tr:
        hist = tr.fit(batches, steps=10)
        ev = tr.events
    rb = [e for e in ev if e["type"] == "rollback"]
    assert [(e["step"], e["to_step"]) for e in rb] == [(7, 5), (7, 5)], [e["type"] for e in ev]
    assert "dropped" not in rb[0] and rb[1]["dropped"] == [5, 6, 7], rb
    arg = "[0].params['lin']['kernel'].value"
    locs = [e for e in ev if e["type"] == "locate"]
    assert [e["report"]["magnitude"]["argument"] for e in locs] == [arg, arg], locs
    # one incident: step 7 failing again on the replay is the same one
    assert tr.incidents == 1 and tr.step == 7  # batches 8 and 9 trained as steps 5 and 6
    assert all(np.isfinite(h["loss"]) for h in hist[-2:])
    assert float(jnp.abs(tr.state.params["lin"]["kernel"][...]).max()) < 10


class _Count(NamedTuple):
    count: jax.Array


def _kernel_made_huge_at(k: int):
    """``_kernel_made_huge``'s bug driven by the optimizer's own step count (as a learning-rate
    schedule is): at its ``k``-th update, whatever the batch."""

    def update(updates, state, params=None):
        del params
        kernel = updates["lin"]["kernel"]
        add = jnp.where(state.count == k, 5e3, 0.0).astype(kernel[...].dtype)
        kernel[...] = kernel[...] + add
        return updates, _Count(state.count + 1)

    return optax.GradientTransformation(lambda params: _Count(jnp.zeros([], jnp.int32)), update)


def test_a_bad_update_the_step_count_makes_stops_once_dropping_batches_did_not_help(tmp_path):
    """The same bug at the optimizer's 6th update, whatever the batch: the second rollback to
    checkpoint 5 drops batches 5-7, and step 7 fails again on new batches (the count comes back
    with the checkpoint). The third stops with ``NanIncidentError`` on checkpoint 5, naming the
    step count, instead of dropping every batch after it (newuser50: a schedule's spike, ``fit``
    returned after 27 of 60 steps, having trained nothing since checkpoint 0)."""
    rng = np.random.default_rng(1)
    batches = [(jnp.asarray(rng.normal(size=(4, 4)), jnp.float32), 0.0) for _ in range(14)]
    cfg = Config(checkpoint_every=5, safe_max_steps=3, recovery_window=8, min_history=8)
    loss = lambda m, b: jnp.mean(m(b[0])) + b[1] * m.t[...]  # noqa: E731
    tx = optax.chain(optax.sgd(1e-3), _kernel_made_huge_at(6))
    with nan2safe.Trainer(_Fp16Square(rngs=nnx.Rngs(0)), tx, loss, cfg, tmp_path) as tr:
        with pytest.raises(NanIncidentError, match="follows the step count"):
            tr.fit(batches, steps=14)
        ev = tr.events
        assert tr.step == 5 and tr.incidents == 2  # (the replay's failure of step 7 is the first)
        assert float(jnp.abs(tr.state.params["lin"]["kernel"][...]).max()) < 10
    rb = [e for e in ev if e["type"] == "rollback"]
    assert [(e["to_step"], e.get("dropped")) for e in rb] == [(5, None), (5, [5, 6, 7])], rb
    assert ev[-1]["type"] == "stop_restore" and ev[-1]["to_step"] == 5, ev[-1]
    # the failed step's metrics line: the gear the trainer was left at, not the one it chose
    last = read_metrics(tmp_path)[-1]
    assert last["step"] == 7 and last["incident"] and last["next_gear"] == Gear.FAST, last


def test_cone_is_the_backward_slice_of_the_culprits_inputs():
    """``magnitude._cone`` against the slice written out: value 1 is made from 0, value 3 from
    2, value 4 from 1; the culprit (record 3) reads 4: the walk can reach 4, 1 and 0, never 2
    or 3. A record that passes a value through (its output shares the input's index) makes
    nothing."""
    ref = lambda *v: (0, frozenset(v))  # noqa: E731
    recs = [
        ("eqn", ref(0), ref(1)),
        ("eqn", ref(2), ref(3)),
        ("eqn", ref(1), ref(4)),
        ("eqn", ref(4), ref(5)),
    ]
    assert magnitude._cone(recs, 3) == {0, 1, 4}
    assert magnitude._cone(recs, 1) == {2}
    passing = [("eqn", ref(0), ref(0)), ("eqn", ref(0, 1), ref(2))]
    assert magnitude._cone(passing, 1) == {0, 1}
    assert magnitude._cone([("given", None, ref(0))], 0) == set()


def test_holds_huge_measures_the_leaf_in_the_range_the_walk_named_it_in():
    """An f32 master weight of 1e3 read through a cast to fp16 is near fp16's range (1.5%): a
    checkpoint holding it is refused; in f32's range it is no damage. A mask fill at exactly
    ``finfo.max`` is not counted; a path the state lacks holds nothing."""
    state = {"params": {"w": jnp.full((3,), 1e3, jnp.float32)}}
    fp16, f32 = float(np.finfo(np.float16).max), float(np.finfo(np.float32).max)
    assert incidents.holds_huge(state, "['params']['w']", fp16)
    assert not incidents.holds_huge(state, "['params']['w']", f32)
    fill = {"params": {"w": jnp.full((3,), f32, jnp.float32)}}
    assert not incidents.holds_huge(fill, "['params']['w']", f32)
    assert incidents.holds_huge({"params": {"w": jnp.full((3,), 1e35)}}, "['params']['w']", f32)
    assert not incidents.holds_huge(state, "['params']['v']", fp16)
    arg = "[0].params['lin']['kernel'].value"
    keystr, top = incidents.huge_state_leaf(_report("norm", argument=arg))
    assert keystr == ".params['lin']['kernel'].value"
    np.testing.assert_allclose(top, 1e37 / 0.03)  # max_abs / origin_fraction
    assert incidents.huge_state_leaf(_report("norm", origin_site="lin")) is None
