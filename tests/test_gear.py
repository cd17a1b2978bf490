"""Gear transitions: downshift, staged recovery, SAFE dwell and back-off, jit round-trips."""

import jax
import jax.extend.core as jex_core
import jax.numpy as jnp
import numpy as np
import pytest

from nan2safe_jax import Config, Gear, GearState
from nan2safe_jax import gear as G

CFG = Config(safe_max_steps=3, recovery_window=5)


def _state():
    return GearState.create({"attn": (), "blocks.norm": (4,)})


def _run(gs, risks, nonfinite=None, calm=None):
    for i, r in enumerate(risks):
        nf = False if nonfinite is None else nonfinite[i]
        gs = G.decide(gs, r, nf, CFG, calm=None if calm is None else calm[i])
    return gs


def test_gear_values():
    assert (Gear.FAST, Gear.STABLE, Gear.SAFE) == (0, 1, 2)


@pytest.mark.parametrize("jit", [False, True])
def test_risk_downshifts_fast_to_stable(jit):
    decide = jax.jit(G.decide, static_argnums=3) if jit else G.decide
    gs = decide(_state(), 0.5, False, CFG)
    assert int(gs.level) == Gear.FAST
    gs = decide(gs, 1.0, False, CFG)
    assert int(gs.level) == Gear.STABLE
    assert int(gs.downshifts) == 1


def test_nonfinite_downshifts_even_without_risk():
    gs = G.decide(_state(), 0.0, True, CFG)
    assert int(gs.level) == Gear.STABLE


def test_recovery_needs_recovery_window_calm_steps():
    gs = G.decide(_state(), 1.0, False, CFG)
    gs = _run(gs, [0.0] * (CFG.recovery_window - 1))
    assert int(gs.level) == Gear.STABLE
    gs = _run(gs, [0.0])
    assert int(gs.level) == Gear.FAST
    assert int(gs.recoveries) == 1


def test_a_noisy_step_restarts_the_calm_count():
    gs = G.decide(_state(), 1.0, False, CFG)
    gs = _run(gs, [0.0] * 4 + [0.0] + [0.0] * 3, calm=[True] * 4 + [False] + [True] * 3)
    assert int(gs.level) == Gear.STABLE


def test_site_safe_dwell_then_staged_recovery():
    gs = G.set_site(_state(), "attn", Gear.SAFE, cfg=CFG)
    assert int(G.effective(gs, "attn")) == Gear.SAFE
    assert bool(G.any_safe(gs))
    gs = _run(gs, [0.0] * (CFG.safe_max_steps - 1))
    assert int(gs.sites["attn"]) == Gear.SAFE
    gs = _run(gs, [0.0])
    assert int(gs.sites["attn"]) == Gear.STABLE  # never SAFE -> FAST directly
    gs = _run(gs, [0.0] * CFG.recovery_window)
    assert int(gs.sites["attn"]) == Gear.FAST


def test_backoff_doubles_the_stay_of_a_repeat_offender():
    gs = G.set_site(_state(), "attn", Gear.SAFE, cfg=CFG)
    assert int(gs.safe_left["attn"]) == CFG.safe_max_steps
    gs = _run(gs, [0.0] * CFG.safe_max_steps)
    gs = G.set_site(gs, "attn", Gear.SAFE, cfg=CFG)
    assert int(gs.safe_left["attn"]) == 2 * CFG.safe_max_steps
    gs = G.set_site(gs, "attn", Gear.SAFE, cfg=CFG)
    assert int(gs.safe_left["attn"]) == 4 * CFG.safe_max_steps


def test_one_layer_of_a_stacked_site():
    gs = G.set_site(_state(), "blocks.norm", Gear.SAFE, index=2, cfg=CFG)
    np.testing.assert_array_equal(gs.sites["blocks.norm"], [0, 0, 2, 0])
    gs = G.set_level(gs, Gear.STABLE)
    np.testing.assert_array_equal(G.effective(gs, "blocks.norm"), [1, 1, 2, 1])
    np.testing.assert_array_equal(G.effective(gs, "attn"), 1)


def test_global_safe_returns_to_stable_after_dwell():
    gs = G.set_level(_state(), Gear.SAFE, CFG)
    assert bool(G.any_safe(gs))
    gs = _run(gs, [0.0] * CFG.safe_max_steps)
    assert int(gs.level) == Gear.STABLE


@pytest.mark.parametrize("bad", [3, -1, "fast", None, 1.5, 2.0, True, jnp.float32(1)])
def test_bad_gear_or_site_raises(bad):
    """Floats and bools are refused too: ``int`` truncated 1.5 to STABLE and took True for 1."""
    with pytest.raises(ValueError, match="gear"):
        G.set_level(_state(), bad)
    with pytest.raises(ValueError, match="gear"):
        G.set_site(_state(), "attn", bad)
    with pytest.raises(ValueError, match="unknown site"):
        G.set_site(_state(), "nope", Gear.SAFE)


