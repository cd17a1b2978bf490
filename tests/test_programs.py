"""``programs.py``: the FAST-only program for all-FAST states, the general one for the rest."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from tiny_models import D, data, loss_fn

import nan2safe_jax as nan2safe
from nan2safe_jax import Config, Gear, TrainState, make_train_step, programs
from nan2safe_jax import gear as G

pytestmark = pytest.mark.two_programs


class SiteNet(nnx.Module):
    """``nan2safe.nn`` sites (each op a gear switch in the general program)."""

    def __init__(self, *, rngs, dtype=jnp.float32):
        kw = dict(dtype=dtype, rngs=rngs)
        self.fc1 = nan2safe.nn.Linear(D, 2 * D, **kw)
        self.norm = nan2safe.nn.LayerNorm(2 * D, **kw)
        self.fc2 = nan2safe.nn.Linear(2 * D, 1, **kw)

    def __call__(self, x):
        return self.fc2(jax.nn.relu(self.norm(self.fc1(x))))


def _state(dtype=jnp.float32, cfg=None):
    cfg = cfg or Config()
    model = SiteNet(rngs=nnx.Rngs(0), dtype=dtype)
    return TrainState.create(model, nan2safe.optax.guard(optax.adam(1e-3), cfg), cfg)


def _conds(jaxpr) -> int:
    """``cond`` equations anywhere in ``jaxpr`` (inside calls, loops and branches too)."""
    return str(jaxpr).count("cond[")


def _outside_conds(jaxpr) -> set[str]:
    """The primitives ``jaxpr`` runs outside every ``cond`` (looking into ``jit`` calls)."""
    names = set()
    for e in jaxpr.eqns:
        names.add(e.primitive.name)
        if e.primitive.name in ("jit", "pjit"):
            names |= _outside_conds(e.params["jaxpr"].jaxpr)
    return names


def test_the_fast_program_traces_no_gear_switch():
    step = make_train_step(loss_fn)
    state = _state(jnp.float16)
    x, y = data(1)
    batch = (x[0], y[0])
    fast = _conds(jax.make_jaxpr(step.jitted_fast)(state, batch).jaxpr)
    general = _conds(jax.make_jaxpr(step.jitted)(state, batch).jaxpr)
    # The general step holds a switch per site op, forward and backward; the FAST program only
    # the step's own conds (the checkpoint-step finiteness check), which the general one holds.
    assert general - fast >= 6, (fast, general)


def test_all_fast_states_run_the_fast_program_with_the_general_programs_numbers():
    """The same numbers up to rounding (fp16, where rounding shows most): the general
    program's ``cond`` per op is a fusion boundary, so a reduction there can round in another
    order (a few fp16 ulps)."""
    dtype, tol = jnp.float16, 4e-3
    step = make_train_step(loss_fn)
    general = make_train_step(loss_fn, fast_program=False)
    x, y = data(4)
    a = b = _state(dtype)
    for i in range(4):
        a, ma = step(a, (x[i], y[i]))
        b, mb = general(b, (x[i], y[i]))
        for k in ("loss", "grad_norm", "risk", "next_gear", "skipped"):
            np.testing.assert_allclose(np.asarray(ma[k]), np.asarray(mb[k]), rtol=tol, err_msg=k)
    for la, lb in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b), strict=True):
        np.testing.assert_allclose(
            np.asarray(la, np.float32), np.asarray(lb, np.float32), rtol=tol, atol=tol
        )


def _program(step) -> str:
    """Which program ran ``step``'s last call."""
    return step.programs[0].last_program


@pytest.fixture(scope="module")
def step():
    """One two-program step shared by the tests that follow its choices."""
    return make_train_step(loss_fn, fast_program=True)


