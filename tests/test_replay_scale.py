"""Tier 2 at real scale: memory, fidelity, while conditions, user lines, literals, rule coverage.

Fast tests of the replay's design (``nan2safe_jax.replay``): what a replay allocates (XLA's memory
analysis of each compiled replay, never wall time), the fidelity check, the while-condition step,
the user line of an equation inside a ``nan2safe.nn`` site, literal non-finite values, and that the
rule table covers every higher-order primitive a train step holds.
"""

from __future__ import annotations

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax import lax

import nan2safe_jax as nan2safe
from nan2safe_jax import replay
from nan2safe_jax.replay import _jax_compat as jc
from nan2safe_jax.replay import rules
from nan2safe_jax.replay.locate import _run

_SRC = inspect.getsource(inspect.getmodule(inspect.currentframe())).splitlines()


def _line(marker: str) -> int:
    hits = [i + 1 for i, s in enumerate(_SRC) if s.rstrip().endswith(f"# FAULT:{marker}")]
    assert len(hits) == 1, marker
    return hits[0]


def _at(src: str | None, marker: str) -> bool:
    return src is not None and src.endswith(f"test_replay_scale.py:{_line(marker)}")


# --------------------------------------------------------------------------------------------
# memory: a replay holds the step's live set plus O(#equations) flags


def test_replays_allocate_the_live_set_not_the_sum_of_intermediates():
    n, size = 120, 128 * 128  # 120 intermediates of 64 KiB: ~7.5 MiB in total, 2 live at a time

    def f(x, w):
        for i in range(n):
            x = jnp.tanh(x @ w) * 1.01 + 0.001 * i
        x = jnp.log(x - 10.0)  # FAULT:deep
        return x.sum()

    x = jnp.full((128, 128), 0.1, jnp.float32)
    w = jnp.eye(128, dtype=jnp.float32) * 0.5
    jaxpr = jax.make_jaxpr(f)(x, w)
    total = sum(
        int(np.prod(v.aval.shape)) * 4 for e in jaxpr.jaxpr.eqns for v in e.outvars
    )  # bytes of every intermediate
    assert total > 100 * size * 4
    report, sess = _run(jaxpr, (x, w), stats=True)
    assert report.primitive == "log" and _at(report.source, "deep")
    assert sess.stats, "no replay was recorded"
    live = 8 * size * 4  # a few arrays of the program's size (the old design: all of them)
    for st in sess.stats:
        # The flags replay returns O(#equations) bools; a capture returns the culprit's operands.
        if st["key"][0] == "flags":
            assert st["output_bytes"] <= 4 * 4 * len(jaxpr.jaxpr.eqns) + 64, st
        assert st["temp_bytes"] <= live and st["temp_bytes"] * 50 < total, (st, total)


# --------------------------------------------------------------------------------------------
# fidelity: the replay must reproduce the production step's non-finite outputs


def test_fidelity_check_reports_a_step_the_replay_does_not_reproduce():
    # Production (a concrete call) differs from what tracing records: as a non-deterministic
    # kernel or a hardware fault would. The replay must say so instead of naming an equation.
    def step(x):
        if isinstance(x, jax.core.Tracer):
            return jnp.log(x + 2.0), x * 2.0
        return jnp.log(x + 2.0), x * jnp.nan

    x = jnp.array([1.0, 2.0])
    r = replay.locate_step(step, x)
    assert not r.reproducible and r.primitive is None
    assert "output 1 is finite in the replay but nan in production" in r.reason
    assert "reason" in str(r)
    # the same step, deterministic: reproducible and located
    r2 = replay.locate_step(lambda x: (jnp.log(x - 2.0), x * 2.0), x)
    assert r2.reproducible and r2.primitive == "log"


def test_a_value_only_the_replay_makes_non_finite_must_reach_productions_failure():
    """An output only the replay makes non-finite is accepted when production failed too
    (XLA's fused step may drop a NaN), but only if the value the replay names can reach an
    output production saw non-finite: a callback that turns NaN on the replay, earlier in the
    program than the real log(0) and feeding another output, was named (review24)."""
    calls = [0]

    def flaky(v):
        calls[0] += 1
        return np.full_like(v, np.nan) if calls[0] >= 2 else v  # 1: the fidelity check's run

    @jax.jit
    def step(w, x):
        shape = jax.ShapeDtypeStruct((x.shape[0], w.shape[1]), w.dtype)
        h = jax.pure_callback(flaky, shape, x @ w)
        return jnp.tanh(h).sum(), jnp.log(w[0, 0] * 0.0 + x[0, 0] * 0.0)  # the real fault

    w, x = jnp.ones((3, 2)), jnp.ones((4, 3))
    r = replay.locate_step(step, w, x)
    assert not r.reproducible and "output 0 is nan in the replay but finite" in r.reason, r
    # the same step without the flaky callback: the log is named
    calls[0] = -(10**9)
    r = replay.locate_step(step, w, x)
    assert r.reproducible and r.primitive == "log", r