@pytest.mark.parametrize("good", [2, Gear.SAFE, np.int64(2), jnp.int32(2)])
def test_a_gear_given_as_any_integer_is_taken(good):
    assert int(G.set_site(_state(), "attn", good).sites["attn"]) == Gear.SAFE


def test_index_into_scalar_site_raises():
    with pytest.raises(ValueError, match="not stacked"):
        G.set_site(_state(), "attn", Gear.SAFE, index=0)


@pytest.mark.parametrize("index", [4, 10, -5, 1.0, True, jnp.int32(4), np.array([1])])
def test_an_index_past_a_stack_raises_instead_of_changing_nothing(index):
    """``.at[i].set`` drops an out-of-range write: ``index=6`` of a 6-layer stack left every
    gear FAST, silently."""
    with pytest.raises(ValueError, match=r"stacks 4 layers"):
        G.set_site(_state(), "blocks.norm", Gear.SAFE, index=index)
    last = G.set_site(_state(), "blocks.norm", Gear.SAFE, index=-1)
    assert np.asarray(last.sites["blocks.norm"]).tolist() == [0, 0, 0, 2]
    for i in (np.int64(1), jnp.int32(1), np.array(1)):
        one = G.set_site(_state(), "blocks.norm", Gear.SAFE, index=i)
        assert np.asarray(one.sites["blocks.norm"]).tolist() == [0, 2, 0, 0]
    traced = jax.jit(lambda gs, i: G.set_site(gs, "blocks.norm", Gear.SAFE, index=i))
    assert np.asarray(traced(_state(), 2).sites["blocks.norm"]).tolist() == [0, 0, 2, 0]
    with pytest.raises(ValueError, match="traced value"):
        jax.jit(lambda gs, g: G.set_level(gs, g))(_state(), 1)


def test_gear_state_round_trips_through_jit():
    gs = G.set_site(_state(), "blocks.norm", Gear.SAFE, index=1, cfg=CFG)
    out = jax.jit(lambda s: s)(gs)
    assert jax.tree_util.tree_structure(out) == jax.tree_util.tree_structure(gs)
    for a, b in zip(jax.tree_util.tree_leaves(out), jax.tree_util.tree_leaves(gs), strict=True):
        assert a.dtype == jnp.int32
        np.testing.assert_array_equal(a, b)


def test_site_values_hold_every_site_in_one_vector_against_a_dict():
    """``SiteValues`` reads and writes as the dict of one array per site it replaces (the
    reference), with one pytree leaf, named by its path, through ``jit`` and ``device_get``."""
    rng = np.random.default_rng(0)
    ref = {"a": rng.integers(0, 3, ()), "stack": rng.integers(0, 3, (3,)), "b": np.int32(2)}
    ref = {k: np.asarray(v, np.int32) for k, v in ref.items()}
    sv = G.SiteValues.of({k: jnp.asarray(v) for k, v in ref.items()})
    assert list(sv) == list(ref) and len(sv) == 3 and "stack" in sv and "c" not in sv
    for k, v in ref.items():
        np.testing.assert_array_equal(np.asarray(sv[k]), v)
        assert sv[k].shape == v.shape and sv[k].dtype == jnp.int32
    leaves = jax.tree_util.tree_leaves_with_path(sv)
    assert len(leaves) == 1 and jax.tree_util.keystr(leaves[0][0]) == ".flat"
    ref["stack"] = np.asarray([2, 0, 1], np.int32)
    sv = jax.jit(lambda s: s.set("stack", jnp.asarray([2, 0, 1])))(sv)
    host = jax.device_get(sv)
    assert isinstance(host.flat, np.ndarray)
    for k, v in ref.items():
        np.testing.assert_array_equal(host[k], v)
    np.testing.assert_array_equal(np.asarray(sv.set("b", 0)["b"]), 0)  # scalar broadcast
    assert G.SiteValues.of(sv) is sv


def test_gear_state_keeps_each_per_site_field_in_one_leaf():
    """The per-site fields are one leaf each, whatever the number of sites: the step hands
    over and copies 3 arrays for them, not 3 per site."""
    gs = GearState.create({f"site{i}": () if i % 2 else (2,) for i in range(40)})
    assert len(jax.tree_util.tree_leaves(gs)) == 8
    assert gs.sites.flat.shape == (60,)
    other = GearState.create({"x": ()})
    with pytest.raises(ValueError, match="same sites"):
        G.decide(gs.replace(safe_left=other.safe_left), 0.0, False, CFG)


