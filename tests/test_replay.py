"""Tests for nan2safe_jax.replay: the tier-2 localizer.

Every fault test asserts the primitive, the user source line (found through a ``# FAULT:<name>``
marker comment in this file, never hard-coded), the kind and the channels, and walks the reported
``eqn_path`` in the jaxpr to check that it reaches an equation of that primitive.
"""

from __future__ import annotations

import inspect
import json
import math
import os
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from nan2safe_jax import ops, probe, replay
from nan2safe_jax.gear import Gear
from nan2safe_jax.replay import Report, cache, locate, locate_step

DTYPES = [jnp.float16, jnp.bfloat16, jnp.float32]
_SRC = inspect.getsource(inspect.getmodule(inspect.currentframe())).splitlines()


def _line(marker: str) -> int:
    hits = [i + 1 for i, s in enumerate(_SRC) if s.rstrip().endswith(f"# FAULT:{marker}")]
    assert len(hits) == 1, marker
    return hits[0]


def _assert_source(r: Report, marker: str) -> None:
    assert r.source is not None and r.source.endswith(f"test_replay.py:{_line(marker)}"), (
        r.source,
        _line(marker),
    )


def _sub_jaxprs(eqn):
    """The jaxpr a call-like or loop equation evaluates, else None."""
    from nan2safe_jax.replay import _jax_compat as jc

    body = jc.call_body(eqn)
    if body is not None:
        return body[0]
    if eqn.primitive.name == "scan":
        return jc.scan_params(eqn)["jaxpr"]
    if eqn.primitive.name == "while":
        return jc.while_params(eqn)["body_jaxpr"]
    return None


def _eqn_at(closed, path):
    """Follows ``path`` (as in Report.eqn_path) from the top jaxpr; returns the equation."""
    from nan2safe_jax.replay import _jax_compat as jc

    jaxpr, eqn = closed.jaxpr, None
    for step in path:
        if isinstance(step, tuple):
            branch = step[0] == "branch"
            jaxpr = jc.cond_branches(eqn)[step[1]][0] if branch else _sub_jaxprs(eqn)
            continue
        if eqn is not None and jc.call_body(eqn) is not None:
            jaxpr = jc.call_body(eqn)[0]
        eqn = jaxpr.eqns[step]
    return eqn


def _check(f, args, primitive, marker, kind, direction="forward"):
    jaxpr = jax.make_jaxpr(f)(*args)
    r = locate(jaxpr, args)
    assert r is not None, "expected a report"
    assert r.primitive == primitive, str(r)
    _assert_source(r, marker)
    assert r.kind == kind, str(r)
    assert r.direction == direction, str(r)
    assert _eqn_at(jaxpr, r.eqn_path).primitive.name == primitive, r.eqn_path
    json.dumps(r.to_dict())
    assert primitive in str(r)
    return r


# --------------------------------------------------------------------------------------------
# operator faults


def _masked_softmax(logits, mask):
    e = jnp.where(mask, jnp.exp(logits - logits.max(-1, keepdims=True)), 0.0)
    return e / e.sum(-1, keepdims=True)  # FAULT:masked_row


@pytest.mark.parametrize("dtype", DTYPES)
def test_fully_masked_row_is_0_over_0_in_div(dtype):
    logits = jnp.linspace(-1, 1, 2 * 5 * 5).reshape(2, 5, 5).astype(dtype)
    mask = jnp.tril(jnp.ones((5, 5), bool))[None].repeat(2, 0)
    mask = mask.at[1, 3].set(False)  # batch 1, query row 3 sees nothing
    r = _check(lambda a, m: _masked_softmax(a, m).sum(), (logits, mask), "div", "masked_row", "nan")
    assert r.diagnosis == "0/0"
    assert r.channels == {0: [1], 1: [3], 2: [0, 1, 2, 3, 4]}
    assert r.output_shape == (2, 5, 5)
    assert r.first_nan is None


def _attn_scores(q, k):
    return jnp.einsum("qd,kd->qk", q, k)  # FAULT:logits


def test_fp16_logit_overflow_blames_dot_general_not_the_mask():
    q = jnp.full((4, 8), 1.0, jnp.float16).at[2].set(300.0)  # query 2 is extreme
    k = jnp.full((4, 8), 0.5, jnp.float16).at[:, 0].set(300.0)

    def attn(q, k):
        s = _attn_scores(q, k)
        s = jnp.where(jnp.tril(jnp.ones((4, 4), bool)), s, -jnp.inf)  # causal mask
        return jax.nn.softmax(s, axis=-1).sum()

    r = _check(attn, (q, k), "dot_general", "logits", "inf")
    assert r.diagnosis == "overflow"
    assert r.channels[0] == [2]
    assert r.first_nan is not None and r.first_nan.primitive == "sub"  # inf - inf in softmax
    assert r.inputs[0]["max_abs"] == 300.0 and r.inputs[0]["nonfinite"] == 0


def _layer_norm(x, eps):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) * lax.rsqrt(var + eps)  # FAULT:rsqrt


@pytest.mark.parametrize("dtype", DTYPES)
def test_layernorm_zero_variance_blames_rsqrt(dtype):
    x = jnp.arange(3 * 6, dtype=jnp.float32).reshape(3, 6).at[1].set(7.0).astype(dtype)
    r = _check(lambda x: _layer_norm(x, 0.0).sum(), (x,), "rsqrt", "rsqrt", "inf")
    assert r.diagnosis == "division by ~0"
    assert r.channels == {0: [1], 1: [0]}
    assert r.first_nan is not None and r.first_nan.primitive == "mul"  # 0 * inf


def test_a_division_by_a_plain_number_that_overflows_is_an_overflow_not_a_division_by_0():
    """fp16 values near 65504 divided by 0.8 (a dropout's ``1 / keep``): an overflow."""

    def f(x):
        return x / jnp.float16(0.8)  # FAULT:div-overflow

    x = jnp.asarray([1.0, 60000.0, 2.0], jnp.float16)
    r = _check(f, (x,), "div", "div-overflow", "inf")
    assert r.diagnosis == "overflow" and r.channels == {0: [1]}, str(r)