def test_fidelity_check_copies_donated_arguments():
    step = jax.jit(lambda x, y: (jnp.log(x - y), x + 1.0), donate_argnums=(0,))
    x, y = jnp.array([1.0, 3.0]), jnp.array([0.0, 5.0])
    r = replay.locate_step(step, x, y)
    assert r.reproducible and r.primitive == "log" and r.channels == {0: [1]}
    assert not x.is_deleted()


# --------------------------------------------------------------------------------------------
# while loops: the condition is checked with the body, the earlier step wins


def _loop(x, cond_at, body_at):
    def cond(c):
        i, x = c
        bad = jnp.log(x[0] - 2.0 + 2.0 * (i != cond_at))  # FAULT:while_cond
        return (i < 6) & (bad < 1.0)

    def body(c):
        i, x = c
        y = jnp.sqrt(x - 2.0 + 10.0 * (i != body_at))  # FAULT:while_body
        return i + 1, x + 0.0 * y  # x is unchanged until y is NaN

    return lax.while_loop(cond, body, (jnp.int32(0), x))[1].sum()


@pytest.mark.parametrize(
    ("cond_at", "body_at", "want"),
    [(2, 4, ("cond", 2)), (3, 1, ("iter", 1)), (2, 2, ("cond", 2)), (0, 9, ("cond", 0))],
)
def test_while_condition_root_and_earlier_step_wins(cond_at, body_at, want):
    x = jnp.array([1.0, 3.0])
    f = lambda x: _loop(x, cond_at, body_at)
    r = replay.locate(jax.make_jaxpr(f)(x), (x,))
    assert r is not None and r.kind == "nan"
    assert want in r.eqn_path, r.eqn_path
    marker = "while_cond" if want[0] == "cond" else "while_body"
    assert r.primitive == ("log" if marker == "while_cond" else "sqrt")
    assert _at(r.source, marker), r.source


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16])
def test_a_vmapped_while_with_a_batched_predicate_is_entered(dtype):
    """Per-example trip counts: the batched loop's predicate is ``bool[B]``; JAX runs the body
    while any holds and keeps a finished example's carry. Example 0 stops after one iteration;
    its body still runs and overflows at iteration 1, in a lane JAX drops: no root. The root
    is example 1's overflow, at iteration 3 (f32) or 4 (fp16)."""
    k = jnp.asarray(1e10 if dtype == jnp.float32 else 10.0, dtype)

    def f(v, start):
        def body(c):
            return c[0] + 1.0, c[1], c[2] * k  # FAULT:vmap_body

        init = (jnp.zeros((), dtype), v, start)
        return lax.while_loop(lambda c: c[0] < c[1], body, init)[2]

    g = jax.vmap(f)
    x = jnp.array([1.0, 5.0], dtype)
    start = jnp.array([1e25 if dtype == jnp.float32 else 1e3, 1.0], dtype)
    ref = np.asarray(g(x, start))
    assert np.isfinite(ref[0]) and np.isinf(ref[1])
    r = replay.locate(jax.make_jaxpr(g)(x, start), (x, start))
    assert r is not None and r.primitive == "mul" and r.diagnosis == "overflow", r
    assert ("iter", 3 if dtype == jnp.float32 else 4) in r.eqn_path, r.eqn_path
    assert _at(r.source, "vmap_body"), r.source


def test_the_entered_body_of_a_vmapped_while_masks_the_finished_lanes_too():
    """The review's second case: in the iteration that overflows example 1's ``mul``, example
    0 (finished) still takes ``sqrt`` of a negative number earlier in the body; the body level
    is entered with JAX's select after it, so the dropped lane's NaN is no root there either."""

    def f(v, start):
        def body(c):
            i, acc, z = c
            acc = acc + jnp.sqrt(v - i - 1.0)
            z = z * 1e10  # FAULT:vmap_mul
            return i + 1.0, acc, z

        init = (jnp.zeros(()), jnp.zeros(()), start)
        return lax.while_loop(lambda c: c[0] < v, body, init)[2]

    x, start = jnp.array([1.0, 5.0]), jnp.array([1.0, 1.0])
    r = replay.locate(jax.make_jaxpr(jax.vmap(f))(x, start), (x, start))
    assert r is not None and r.primitive == "mul" and r.diagnosis == "overflow", r
    assert ("iter", 3) in r.eqn_path and _at(r.source, "vmap_mul"), (r.eqn_path, r.source)


def test_a_nan_a_vmapped_while_makes_only_in_a_finished_lane_is_no_root():
    """The review's case: example 0's body, run after it finished, takes ``sqrt`` of -1; JAX
    drops that lane, so the fault is the ``log`` after the loop (as without ``vmap``)."""

    def f(v):
        def body(c):
            return c[0] + 1.0, c[1] + jnp.sqrt(v - c[0] - 1.0)

        acc = lax.while_loop(lambda c: c[0] < v, body, (jnp.zeros(()), jnp.zeros(())))[1]
        return jnp.log(acc - 100.0)  # FAULT:after_loop

    x = jnp.array([1.0, 5.0])
    r = replay.locate(jax.make_jaxpr(jax.vmap(f))(x), (x,))
    assert r is not None and r.primitive == "log", r
    assert _at(r.source, "after_loop"), r.source