def test_counters_saturate():
    gs = _state().replace(downshifts=jnp.int32(G.MAX_I32))
    gs = G.decide(gs, 1.0, False, CFG)  # a downshift FAST -> STABLE counts one more
    assert int(gs.level) == Gear.STABLE
    assert int(gs.downshifts) == G.MAX_I32  # held at the top, not wrapped to a negative count


LONG_SAFE = Config(safe_max_steps=10, recovery_window=5)


def _levels(gs, n, cfg, site=None):
    out = []
    for _ in range(n):
        gs = G.decide(gs, 0.0, False, cfg, calm=True)
        out.append(int(gs.level if site is None else G.effective(gs, site)))
    return gs, out


@pytest.mark.parametrize("where", ["site", "global"])
def test_a_safe_stay_longer_than_the_window_still_spends_the_window_in_stable(where):
    # SPEC: SAFE -> STABLE after safe_max_steps, then recovery_window calm steps *in STABLE*.
    cfg = LONG_SAFE
    if where == "site":
        gs, site = G.set_site(_state(), "attn", Gear.SAFE, cfg=cfg), "attn"
    else:
        gs, site = G.set_level(_state(), Gear.SAFE, cfg), None
    gs, levels = _levels(gs, cfg.safe_max_steps + cfg.recovery_window, cfg, site)
    safe, stable = cfg.safe_max_steps - 1, cfg.recovery_window
    assert levels == [Gear.SAFE] * safe + [Gear.STABLE] * stable + [Gear.FAST]
    assert int(gs.recoveries) == 1


def test_calm_steps_in_fast_or_safe_do_not_count():
    cfg = LONG_SAFE
    gs, _ = _levels(_state(), 50, cfg)  # a long calm stretch in FAST
    assert int(gs.calm) == 0
    gs = G.decide(gs, 1.0, False, cfg)  # a (false) alarm
    gs, levels = _levels(gs, cfg.recovery_window, cfg)
    # The alarm costs exactly one recovery window in STABLE.
    assert levels == [Gear.STABLE] * (cfg.recovery_window - 1) + [Gear.FAST]


def test_an_alarm_in_stable_restarts_the_window():
    gs = G.decide(_state(), 1.0, False, LONG_SAFE)
    gs, _ = _levels(gs, LONG_SAFE.recovery_window - 1, LONG_SAFE)
    gs = G.decide(gs, 1.0, False, LONG_SAFE)
    assert int(gs.level) == Gear.STABLE and int(gs.calm) == 0 and int(gs.downshifts) == 1
    gs, levels = _levels(gs, LONG_SAFE.recovery_window, LONG_SAFE)
    assert levels[-2:] == [Gear.STABLE, Gear.FAST]


def _reference_decide(gs, risk, nonfinite, cfg, calm):
    """The policy site by site in NumPy (what ``decide`` computes on one flat vector)."""
    sites = {k: np.asarray(v) for k, v in gs.sites.items()}
    left_in = {k: np.asarray(v) for k, v in gs.safe_left.items()}
    level, lvl_left_in, calm_in = int(gs.level), int(gs.level_safe_left), int(gs.calm)
    below = lambda lv, ss: lv > 0 or any(np.any(g > 0) for g in ss.values())
    in_safe = lambda lv, ss: lv >= 2 or any(np.any(g >= 2) for g in ss.values())
    trigger = risk >= cfg.trigger_risk or nonfinite
    downshift = trigger and level == 0
    ran_in_stable = below(level, sites) and not in_safe(level, sites)
    level = 1 if downshift else level
    lvl_left = lvl_left_in - 1 if level == 2 else 0
    level = 1 if level == 2 and lvl_left <= 0 else level
    new_sites, new_left = {}, {}
    for k, g in sites.items():
        left = np.where(g == 2, left_in[k] - 1, 0)
        new_sites[k] = np.where((g == 2) & (left <= 0), 1, g)
        new_left[k] = np.maximum(left, 0)
    count = calm_in + 1 if calm and not trigger and ran_in_stable else 0
    recover = count >= cfg.recovery_window and not in_safe(level, new_sites)
    recover = recover and below(level, new_sites)
    if recover:
        level, count = 0, 0
        new_sites = {k: np.zeros_like(g) for k, g in new_sites.items()}
    return level, max(lvl_left, 0), new_sites, new_left, count, recover, downshift