def _negative_power(x):
    return x**-0.5  # FAULT:pow


def _big_power(x):
    return x**8  # FAULT:integer-pow


@pytest.mark.parametrize(
    "f, primitive, marker, diagnosis",
    [
        (_negative_power, "pow", "pow", "division by ~0"),
        (_big_power, "integer_pow", "integer-pow", "overflow"),
    ],
    ids=["zero_to_a_negative_power", "big_to_a_positive_power"],
)
def test_a_power_is_a_division_by_0_or_an_overflow_by_its_base(f, primitive, marker, diagnosis):
    """``0 ** -0.5`` divides by ~0; ``1e6 ** 8`` overflows even when another element is 0."""
    x = jnp.asarray([4.0, 0.0, 1e6], jnp.float32)
    r = _check(f, (x,), primitive, marker, "inf")
    assert r.diagnosis == diagnosis, str(r)


@pytest.mark.parametrize("dtype", DTYPES)
def test_where_sqrt_gradient_blames_forward_sqrt(dtype):
    def f(x):
        return jnp.where(x > 0, jnp.sqrt(x), 0.0).sum()  # FAULT:sqrt

    x = jnp.array([4.0, -1.0, 9.0], dtype)
    assert bool(jnp.isfinite(f(x))) and not bool(jnp.isfinite(jax.grad(f)(x)).all())
    r = _check(jax.grad(f), (x,), "sqrt", "sqrt", "nan")
    assert r.channels == {0: [1]}
    assert r.diagnosis == "log/sqrt domain"


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_gather_past_the_vocabulary_is_an_index_out_of_range(dtype):
    """A label past the classes: the gather fills NaN, which is the data's fault, said so (it
    read "other" and a user's own loop put the model in SAFE for it)."""

    def f(logits, labels):
        return jnp.take_along_axis(logits, labels[:, None], axis=-1).sum()  # FAULT:gather

    logits = jnp.linspace(-1, 1, 4 * 8).reshape(4, 8).astype(dtype)
    labels = jnp.asarray([1, 100, 3, 7], jnp.int32)
    r = _check(f, (logits, labels), "gather", "gather", "nan")
    assert r.diagnosis == "index out of range", str(r)
    assert "max 100" in r.explanation and "(4, 8)" in r.explanation, r.explanation


# --------------------------------------------------------------------------------------------
# higher-order forms


def _layer(h, w, g):
    h = jnp.tanh(h @ w)
    return h / g  # FAULT:layer


def _stack(h, ws, gs):
    def body(h, wg):
        return _layer(h, *wg), None

    h, _ = lax.scan(body, h, (ws, gs))
    return (h**2).sum()


@pytest.mark.parametrize("k", [0, 3])
def test_scan_over_layers_names_iteration(k):
    h = jnp.ones((2, 4)) * 0.3
    ws = jnp.stack([jnp.eye(4) * (1.0 + 0.1 * i) for i in range(5)])
    gs = jnp.ones((5, 4)).at[k, 2].set(0.0)
    r = _check(_stack, (h, ws, gs), "div", "layer", "inf")
    assert ("iter", k) in r.eqn_path
    assert r.channels == {0: [0, 1], 1: [2]}
    assert r.diagnosis == "division by ~0"
    if k == 0:
        return
    # the same forward fault is found in a full gradient computation
    r2 = _check(jax.grad(_stack, argnums=1), (h, ws, gs), "div", "layer", "inf")
    assert ("iter", k) in r2.eqn_path


def _geared_stack(x, gears, qks, boosts):
    """A scanned stack of fp16 attention sites (flax's explicit path: fp16 logits), each layer
    with its own gear (a slice of the stacked gear, so the replay learns each switch's branch
    only at run time), a knob that grows layer ``i``'s logits and one that scales its output."""

    def layer(c, xs):
        gear, qk, boost = xs
        q, kw = c * qk, dict(return_stats=True, explicit=True)
        out, stats = ops.attention(q, q, c, gear=gear, **kw)  # FAULT:stack_attn
        return c + out * boost, stats  # FAULT:stack_boost

    y, stats = lax.scan(layer, x, (gears, qks, boosts))
    return jnp.sum(y.astype(jnp.float32)), stats


@pytest.mark.parametrize("gear", [Gear.FAST, Gear.STABLE], ids=["fast", "stable"])
def test_a_dropped_fast_overflow_in_a_scanned_layer_is_not_the_root_of_a_later_fault(gear):
    """Layer 1's fp16 logits overflow. At STABLE its switch drops FAST's values (and the
    backward drops FAST's pullback): STABLE computes the layer finite. Layer 2's output then
    overflows in the model's own ``* boost``. Tier 2 named layer 1's dropped FAST ``dot_general``
    (a newuser32 trial, an nnx.scan decoder put the wrong layer in SAFE): inside the loop body
    the switch's branch was unknown, so it counted as reading FAST's statistics and the forward
    body's FAST residuals as results. At FAST the same overflow is layer 1's fault."""
    x = jnp.asarray(np.random.default_rng(0).normal(size=(2, 8, 2, 8)), jnp.float16)
    gears = jnp.full((3,), int(gear), jnp.int32)
    qks = jnp.asarray([1.0, 300.0, 1.0], jnp.float16)
    boosts = jnp.asarray([1.0, 1.0, 6e4], jnp.float16)
    f = jax.value_and_grad(_geared_stack, has_aux=True)
    if gear == Gear.STABLE:
        (clean, _), _ = f(x, gears, qks, jnp.ones(3, jnp.float16))
        assert np.isfinite(clean)  # STABLE alone keeps layer 1 finite
        r = _check(f, (x, gears, qks, boosts), "mul", "stack_boost", "inf")
        assert ("iter", 2) in r.eqn_path and r.site is None
    else:
        r = locate(jax.make_jaxpr(f)(x, gears, qks, boosts), (x, gears, qks, boosts))
        assert (r.primitive, r.kind, r.direction) == ("dot_general", "inf", "forward"), str(r)
        assert ("iter", 1) in r.eqn_path
        # The op's own line, and the model's that called it: the gear switch's forward rule is
        # traced late (the scan's JVP), and its equations carried the dispatcher's line
        # (newuser34).
        assert r.source.split(":")[0].endswith(os.path.join("nan2safe_jax", "ops", "attention.py"))
        assert r.user_source.endswith(f"test_replay.py:{_line('stack_attn')}"), r.user_source