def test_a_gear_change_picks_the_general_program_and_back(step):
    x, y = data(1)
    batch = (x[0], y[0])
    state, m = step(_state(), batch)
    assert _program(step) == "fast" and bool(m["next_all_fast"])
    state = state.replace(gear=G.set_site(state.gear, "norm", Gear.SAFE))
    state, m = step(state, batch)
    assert _program(step) == "general" and int(m["site_gears"]["norm"]) == Gear.SAFE
    state = state.replace(gear=G.set_site(state.gear, "norm", Gear.FAST))
    state, m = step(state, batch)
    assert _program(step) == "fast"


def test_a_downshift_decided_in_the_step_moves_the_next_step_to_the_general_program(step):
    """The gears the step decides (here: SAFE's dwell of one step ends in STABLE, not FAST) pick
    the next program through ``metrics["next_all_fast"]``, not a read of the gears."""
    cfg = Config(safe_max_steps=1)
    x, y = data(3)
    state = _state(cfg=cfg)
    state = state.replace(gear=G.set_site(state.gear, "fc1", Gear.SAFE, cfg=cfg))
    state, m = step(state, (x[0], y[0]))
    assert _program(step) == "general"
    assert bool(m["next_all_fast"]) == programs.all_fast(state.gear)
    assert not bool(m["next_all_fast"])  # SAFE -> STABLE
    state, m = step(state, (x[1], y[1]))
    assert _program(step) == "general"


def test_background_compile_makes_the_first_gear_change_compile_nothing(
    count_compiles, monkeypatch
):
    """With the background compile on, the general program is built while the FAST one trains:
    the first downshift then compiles nothing."""
    monkeypatch.setenv("NAN2SAFE_BACKGROUND_COMPILE", "1")
    step = make_train_step(loss_fn)
    x, y = data(2)
    state, _ = step(_state(), (x[0], y[0]))
    safe = state.replace(gear=G.set_site(state.gear, "norm", Gear.SAFE))
    step.wait_compiled()
    with count_compiles() as c:
        _, m = step(safe, (x[1], y[1]))
        jax.block_until_ready(m)
    assert c.count == 0
    assert _program(step) == "general" and int(m["site_gears"]["norm"]) == Gear.SAFE


def test_a_closed_trainer_leaves_no_background_compile_running(monkeypatch, tmp_path):
    """``Trainer.close`` waits for the background compile: one left running after ``close``
    held gigabytes and slowed the next trainer's steps 2-3x (a notebook's create/fit/close)."""
    monkeypatch.setenv("NAN2SAFE_BACKGROUND_COMPILE", "1")
    tr = nan2safe.Trainer(SiteNet(rngs=nnx.Rngs(0)), optax.adam(1e-3), loss_fn, Config(), tmp_path)
    x, y = data(1)
    tr.fit([(x[0], y[0])], steps=1)
    futures = [f for made in tr.step_fn.programs for f in made._aot.values()]
    assert futures  # the general program was compiling in the background
    tr.close()
    assert all(f.done() for f in futures)


def test_a_fast_only_gear_traces_no_switch_even_sliced_inside_scan_or_an_inner_jit():
    """A ``fast_only_gear`` (here stacked and sliced per layer inside ``scan``, as in an
    ``nnx.scan`` stack, and passed into an inner ``jax.jit``) traces the FAST branch alone; the
    same functions with an int32 gear keep their switch (the inner jit's cache keys on dtype)."""
    from jax import lax

    from nan2safe_jax.ops import dispatch

    branches = [lambda x: x * 2.0, lambda x: x * 3.0, lambda x: x * 4.0]
    inner = jax.jit(lambda g, c: dispatch.switch(g, branches, c))

    def f(x, gears):
        return lax.scan(lambda c, g: (inner(g, c), None), x, gears)[0]

    x = jnp.float32(1.0)
    fast = jax.make_jaxpr(f)(x, dispatch.fast_only_gear((3,)))
    general = jax.make_jaxpr(f)(x, jnp.zeros((3,), jnp.int32))
    assert _conds(fast) == 0 and _conds(general) == 1
    assert float(jax.core.eval_jaxpr(fast.jaxpr, fast.consts, x, np.zeros(3, np.uint8))[0]) == 8
    out = jax.core.eval_jaxpr(general.jaxpr, general.consts, x, jnp.full((3,), 2, jnp.int32))
    assert float(out[0]) == 64.0
    for g in (Gear.FAST, Gear.STABLE, Gear.SAFE):  # a known gear: that branch alone, every layer
        gears = dispatch.known_gear(g, (3,))
        known = jax.make_jaxpr(f)(x, gears)
        assert _conds(known) == 0
        out = jax.core.eval_jaxpr(known.jaxpr, known.consts, x, gears)
        assert float(out[0]) == (2.0 + g) ** 3