@pytest.mark.parametrize("seed", range(4))
def test_decide_matches_a_site_by_site_reference(seed):
    """Random gears, stays and counters over scalar and stacked sites, jitted as the step runs
    it, against the site-by-site reference."""
    rng = np.random.default_rng(seed)
    shapes = {f"s{i}": () if i % 3 else (int(rng.integers(1, 4)),) for i in range(12)}
    decide = jax.jit(G.decide, static_argnums=3)
    for _ in range(30):
        gears = {k: rng.choice(3, size=s, p=[0.6, 0.25, 0.15]) for k, s in shapes.items()}
        left = {k: rng.integers(0, 4, size=s) for k, s in shapes.items()}
        gs = GearState.create(shapes).replace(
            level=jnp.asarray(rng.choice(3, p=[0.6, 0.3, 0.1]), jnp.int32),
            level_safe_left=jnp.asarray(rng.integers(0, 3), jnp.int32),
            sites=G.SiteValues.of({k: jnp.asarray(v, jnp.int32) for k, v in gears.items()}),
            safe_left=G.SiteValues.of({k: jnp.asarray(v, jnp.int32) for k, v in left.items()}),
            calm=jnp.asarray(rng.integers(0, CFG.recovery_window + 1), jnp.int32),
        )
        risk, nonfinite, calm = (
            float(rng.choice([0.0, 1.0])),
            bool(rng.random() < 0.2),
            bool(rng.random() < 0.8),
        )
        new = decide(gs, risk, nonfinite, CFG, calm)
        level, lvl_left, sites, safe_left, count, recover, down = _reference_decide(
            gs, risk, nonfinite, CFG, calm
        )
        assert int(new.level) == level and int(new.level_safe_left) == lvl_left
        assert int(new.calm) == count
        assert int(new.recoveries) == int(recover) and int(new.downshifts) == int(down)
        for k in shapes:
            np.testing.assert_array_equal(np.asarray(new.sites[k]), sites[k], err_msg=k)
            np.testing.assert_array_equal(np.asarray(new.safe_left[k]), safe_left[k], err_msg=k)
            assert new.sites[k].dtype == jnp.int32 and new.sites[k].shape == shapes[k]


def test_decide_compiles_to_a_size_linear_in_the_sites():
    """A flag over all sites is one reduction: the compiled policy for 4x the sites is about
    4x the size, not 16x (a chain of scalar ``or``s per site's output was quadratic)."""

    def hlo_lines(n):
        gs = GearState.create({f"site{i}": () for i in range(n)})
        exe = jax.jit(G.decide, static_argnums=3).lower(gs, 0.0, False, CFG, True).compile()
        return exe.as_text().count("\n")

    small, large = hlo_lines(24), hlo_lines(96)
    assert large < 6 * small, (small, large)


@pytest.mark.parametrize("risk, bad", [(0.0, False), (0.9, False), (0.0, True)])
def test_decide_with_sites_known_fast_is_decide(risk, bad):
    gs = GearState.create({"a": (), "stack": (3,)})
    gs = gs.replace(calm=jnp.int32(CFG.recovery_window), downshifts=jnp.int32(2))
    for calm in (True, False):
        ref = G.decide(gs, risk, bad, CFG, calm=calm)
        got = G.decide(gs, risk, bad, CFG, calm=calm, sites_fast=True)
        assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(ref)
        for a, b in zip(
            jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(ref), strict=True
        ):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
            assert a.dtype == b.dtype


def test_known_fast_holds_every_gear_fast_as_a_constant_and_keeps_the_counters():
    gs = GearState.create({"a": (), "stack": (3,)})
    gs = G.set_site(gs, "stack", Gear.SAFE, index=1, cfg=CFG)
    gs = G.set_level(gs, Gear.STABLE, CFG).replace(downshifts=jnp.int32(4))
    known = G.known_fast(gs)
    assert int(known.level) == Gear.FAST
    for k, v in gs.sites.items():
        assert known.sites[k].shape == v.shape and known.sites[k].dtype == jnp.int32
        assert not np.any(np.asarray(known.sites[k]))
    for field in ("safe_left", "safe_entries"):
        assert getattr(known, field) is getattr(gs, field)
    assert known.downshifts is gs.downshifts and known.calm is gs.calm

    # Traced, every flag over the known gears is a constant: nothing it computes reads the
    # state (XLA folds the rest away). The same flags of the state itself do read it.
    flags = lambda g: (G.any_safe(g), G.any_below_fast(g))  # noqa: E731
    assert not _reads_its_input(lambda g: flags(G.known_fast(g)), gs)
    assert _reads_its_input(flags, gs)


def _reads_its_input(fn, *args) -> bool:
    """Whether an output of ``fn``'s jaxpr depends on one of its inputs."""
    jaxpr = jax.make_jaxpr(fn)(*args).jaxpr
    reads = set(jaxpr.invars)
    for eqn in jaxpr.eqns:
        if any(v in reads for v in eqn.invars if isinstance(v, jex_core.Var)):
            reads.update(eqn.outvars)
    return bool(reads & {v for v in jaxpr.outvars if isinstance(v, jex_core.Var)})