def _vmapped_experts(x, gears, qks):
    """Experts vmapped with a batched gear (each expert a site of its own): ``vmap`` turns the
    gear switch into ``select_n``s, and hands every branch each operand through one."""

    def expert(c, gear, qk):
        q = c * qk
        return c + ops.attention(q, q, c, gear=gear, explicit=True)

    return jnp.sum(jax.vmap(expert)(x, gears, qks).astype(jnp.float32))


@pytest.mark.parametrize("grad", [False, True], ids=["value", "value_and_grad"])
@pytest.mark.parametrize("fault", [False, True], ids=["dropped", "fast_expert"])
def test_a_batched_gear_drops_fast_where_it_is_not_fast(fault, grad):
    """Expert 1 is at STABLE and its fp16 FAST logits overflow; STABLE computes it finite. The
    program's outputs are finite, yet tier 2 named the dropped FAST ``dot_general``: the copies
    of FAST's value that vmap hands to the STABLE and SAFE branches, which they never read,
    counted as live results (newuser34). When expert 0, at FAST, overflows too, that is the
    fault."""
    x = jnp.asarray(np.random.default_rng(0).normal(size=(2, 1, 8, 2, 8)) * 0.5, jnp.float16)
    gears = jnp.asarray([Gear.FAST, Gear.STABLE], jnp.int32)
    qks = jnp.asarray([300.0 if fault else 1.0, 300.0], jnp.float16)
    f = jax.value_and_grad(_vmapped_experts) if grad else _vmapped_experts
    args = (x, gears, qks)
    assert np.isfinite(_vmapped_experts(*args)) != fault
    r = locate(jax.make_jaxpr(f)(*args), args)
    if not fault:
        assert r is None, str(r)
    else:
        assert (r.primitive, r.kind, r.direction) == ("dot_general", "inf", "forward"), str(r)


def _dropped_where(w, c):
    return jnp.where(c > -1.0, jnp.log(c) + w, 0.0)  # FAULT:dropped_where


def _dropped_select(w, c):
    return lax.select(c > -1.0, jnp.log(c) + w, jnp.zeros_like(w))  # FAULT:dropped_select


def _dropped_cond(w, c):
    return lax.cond(c >= 0, lambda: jnp.log(c) + w, lambda: w)  # FAULT:dropped_cond


@pytest.mark.parametrize(
    "f, marker",
    [
        (_dropped_where, "dropped_where"),
        (_dropped_select, "dropped_select"),
        (_dropped_cond, "dropped_cond"),
    ],
    ids=["where", "select", "cond"],
)
def test_a_fault_in_a_primal_grad_drops_is_named_when_a_masking_op_ends_it(f, marker):
    """``jax.grad`` drops the loss; its ``log(0)`` still counts as live (the README's rule for a
    primal ``jax.grad`` drops). The first exemption for the vmapped experts above (every dead
    masking equation's unread result) lost these (review21); only a dead copy is exempt."""
    w, c = jnp.float32(0.5), jnp.float32(0.0)
    assert np.isfinite(jax.grad(f)(w, c))
    _check(jax.grad(f), (w, c), "log", marker, "inf")


def _naive_softmax(x):
    e = jnp.exp(x)  # FAULT:naive_exp
    return e / jnp.sum(e, axis=-1, keepdims=True)


def _softmax_site_then_square(w0, w, x, gear):
    """A hand-written fp16 softmax geared as a site (FAST: itself; above it: f32 softmax) on an
    input a parameter scales, then the model's own ``h * h * w``."""
    x = x * w0

    def safe(x):
        return jax.nn.softmax(x.astype(jnp.float32), axis=-1).astype(x.dtype)

    h = ops.switch(gear, [_naive_softmax, safe, safe], x) + x
    return jnp.mean((h * h * w).astype(jnp.float32))  # FAULT:square_after_site


@pytest.mark.parametrize(
    "gear, big, want",
    [
        (Gear.FAST, 20.0, ("exp", "naive_exp")),
        (Gear.SAFE, 20.0, None),
        (Gear.SAFE, 1000.0, ("mul", "square_after_site")),
    ],
    ids=["fast", "safe_clean", "safe_then_fault"],
)
def test_a_site_above_fast_is_not_blamed_for_what_its_dropped_residuals_observe(gear, big, want):
    """At SAFE the site's FAST ``exp`` overflows and is dropped, yet the forward still computes
    FAST's residuals from it: ``sum(e) ** -2`` turns the inf into a finite 0, an observation in
    the forward prefix's eyes, which does not replay the backward that drops it. Tier 2 named
    the site's ``exp`` in a step whose results were all finite, and for the model's own later
    overflow (newuser36, a user ``nn.Site``). The scalar ``select_n`` that drops those residuals
    above FAST now drops them in the replay, as a ``cond`` drops a branch."""
    f16 = jnp.float16
    x = jnp.ones((2, 8), f16).at[0, 0].set(big)
    args = (jnp.ones(8, f16), jnp.ones(8, f16), x, jnp.int32(gear))
    g = jax.value_and_grad(_softmax_site_then_square, argnums=(0, 1))
    if want is None:
        assert all(np.isfinite(a).all() for a in jax.tree.leaves(g(*args)))
        r = locate(jax.make_jaxpr(g)(*args), args)
        assert r is None, str(r)
    else:
        _check(g, args, want[0], want[1], "inf")


def _flag_is_predicate_and_case(x, q, y):
    p = jnp.all(jnp.isfinite(jnp.log(x)))  # FAULT:observed_log
    return jnp.where(p, p, q), y * 1e30 * 1e30