def test_known_gears_are_each_sites_effective_gear_where_its_layers_agree():
    """The key of tier 2's replay program: the stricter of level and site gear, per site; a
    stacked site whose layers differ is left out (it keeps a switch)."""
    gs = G.GearState.create({"emb": (), "blocks": (3,), "head": ()})
    assert programs.known_gears(gs) == (("emb", 0), ("blocks", 0), ("head", 0))
    gs = G.set_site(G.set_level(gs, Gear.STABLE), "head", Gear.SAFE)
    assert programs.known_gears(gs) == (("emb", 1), ("blocks", 1), ("head", 2))
    gs = G.set_site(G.set_level(gs, Gear.FAST), "blocks", Gear.SAFE, index=1)
    assert programs.known_gears(gs) == (("emb", 0), ("head", 2))


def test_one_site_out_of_fast_runs_a_partial_program_with_the_general_programs_numbers(
    monkeypatch,
):
    """With the background compile on, a state with one site in SAFE (every other gear FAST)
    starts a partial program: the general one runs the steps until it is built, then it runs
    them, with the general program's numbers, through SAFE -> STABLE without another build;
    a level above FAST goes back to the general program."""
    monkeypatch.setenv("NAN2SAFE_BACKGROUND_COMPILE", "1")
    cfg = Config(safe_max_steps=2)
    step = make_train_step(loss_fn)
    x, y = data(6)
    a = _state(cfg=cfg)
    a = a.replace(gear=G.set_site(a.gear, "norm", Gear.SAFE, cfg=cfg))
    a, ma = step(a, (x[0], y[0]))
    ran = [(_program(step), int(ma["site_gears"]["norm"]))]
    b = a  # from here, the general program's own steps (its jit, compiled by the first step)
    step.wait_compiled()
    for i in range(1, 5):
        a, ma = step(a, (x[i], y[i]))
        b, mb = step.jitted(b, (x[i], y[i]))
        ran.append((_program(step), int(ma["site_gears"]["norm"])))
        for k in ("loss", "grad_norm", "risk", "next_gear", "skipped"):
            np.testing.assert_allclose(np.asarray(ma[k]), np.asarray(mb[k]), rtol=1e-5, err_msg=k)
        np.testing.assert_array_equal(ma["site_gears"]["norm"], mb["site_gears"]["norm"])
    assert ran[0] == ("general", Gear.SAFE)
    assert ran[1:] == [
        ("partial", Gear.SAFE),
        ("partial", Gear.STABLE),
        ("partial", Gear.STABLE),
        ("partial", Gear.STABLE),
    ], ran
    assert list(step.programs[0]._aot).count(frozenset({"fc1", "fc2"})) == 1
    for la, lb in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b), strict=True):
        np.testing.assert_allclose(
            np.asarray(la, np.float32), np.asarray(lb, np.float32), rtol=1e-5, atol=1e-6
        )
    a = a.replace(gear=G.set_level(a.gear, Gear.STABLE))
    a, _ = step(a, (x[5], y[5]))
    assert _program(step) == "general"


def test_the_partial_program_traces_a_switch_only_in_the_sites_not_fast():
    from nan2safe_jax.train import train_step

    state = _state()
    x, y = data(1)
    batch = (x[0], y[0])

    def conds(**kw):
        return _conds(jax.make_jaxpr(lambda s, b: train_step(s, b, loss_fn, **kw))(state, batch))

    fast, general = conds(fast_only=True), conds()
    norm_only = conds(fast_sites=frozenset({"fc1", "fc2"}))
    assert fast < norm_only < general, (fast, norm_only, general)