# --------------------------------------------------------------------------------------------
# user line: an equation inside a nan2safe.nn site names the model line that called the site


class _Model(nnx.Module):
    def __init__(self, rngs):
        self.fc = nan2safe.nn.Linear(4, 4, rngs=rngs)
        self.ln = nan2safe.nn.LayerNorm(4, epsilon=0.0, rngs=rngs)

    def __call__(self, x):
        return self.ln(self.fc(x) * 0.0)  # FAULT:site_call


def test_site_equation_reports_the_user_line():
    model = _Model(nnx.Rngs(0))
    graphdef, state = nnx.split(model)

    def loss(state, x):
        return nnx.merge(graphdef, state)(x).sum()

    x = jnp.ones((2, 4))
    r = replay.locate(jax.make_jaxpr(loss)(state, x), (state, x))
    assert r is not None and r.primitive == "rsqrt" and r.site is not None
    assert "nan2safe_jax" in r.source  # the op's own line, inside the library
    assert _at(r.user_source, "site_call"), r.user_source
    assert "called from" in str(r)
    assert r.to_dict()["user_source"] == r.user_source


# --------------------------------------------------------------------------------------------
# literals: a non-finite constant written in the program is named, never "hardware"


def test_cond_branch_returning_a_nan_literal_is_a_constant():
    def f(x, p):
        y = lax.cond(p > 0, lambda x: x + 1.0, lambda x: x * jnp.nan, x)  # FAULT:nan_literal
        return y.sum()

    x = jnp.array([1.0, 2.0])
    r = replay.locate(jax.make_jaxpr(f)(x, 0.0), (x, 0.0))
    assert r is not None and r.diagnosis == "constant" and r.kind == "nan"
    assert ("branch", 0) in r.eqn_path and _at(r.source, "nan_literal")
    assert "not hardware" in r.explanation
    s = replay.locate_step(jax.jit(f), x, 0.0)
    assert s.reproducible and s.diagnosis == "constant"
    assert replay.locate(jax.make_jaxpr(f)(x, 1.0), (x, 1.0)) is None


def test_minus_inf_mask_alone_is_not_a_constant_fault():
    def f(s, m):
        return jax.nn.softmax(jnp.where(m, s, -jnp.inf), axis=-1).sum()

    s, m = jnp.ones((3, 4)), jnp.tril(jnp.ones((3, 4), bool))
    assert replay.locate(jax.make_jaxpr(f)(s, m), (s, m)) is None


# --------------------------------------------------------------------------------------------
# the rule table covers every higher-order primitive of a train step


def _higher_order(jaxpr, seen):
    for e in jaxpr.eqns:
        subs = [v for v in e.params.values() if isinstance(v, (jc.Jaxpr, jc.ClosedJaxpr))]
        subs += [
            x
            for v in e.params.values()
            if isinstance(v, (tuple, list))
            for x in v
            if isinstance(x, (jc.Jaxpr, jc.ClosedJaxpr))
        ]
        if subs:
            seen.add(e.primitive.name)
        for s in subs:
            _higher_order(jc.open_jaxpr(s)[0], seen)
    return seen


@pytest.mark.parametrize("layout", ["unrolled", "scan_remat"])
def test_rule_table_covers_the_train_step(layout):
    from examples.transformer import Transformer, TransformerConfig, lm_loss

    cfg = TransformerConfig(
        num_layers=2, d_model=16, num_heads=2, seq_len=8, vocab=16,
        scan_layers=layout != "unrolled", remat=layout != "unrolled",
    )  # fmt: skip
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    state = nan2safe.TrainState.create(model, nan2safe.optax.guard(_sgd()), nan2safe.Config())
    step = nan2safe.make_train_step(lm_loss)
    batch = {"tokens": jnp.ones((2, 8), jnp.int32), "mask": jnp.ones((2, 8), bool)}
    seen = _higher_order(jax.make_jaxpr(step.jitted)(state, batch).jaxpr, set())
    assert {"jit", "cond"} <= seen
    if layout != "unrolled":
        assert {"scan", "checkpoint"} & seen
    known = rules.RULES.keys() | rules.OPAQUE | rules.COMBINER
    missing = {n for n in seen if n not in known}
    assert not missing, missing


def _sgd():
    import optax

    return optax.sgd(1e-3)


def test_rule_table_dispatches_every_step_rule():
    for name in ("scan", "while", "cond"):
        rule = rules.RULES[name]
        assert rule.kind == "step" and rule.flags and rule.capture and rule.enter
    for name in ("jit", "pjit", "closed_call", "checkpoint", "custom_jvp_call", "custom_vjp_call"):
        assert rules.RULES[name].kind == "call"