def test_a_pick_whose_index_is_also_an_operand_still_reads_the_index():
    """``where(p, p, q)``: ``p`` is the predicate and a case. With ``q`` taken, the need pass
    counted ``p``'s read as dropped with the untaken case, lost the ``isfinite`` that observed
    the ``log(0)``, and named the later overflow (review22). A pick's index is read whatever
    it picks (a run-time ``cond`` whose index is an operand too follows the same rule)."""
    args = (jnp.zeros(3), jnp.bool_(True), jnp.ones(3))
    _check(_flag_is_predicate_and_case, args, "log", "observed_log", "inf")


def _fast_with_a_dead_result(x):
    _ = x * 1e4  # overflows, and nothing reads it
    return jax.nn.softmax(x.astype(jnp.float32), axis=-1).astype(x.dtype)


def test_a_dead_result_of_a_sites_fast_code_is_not_blamed_above_fast():
    """FAST computes a value nothing reads, and it overflows. A result nothing reads counts as
    live (a primal ``jax.grad`` drops), so at SAFE, in a finite step, tier 2 named it (the
    README's limit until 2026-12-06). Each branch is now a ``jit`` call of its own
    (``ops.dispatch._traced_now``), whose body's dead code the replay knows as dead."""

    def safe(x):
        return jax.nn.softmax(x.astype(jnp.float32), axis=-1).astype(x.dtype)

    def f(w0, x, gear):
        h = ops.switch(gear, [_fast_with_a_dead_result, safe, safe], x * w0)
        return jnp.mean(h.astype(jnp.float32))

    x = jnp.full((2, 8), 100.0, jnp.float16)
    args = (jnp.ones(8, jnp.float16), x, jnp.int32(Gear.SAFE))
    g = jax.value_and_grad(f)
    assert all(np.isfinite(a).all() for a in jax.tree.leaves(g(*args)))
    r = locate(jax.make_jaxpr(g)(*args), args)
    assert r is None, str(r)


def _grow(i, x):
    return x * 2  # FAULT:grow


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dynamic", [False, True], ids=["scan", "while"])
def test_fori_loop_names_iteration(dtype, dynamic):
    k = 3
    x0 = jnp.full((3,), float(jnp.finfo(dtype).max) * 0.75 / 2**k, dtype).at[0].set(1.0)

    def f(x, n):
        return lax.fori_loop(0, n if dynamic else 6, _grow, x).sum()

    r = _check(f, (x0, jnp.int32(6)), "mul", "grow", "inf")
    want = "while" if dynamic else "scan"
    assert any(e.primitive.name == want for e in jax.make_jaxpr(f)(x0, 6).jaxpr.eqns)
    assert ("iter", k) in r.eqn_path
    assert r.channels == {0: [1, 2]}
    assert r.diagnosis == "overflow"


def test_cond_branch():
    def f(x, p):
        return lax.cond(p > 0, lambda x: x + 1, lambda x: jnp.log(x) * 2, x).sum()  # FAULT:cond

    x = jnp.array([1.0, -2.0])
    r = _check(f, (x, 0.0), "log", "cond", "nan")
    assert ("branch", 0) in r.eqn_path
    assert locate(jax.make_jaxpr(f)(x, 1.0), (x, 1.0)) is None  # the other branch is clean


def test_inside_checkpoint_forward_and_grad():
    @jax.checkpoint
    def block(x):
        y = jnp.sin(x)
        return jnp.log(y)  # FAULT:remat

    f = lambda x: block(x).sum()
    x = jnp.array([1.0, 4.0, 2.0])
    r = _check(f, (x,), "log", "remat", "nan")
    assert r.channels == {0: [1]}
    assert len(r.eqn_path) == 2  # entered the remat equation
    _check(jax.grad(f), (x,), "log", "remat", "nan")


@jax.custom_vjp
def _scaled(x, s):
    return x * s


def _scaled_fwd(x, s):
    return x * s, (s,)


def _scaled_bwd(res, g):
    (s,) = res
    return g / s, jnp.zeros_like(s)


_scaled.defvjp(_scaled_fwd, _scaled_bwd)


def test_custom_vjp_backward_rule_fault():
    # JAX records the *call site* of a custom_vjp function for the equations its bwd rule emits
    # (the rule runs at transpose time under the call's source info), so that is the line named.
    def loss(x, s):
        return (_scaled(x, s) ** 2).sum()  # FAULT:cvjp

    x, s = jnp.array([1.0, 2.0, 3.0]), jnp.array([1.0, 0.0, 2.0])
    assert bool(jnp.isfinite(loss(x, s)))
    r = _check(jax.grad(loss), (x, s), "div", "cvjp", "nan", direction="backward")
    assert "transpose(" in r.name_stack
    assert r.channels == {0: [1]}
    assert r.diagnosis == "0/0"  # g = 2 * x * s = 0 at the zero scale


def test_backward_only_overflow_is_backward():
    def f(x):
        return x * x  # FAULT:bwd

    def vjp(x, ct):
        return jax.vjp(f, x)[1](ct)[0]

    x = jnp.array([200.0, 1.0], jnp.float16)
    ct = jnp.array([1000.0, 1.0], jnp.float16)
    r = _check(vjp, (x, ct), "mul", "bwd", "inf", direction="backward")
    assert r.channels == {0: [0]}


def test_nested_jit():
    @jax.jit
    def inner(x):
        @jax.jit
        def innermost(y):
            return jnp.exp(y)  # FAULT:jit

        return innermost(x * 3)

    f = jax.jit(lambda x: inner(x).sum())
    x = jnp.array([1.0, 40.0])
    r = _check(f, (x,), "exp", "jit", "inf")
    assert len(r.eqn_path) == 4  # jit / jit / jit / exp
    assert r.channels == {0: [1]}
    assert r.diagnosis == "overflow"


# --------------------------------------------------------------------------------------------
# inputs, clean programs, masks