@pytest.mark.parametrize("gear", [Gear.FAST, Gear.STABLE, Gear.SAFE])
def test_a_switched_gear_runs_only_the_taken_path_with_its_own_gradient(gear):
    """``switched_gear``: one plain ``lax.switch`` (no FAST computed and dropped), the value and
    gradient of the taken path, as the int32 gear's switch gives them."""
    from nan2safe_jax.ops import dispatch

    branches = [lambda x: jnp.sin(x) * 2.0, lambda x: jnp.cos(x) * 3.0, lambda x: x**3]
    x = jnp.linspace(-1.0, 1.0, 5)

    def f(g, x):
        return jnp.sum(dispatch.switch(g, branches, x))

    plain = jax.make_jaxpr(jax.grad(f, argnums=1))(dispatch.switched_gear(gear), x)
    assert _conds(plain.jaxpr) == 2  # forward and backward
    top = _outside_conds(plain.jaxpr)
    assert "sin" not in top and "cos" not in top  # FAST is not computed outside the switch
    geared = jax.make_jaxpr(jax.grad(f, argnums=1))(jnp.int32(gear), x)
    assert "sin" in _outside_conds(geared.jaxpr)  # the int32 gear's is
    got = jax.value_and_grad(f, argnums=1)(dispatch.switched_gear(gear), x)
    want = jax.value_and_grad(lambda x: jnp.sum(branches[gear](x)))(x)
    ref = jax.value_and_grad(f, argnums=1)(jnp.int32(gear), x)
    for a, b, c in zip(got, want, ref, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6)
        np.testing.assert_allclose(a, c, rtol=1e-6)


def test_the_fast_program_decides_the_next_gears_the_general_program_decides():
    """The FAST-only program reads an all-FAST state's gears as constants (``gear.known_fast``):
    after a calm step, a non-finite loss (a downshift) and a batch with a NaN (data: the gears
    stay), its next gears and gear metrics are the general program's, bit for bit."""
    step = make_train_step(loss_fn)
    general = make_train_step(loss_fn, fast_program=False)
    x, y = data(3)
    batches = {
        "calm": (x[0], y[0]),
        # squares of 2.2e38 whose sum passes f32 (a target past 2**64 would be polluted data)
        "non-finite loss": (x[1], jnp.full_like(y[1], 1.5e19)),
        "polluted": (x[2].at[0, 0].set(jnp.nan), y[2]),
    }
    for what, batch in batches.items():
        a, ma = step(_state(), batch)
        assert _program(step) == "fast", what
        b, mb = general(_state(), batch)
        got, want = jax.tree_util.tree_leaves(a.gear), jax.tree_util.tree_leaves(b.gear)
        for u, v in zip(got, want, strict=True):
            np.testing.assert_array_equal(np.asarray(u), np.asarray(v), err_msg=what)
        for k in ("next_gear", "next_all_fast", "incident", "polluted", "skipped"):
            assert bool(ma[k]) == bool(mb[k]), (what, k)
        assert {k: int(v) for k, v in ma["site_gears"].items()} == {
            k: int(v) for k, v in mb["site_gears"].items()
        }, what
    assert int(a.gear.level) == Gear.FAST  # the polluted batch left the gears alone