def test_polluted_input_names_argument_path():
    def loss(params, batch):
        return (batch["x"] @ params["w"]).sum()

    params = {"w": jnp.ones((3, 2))}
    batch = {"x": jnp.ones((4, 3)).at[2, 1].set(jnp.nan)}
    r = locate(jax.make_jaxpr(loss)(params, batch), (params, batch))
    assert r.diagnosis == "polluted input" and r.primitive is None and r.direction is None
    assert r.input_path == "[1]['x']"
    assert r.kind == "nan" and r.channels == {0: [2], 1: [1]}
    json.dumps(r.to_dict())


def test_clean_function_returns_none():
    f = lambda x: jnp.tanh(x @ x.T).sum()
    x = jnp.ones((3, 3))
    assert locate(jax.make_jaxpr(f)(x), (x,)) is None


def _causal_attention(q, k, fill):
    s = q @ k.T
    s = jnp.where(jnp.tril(jnp.ones(s.shape, bool)), s, fill)
    return jax.nn.softmax(s, axis=-1).sum()


@pytest.mark.parametrize("fill", ["-inf", "finfo.min"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_causal_mask_is_not_blamed(fill, dtype):
    q = jnp.linspace(-1, 1, 24).reshape(6, 4).astype(dtype)
    val = -jnp.inf if fill == "-inf" else float(jnp.finfo(dtype).min)
    f = lambda q: _causal_attention(q, q, val)
    assert locate(jax.make_jaxpr(f)(q), (q,)) is None
    if dtype == jnp.float32 and fill == "-inf":
        assert locate(jax.make_jaxpr(jax.grad(f))(q), (q,)) is None


@pytest.mark.parametrize("fault", [False, True], ids=["clean", "later_fault"])
@pytest.mark.parametrize("where", ["flax_fp16_attention", "tanh_of_an_overflow"])
def test_an_inf_that_exp_or_tanh_turns_finite_is_absorbed_not_observed(where, fault):
    """fp16 flax attention fills masked logits with the dtype's minimum; ``fill - rowmax``
    rounds to -inf once a row's max passes 16, and ``exp`` makes it 0: no fault (SPEC: a mask
    fill is not an overflow). Likewise ``tanh`` of an overflowed value is 1. Neither is a root,
    and a later real fault is the one named."""
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.normal(size=(1, 6, 1, 16)) * 4, jnp.float16)  # logits up to ~100
    x = jnp.asarray([1.0, 0.0 if fault else 0.5, 2.0], jnp.float32)

    def f(q, x):
        if where == "flax_fp16_attention":
            a = ops.attention(q, q, q, causal=True, gear=0, explicit=True)
        else:
            a = jnp.tanh(q * jnp.float16(1e4))  # overflows to inf, then 1
        h = jnp.sum(a.astype(jnp.float32)) * 0 + x
        return jnp.sum(jnp.log(h))  # FAULT:after_absorbed

    intermediates = jax.make_jaxpr(f)(q, x).eqns
    assert any(e.primitive.name == "exp" or e.primitive.name == "tanh" for e in intermediates)
    assert np.isfinite(float(f(q, x))) != fault
    if fault:
        _check(f, (q, x), "log", "after_absorbed", "inf")
    else:
        assert locate(jax.make_jaxpr(f)(q, x), (q, x)) is None
        g = jax.grad(f, argnums=1)
        assert locate(jax.make_jaxpr(g)(q, x), (q, x)) is None


@pytest.mark.parametrize("grad", [False, True], ids=["loss", "value_and_grad"])
def test_an_overflow_that_rsqrt_turns_into_a_wrong_zero_is_still_the_root(grad):
    """``rsqrt(inf) = 0`` is finite but wrong for the value that overflowed: the norm zeroes
    the row, and a later 0/0 is its consequence, not the fault."""

    def rms_norm(x):  # fp16, a hand-written norm
        ms = jnp.mean(x * x, axis=-1, keepdims=True)  # FAULT:rsqrt_overflow
        return x * jax.lax.rsqrt(ms + jnp.float16(1e-6))

    def loss(w, x):
        h = rms_norm(x @ w).astype(jnp.float32)
        return jnp.sum(h / jnp.linalg.norm(h, axis=-1, keepdims=True))  # 0/0

    rng = np.random.default_rng(0)
    w = jnp.asarray(np.eye(8) * 300, jnp.float16)
    x = jnp.asarray(rng.normal(size=(2, 8)), jnp.float16)
    f = jax.value_and_grad(loss) if grad else loss
    _check(f, (w, x), "mul", "rsqrt_overflow", "inf")


def test_causal_mask_then_real_fault():
    def f(q):
        s = q @ q.T
        s = jnp.where(jnp.tril(jnp.ones(s.shape, bool)), s, -jnp.inf)
        p = jax.nn.softmax(s, axis=-1)
        return jnp.log(p - 0.5).sum()  # FAULT:after_mask

    q = jnp.linspace(-1, 1, 24).reshape(6, 4)
    r = _check(f, (q,), "log", "after_mask", "nan")
    assert r.diagnosis == "log/sqrt domain"


def test_minus_inf_mask_fully_masked_row_reports_first_nan():
    # No equation turns finite inputs into a non-finite value (the -inf is a literal), but a
    # fully masked row gives -inf - -inf = NaN in the softmax: that first NaN is reported.
    q = jnp.linspace(-1, 1, 24).reshape(6, 4)
    mask = jnp.tril(jnp.ones((6, 6), bool)).at[2].set(False)

    def f(q, mask):
        s = jnp.where(mask, q @ q.T, -jnp.inf)
        return jax.nn.softmax(s, axis=-1).sum()

    r = locate(jax.make_jaxpr(f)(q, mask), (q, mask))
    assert r is not None and r.kind == "nan" and r.primitive == "sub"
    assert r.channels == {0: [2], 1: [0, 1, 2, 3, 4, 5]}
    assert "mask" in r.explanation
    assert r.diagnosis == "0/0"


# --------------------------------------------------------------------------------------------
# scale, step replay, report


def _count_eqns(jaxpr) -> int:
    from nan2safe_jax.replay import _jax_compat as jc

    n = 0
    for e in jaxpr.eqns:
        sub = _sub_jaxprs(e)
        n += _count_eqns(sub) if sub is not None and jc.call_body(e) is not None else 1
    return n


@pytest.mark.slow  # minutes: compiling the flags replay of ~470 tiny equations with fusion on
def test_large_program_replays_are_logarithmic():
    def f(x):
        for i in range(150):
            x = jnp.sin(x) * 1.01 + 0.001 * i
        x = x * jnp.array([1.0, 1e38, 1.0])
        x = x * 10.0  # FAULT:big
        for _ in range(20):
            x = jnp.cos(x) + x
        return x.sum()

    x = jnp.array([0.5, 0.7, 0.9])
    jaxpr = jax.make_jaxpr(f)(x)
    n = _count_eqns(jaxpr.jaxpr)
    assert n > 400, n
    r = _check(f, (x,), "mul", "big", "inf")
    assert r.replays <= 3 * math.log2(n), (r.replays, n)
    assert r.channels == {0: [1]}


def test_locate_step_on_jitted_train_step():
    def loss(w, x):
        return jnp.log(x @ w).sum()  # FAULT:step

    @jax.jit
    def step(w, x):
        value, g = jax.value_and_grad(loss)(w, x)
        return w - 0.1 * g, value

    w, x = jnp.ones((3, 2)), jnp.ones((4, 3)).at[1].set(-1.0)
    r = locate_step(step, w, x)
    assert r.reproducible and r.primitive == "log" and r.kind == "nan"
    _assert_source(r, "step")
    assert r.channels == {0: [1], 1: [0, 1]}
    assert r.eqn_path[0] == 0  # entered the step's jit equation
    clean = locate_step(step, w, jnp.ones((4, 3)))
    assert not clean.reproducible and clean.diagnosis == replay.NOT_REPRODUCIBLE
    assert "not reproducible" in str(clean)
    # the forward prefix's flags replay, then the whole step's: neither found anything; on the
    # CPU both again, compiled as production is (``cache.production_options``)
    assert clean.replays == (4 if cache.quick() else 2)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="LLVM's level is set on the CPU")
def test_replays_that_do_not_reproduce_with_llvm_off_run_again_as_production(monkeypatch):
    """Replays compile with LLVM's optimisation off on the CPU (a third of a demo-size
    locate); should they not reproduce the step (LLVM's rounding moved the fault), the whole
    pass runs again compiled as production is, and its report stands."""
    import importlib

    locate_mod = importlib.import_module("nan2safe_jax.replay.locate")  # (``replay.locate`` is
    # the function)

    seen, real = [], locate_mod._run

    def run(jaxpr, args, expected=None, **kw):
        seen.append(cache.quick())
        report, sess = real(jaxpr, args, expected, **kw)
        return (None if cache.quick() else report), sess  # the quick pass "finds nothing"

    monkeypatch.setattr(locate_mod, "_run", run)

    @jax.jit
    def step(w, x):
        return jnp.log(x @ w).sum()

    r = locate_step(step, jnp.ones((3, 2)), jnp.ones((4, 3)).at[1].set(-1.0))
    assert seen == [True, False] and r.reproducible and r.primitive == "log", (seen, r)
    assert cache.quick()  # the context is left as it was


def test_second_incident_on_a_fresh_trace_reuses_compiled_replays():
    from jax import monitoring

    def loss(w, x):
        return jnp.log(jnp.tanh(x @ w) + 0.5).sum()

    step = jax.jit(jax.grad(loss))
    w, x = jnp.eye(3) * 2.0, jnp.ones((4, 3)).at[2].set(-1.0)
    first = locate_step(step, w, x)
    compiles = []
    monitoring.register_event_duration_secs_listener(
        lambda ev, d, **kw: compiles.append(ev) if ev.endswith("backend_compile_duration") else None
    )
    again = locate_step(step, w, x.at[2].set(-2.0))  # traced afresh, same structure
    assert again.primitive == first.primitive == "log" and again.channels == {0: [2], 1: [0, 1, 2]}
    assert compiles == [], compiles


def test_channels_are_capped():
    x = jnp.full((2, 300), -1.0).at[1].set(1.0)
    r = locate(jax.make_jaxpr(lambda x: jnp.log(x).sum())(x), (x,))
    assert r.channels[0] == [0] and r.channels[1] == list(range(64))
    assert r.channels_truncated == {1: 300}
    assert "300 indices, first 64 kept" in str(r)
    assert r.to_dict()["channels_truncated"] == {"1": 300}


def _pallas_div_kernel(x_ref, y_ref, o_ref):
    o_ref[...] = x_ref[...] / y_ref[...]


def test_opaque_pallas_call_is_named_and_not_entered():
    from jax.experimental import pallas as pl

    def f(x, y):
        out = pl.pallas_call(  # FAULT:pallas
            _pallas_div_kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), interpret=True
        )(x, y)
        return (out * 2).sum()

    x, y = jnp.ones((8, 128)), jnp.ones((8, 128)).at[3, 5].set(0.0)
    r = _check(f, (x, y), "pallas_call", "pallas", "inf")
    assert "could not enter pallas_call: the fault is inside it" in r.explanation
    assert r.diagnosis == "other"
    assert r.channels == {0: [3], 1: [5]}


def test_a_singular_solve_is_named_with_what_it_made_not_an_overflow():
    """``custom_linear_solve`` is not entered: its report says what it made and what a solve's
    usual cause is; a zero pivot of a 2 x 2 matrix is no overflow of values up to 4."""
    a = jnp.array([[1.0, 2.0], [2.0, 4.0]])
    r = locate(jax.make_jaxpr(jnp.linalg.inv)(a), (a,))
    assert r.primitive == "custom_linear_solve" and r.diagnosis == "other", r
    assert "could not enter custom_linear_solve: the fault is inside it" in r.explanation
    assert "singular or ill-conditioned" in r.explanation
    assert "exceed" not in r.explanation and "range" not in r.explanation