def test_locate_step_takes_the_step_make_train_step_returns():
    """``replay.locate_step(step, state, batch)`` with the step a user holds: it replays the
    program that step runs for ``state`` (FAST-only for an all-FAST state, else general), as
    the Trainer does; the step itself commits its state on the host and cannot be traced."""
    from tiny_models import make_fragile

    from nan2safe_jax import replay

    model, tx, lf, cfg = make_fragile()
    state = TrainState.create(model, tx, cfg)
    step = make_train_step(lf)
    x, y = data(1)
    bad = (x[0].at[3, :].set(1.5), y[0])  # a constant row: 0/0 in the fragile norm
    assert programs.program_for(step, state) is step.jitted_fast
    report = replay.locate_step(step, state, bad)
    assert report.primitive in ("div", "sqrt", "rsqrt") and report.site == "blocks.0"
    direct = replay.locate_step(step.jitted_fast, state, bad)
    assert (report.primitive, report.site, report.source) == (
        direct.primitive,
        direct.site,
        direct.source,
    )
    moved = state.replace(gear=G.set_level(state.gear, Gear.STABLE))
    assert programs.program_for(step, moved) is step.jitted
    assert programs.program_for(lf, state) is lf  # any other function: as it is
    assert programs.replay_programs(step, state) == [step.jitted_fast]


def test_out_of_fast_tier_2_replays_the_step_with_its_gears_as_constants(monkeypatch):
    """Out of FAST, tier 2 replays the step traced with the state's gears as constants (one
    path per op, no switch: the general program computes FAST too, and instruments every
    path). Both name the same culprit. The fidelity check runs the executable that ran the
    step (the background compile's), not a compile of it anew."""
    from nan2safe_jax import replay

    monkeypatch.setenv("NAN2SAFE_BACKGROUND_COMPILE", "1")
    step = make_train_step(loss_fn)
    x, y = data(2)
    bad = (x[0] * 3e4, y[0])  # fc1's f16 matmul overflows but in SAFE
    state, _ = step(_state(jnp.float16), (x[1], y[1]))
    step.wait_compiled()
    moved = state.replace(gear=G.set_level(state.gear, Gear.STABLE))
    _, m = step(moved, bad)
    assert _program(step) == "general" and not bool(m["finite"])
    known = step.jitted_known(programs.known_gears(moved.gear))
    assert programs.replay_programs(step, moved) == [known, step.jitted]
    others = [((n, g),) for n in ("a", "b", "c", "d", "e") for g in (1, 2)]
    made = [step.jitted_known(k) for k in others]  # past MAX_KNOWN gear sets: none more
    assert sum(f is not None for f in made) == programs.MAX_KNOWN - 1
    assert step.jitted_known(programs.known_gears(moved.gear)) is known  # kept
    other = moved.replace(gear=G.set_site(moved.gear, "norm", Gear.SAFE))
    assert programs.replay_programs(step, other) == [step.jitted]
    stable, replayed = replay.locate_replayed(step, moved, bad)
    assert step.jitted._cache_size() == 0  # the general program was not compiled again
    general = replay.locate_step(step.jitted, moved, bad, check=False)
    assert replayed is known and stable.reproducible
    assert (stable.primitive, stable.site, stable.source, stable.diagnosis) == (
        general.primitive,
        general.site,
        general.source,
        general.diagnosis,
    )
    assert (stable.primitive, stable.site) == ("convert_element_type", "fc1")
    assert not any(isinstance(e, tuple) and e[0] == "branch" for e in stable.eqn_path)
    assert any(isinstance(e, tuple) and e[0] == "branch" for e in general.eqn_path)


def test_a_first_program_that_does_not_fail_gives_way_to_the_one_that_ran(monkeypatch):
    """Should the program traced with the gears as constants not fail where the step did (XLA
    may compile it differently), the last program (the general one, which ran the step) is
    replayed, checked against its own outputs. The first one here closes over an array: the
    replay cache keeps it apart from the jitted function it calls."""
    from nan2safe_jax import replay

    ran = jax.jit(lambda x, w: jnp.log(x * w))
    w = jnp.ones(4)

    def finite(x, w_):  # calls the same jitted body with another operand
        return ran(x, w)

    monkeypatch.setattr(programs, "replay_programs", lambda step, state: [finite, ran])
    x = jnp.array([1.0, 2.0, 3.0, 4.0])
    report, replayed = replay.locate_replayed(None, x, -w)
    alone = replay.locate_step(ran, x, -w)
    assert replayed is ran and report.reproducible
    assert report.primitive == alone.primitive == "log"
    assert report.eqn_path == alone.eqn_path