def test_complex_values_are_summarized_by_their_moduli_without_a_warning():
    """A complex FFT input has no min or max (NumPy would cast to the real part and warn); its
    overflowed intermediate (``3e38 + 3e38``) is an overflow."""
    x = jnp.full((8,), 3e38) * 1j + 1.0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        r = locate(jax.make_jaxpr(jnp.fft.fft)(x), (x,))
        text = str(r)
    assert r.primitive == "fft" and r.diagnosis == "overflow", r
    s = r.inputs[0]
    assert s["min"] is None and s["max"] is None and np.isclose(s["max_abs"], 3e38, rtol=1e-6)
    assert "min=" not in text.split("input 0:")[1].split("\n")[0]
    json.dumps(r.to_dict())


def test_report_is_frozen_and_json_safe():
    f = lambda x: jnp.log(x).sum()
    x = jnp.array([0.0, 1.0])
    r = locate(jax.make_jaxpr(f)(x), (x,))
    with pytest.raises(AttributeError):
        r.primitive = "x"  # type: ignore[misc]
    d = json.loads(json.dumps(r.to_dict()))
    assert d["primitive"] == "log" and d["kind"] == "inf" and d["channels"] == {"0": [0]}
    assert d["diagnosis"] in replay.DIAGNOSES and d["replays"] >= 1 and d["seconds"] > 0
    assert np.isclose(d["inputs"][0]["min"], 0.0)


def test_wrong_number_of_args_raises():
    f = lambda x, y: x + y
    with pytest.raises(ValueError, match="leaves"):
        locate(jax.make_jaxpr(f)(1.0, 2.0), (1.0,))


# ------------------------------------------------------------------ masked values are no root


def test_a_value_where_drops_is_no_root():
    """``jnp.where(x > 0, jnp.log(x), 0)`` makes -inf at 0 and drops it: the root is the sqrt
    whose NaN reaches the result, not the log (what jax_debug_nans would name)."""

    def f(x):
        a = jnp.where(x > 0, jnp.log(x), 0.0)
        b = jnp.sqrt(x - 2.0)  # FAULT:where-real-root
        return (a + b).sum()

    _check(f, [jnp.asarray([0.0, 1.0, 3.0])], "sqrt", "where-real-root", "nan")


def _huge_probed_then_0_over_0(x):
    """A finite value past ~1.2e24 probed (the probe's sum of squares passes f32 inside it and
    saturates to a finite statistic), then a real 0/0 of the model's own."""
    stats = probe.stats(x * 1e30)
    z = x * 0.0
    return stats, z / z  # FAULT:after-probe


def _overflow_probed(x):
    return probe.stats(jnp.exp(x))  # FAULT:probed-overflow


@pytest.mark.parametrize(
    "f, primitive, marker",
    [
        (_huge_probed_then_0_over_0, "div", "after-probe"),
        (_overflow_probed, "exp", "probed-overflow"),
    ],
    ids=["probe_of_a_huge_finite_value", "probe_of_an_overflow"],
)
def test_what_the_probe_statistics_compute_inside_is_never_the_root(f, primitive, marker):
    """The library's probe statistics are monitoring: an inf they make inside (the sum of
    squares of finite values past ~1.2e24, then ``inf - inf``) was named as the step's root,
    ahead of the model's real fault. An inf the probe reads is still found where it was made."""
    x = jnp.asarray([1.0, 2.0, 100.0], jnp.float32)
    r = _check(f, [x], primitive, marker, "nan" if primitive == "div" else "inf")
    assert r.first_nan is None or "probe.py" not in (r.first_nan.source or ""), str(r)


def _probe_then_log(x):
    """The huge probed value, then a real fault of the model's own that reaches the result."""
    stats = probe.stats(x * 1e30)
    return stats[probe.MAX_ABS] * 0.0 + jnp.log(x - 2.0).sum()  # FAULT:log-after-probe


@pytest.mark.parametrize("form", ["scan", "vmap", "grad", "jit"])
def test_the_probe_statistics_stay_silent_inside_transformations(form):
    """The scope survives the name stacks of a loop body, a batching, a transpose and a
    nested jit: the model's ``log`` of a negative value is named, never the probe's sum."""
    x = jnp.asarray([1.0, 2.5, 100.0], jnp.float32)
    if form == "scan":
        f, args = (
            (lambda xs: lax.scan(lambda c, v: (c + _probe_then_log(v), None), 0.0, xs)[0]),
            [jnp.stack([x, x])],
        )
    elif form == "vmap":
        f, args = jax.vmap(_probe_then_log), [jnp.stack([x, x])]
    elif form == "grad":
        f, args = jax.grad(_probe_then_log), [x]
    else:
        f, args = jax.jit(_probe_then_log), [x]
    jaxpr = jax.make_jaxpr(f)(*args)
    r = locate(jaxpr, args)
    assert r is not None and "probe.py" not in (r.source or ""), str(r)
    assert r.primitive in ("log", "div"), str(r)  # the backward of log is a division
    _assert_source(r, "log-after-probe")


def _overflowing_site(x, w, gear):
    """An fp16 ``ops.linear`` whose FAST path overflows (SAFE saturates), then a real NaN."""
    y = ops.linear(x, w, None, gear=gear)
    return jnp.log(1.0 - x[0, 0]) + y.astype(jnp.float32).sum()  # FAULT:after-site


@pytest.mark.parametrize("grad", [False, True], ids=["forward", "grad"])
def test_a_gear_switch_drops_fast_at_safe(grad):
    """A site at SAFE still computes its FAST path (outside the ``cond``, as plain step code) and
    drops it; FAST's overflow there is masked, so the replay names the later real root. At FAST
    the same overflow reaches the result and is the root."""
    x = jnp.full((2, 4), 300.0, jnp.float16)
    w = jnp.full((4, 3), 300.0, jnp.float16)
    f = jax.grad(_overflowing_site, argnums=1) if grad else _overflowing_site
    for gear, want in ((Gear.SAFE, "log"), (Gear.FAST, "dot_general")):
        args = [x, w, jnp.int32(gear)]
        r = locate(jax.make_jaxpr(f)(*args), args)
        assert r is not None and r.primitive == want, (gear, str(r))
    r = locate(jax.make_jaxpr(f)(x, w, jnp.int32(Gear.SAFE)), [x, w, jnp.int32(Gear.SAFE)])
    _assert_source(r, "after-site")


def _norm_then(x, gear, fault):
    y = ops.layer_norm(x, None, None, eps=0.0, gear=gear)  # constant rows: FAST's rsqrt(0)
    return jnp.log(y - 1.0) if fault else y  # FAULT:after-norm


@pytest.mark.parametrize("fault", [False, True], ids=["clean", "later_fault"])
def test_a_safe_norm_drops_fast_and_the_probe_statistics_fast_computed(fault):
    """A norm at SAFE (traced gear) on constant rows with eps 0: FAST's ``rsqrt(0)`` is inf, and
    FAST's probe statistics read it (a NaN/inf count: finite values from an inf one). Only
    the gear ``cond`` reads those statistics, and it drops them: that read observes nothing.
    The clean function is clean; with a fault after the norm, the fault is the root."""
    x = jnp.ones((2, 4))
    args = [x, jnp.int32(Gear.SAFE)]
    r = locate(jax.make_jaxpr(lambda x, g: _norm_then(x, g, fault))(*args), args)
    if not fault:
        assert r is None, str(r)
        return
    assert r is not None and r.primitive == "log", str(r)
    _assert_source(r, "after-norm")


def _fp16_loss(logits, labels):
    return ops.cross_entropy(logits, labels, gear=Gear.FAST)  # FAULT:ce-call


def test_a_fault_inside_optax_called_by_an_op_names_the_calling_line():
    """FAST cross-entropy is optax's; in fp16 its sum of 70,000 equal exponentials overflows.
    ``source`` is optax's line, ``user_source`` the line that called the op (optax's frames
    are no user's)."""
    logits = jnp.zeros((1, 70_000), jnp.float16)
    labels = jnp.zeros((1,), jnp.int32)
    r = locate(jax.make_jaxpr(_fp16_loss)(logits, labels), (logits, labels))
    assert r is not None and "optax" in r.source, str(r)
    assert r.user_source.endswith(f"test_replay.py:{_line('ce-call')}"), r.user_source


_BIAS = jnp.asarray([0.0, -jnp.inf, 0.0, jnp.inf])  # a module-level array: a closed-over constant


def _plus_bias(x):
    return x + _BIAS  # FAULT:closed-constant


def test_a_closed_over_constant_that_carries_inf_in_is_named_as_a_constant():
    """``make_jaxpr`` holds a captured array in ``ClosedJaxpr.consts``, which the replay passes
    as an operand; no equation made its inf, and the report names the equation it enters by,
    diagnosis "constant", as for a literal (it was missed: None)."""
    x = jnp.ones(4)
    closed = jax.make_jaxpr(_plus_bias)(x)
    assert closed.consts  # the premise: the bias is a constant of the closed jaxpr
    r = locate(closed, (x,))
    assert r is not None and (r.primitive, r.diagnosis, r.kind) == ("add", "constant", "inf")
    assert r.inputs[1]["literal"] and r.channels == {0: [1, 3]}, str(r)
    _assert_source(r, "closed-constant")


def _attend_first(q, k, v, mask):
    logits = jnp.where(mask, q @ k.T, -jnp.inf)
    return jax.nn.softmax(logits, axis=-1) @ v  # FAULT:first-site


def _attend_second(q, k, v, mask):
    logits = jnp.where(mask, q @ k.T, -jnp.inf)
    return jax.nn.softmax(logits, axis=-1) @ v  # FAULT:second-site


def _attend_safe(q, k, v, mask):
    return ops.softmax(q @ k.T, where=mask, gear=Gear.SAFE) @ v


def test_a_safe_site_drops_fast_even_when_its_own_output_is_not_finite():
    """Two hand-written attention sites on a fully masked row, the first at SAFE, the second at
    FAST (``-inf - -inf``: NaN). The first's FAST path makes the same NaN and its pullback reads
    it; the second's NaN cotangent flows back through the first site's backward ``cond``, whose
    output is then NaN too. FAST's NaN is still dropped there (the known branch does not read
    it), so the culprit is the second site."""

    def f(x, mask, gears):
        h = ops.switch(gears[0], [_attend_first, _attend_safe, _attend_safe], x, x, x, mask)
        h = ops.switch(gears[1], [_attend_second, _attend_safe, _attend_safe], h, h, h, mask)
        return h.sum()

    x = jnp.arange(8.0).reshape(4, 2) / 8
    mask = jnp.tril(jnp.ones((4, 4), bool)).at[0, 0].set(False)
    args = [x, mask, jnp.asarray([Gear.SAFE, Gear.FAST], jnp.int32)]
    r = locate(jax.make_jaxpr(jax.grad(f))(*args), args)
    assert r is not None and r.direction == "forward", str(r)
    _assert_source(r, "second-site")


def test_a_gear_switch_inside_scan_drops_fast_at_safe():
    """The same inside a ``scan`` body: iteration 0's SAFE site masks its FAST overflow, so the
    first flagged iteration is 1, where ``log(c - 0.3)`` makes the real NaN (c = 0.25)."""

    def f(x, w, gears):
        def body(c, g):
            y = ops.linear(x * c, w, None, gear=g)
            c = c * jnp.float16(0.5)
            return c, jnp.log(y.astype(jnp.float32).sum() - 100.0) + jnp.log(c - 0.3)

        return lax.scan(body, jnp.float16(1.0), gears)[1].sum()

    x = jnp.full((2, 4), 200.0, jnp.float16)  # 80000 at c = 1 (overflow), 40000 at c = 0.5
    w = jnp.full((4, 3), 100.0, jnp.float16)
    gears = jnp.asarray([Gear.SAFE, Gear.FAST, Gear.FAST], jnp.int32)
    args = [x, w, gears]
    r = locate(jax.make_jaxpr(f)(*args), args)
    assert r is not None and r.primitive == "log", str(r)
    assert [p for p in r.eqn_path if isinstance(p, tuple)] == [("iter", 1)], r.eqn_path
