"""``replay/prefix.py``: a train step's culprit decided from its forward prefix when it can be.

Every search is compared against the reference: the same locate with the whole step's flags
replay (``Session(prefix=False)``).
"""

import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nan2safe_jax.replay import _jax_compat as jc
from nan2safe_jax.replay import prefix, search

locate_mod = importlib.import_module("nan2safe_jax.replay.locate")  # the module, not the function
_run = locate_mod._run


def _step(loss):
    """An SGD train step around ``loss`` (forward, backward, update), jitted as users write it."""

    @jax.jit
    def step(w, x):
        value, g = jax.value_and_grad(loss)(w, x)
        return w - 0.1 * g, value

    return step


def _both(step, *args, expected=None):
    """``(report, session)`` with the prefix tried first, and the reference without it."""
    closed = jax.make_jaxpr(step)(*args)
    with_prefix = locate_mod._run(closed, args, expected)
    reference = locate_mod._run_full(closed, args, expected)
    return with_prefix, reference


def _same(a, b):
    assert (a.primitive, a.source, a.eqn_path, a.kind, a.diagnosis) == (
        b.primitive,
        b.source,
        b.eqn_path,
        b.kind,
        b.diagnosis,
    )
    assert a.first_nan == b.first_nan


# ------------------------------------------------------------------------------ pure functions


def test_boundary_is_the_first_backward_equation_when_the_prefix_is_short():
    stacks = ["jvp(f)", "jvp(f)", "transpose(jvp(f))", "transpose(jvp(f))", "", ""]
    assert prefix.boundary(stacks) == 2
    assert prefix.boundary(["a", "b", "c"]) is None  # no backward pass
    assert prefix.boundary(["a"] * 9 + ["transpose(jvp(f))"]) is None  # nothing to save
    assert prefix.boundary(["transpose(jvp(f))", "a"]) is None  # an empty prefix


@pytest.mark.parametrize(
    "upper, lower, want",
    [
        (([0, 0, 1], [0, 0, 0]), ([0, 0, 1], [0, 0, 0]), (2, "root")),
        (([0, 1, 1], [0, 0, 0]), ([0, 0, 1], [0, 0, 0]), None),  # the first may be masked later
        (([0, 0, 1], [0, 1, 0]), ([0, 0, 0], [0, 1, 0]), (1, "nan")),  # program order
        (([1, 0], [1, 0]), ([1, 0], [1, 0]), (0, "root")),  # both: a root
        (([0, 0], [0, 0]), ([0, 0], [0, 0]), None),  # nothing in the prefix
    ],
)
def test_decide_takes_the_first_upper_flag_only_when_the_lower_bound_has_it(upper, lower, want):
    assert prefix.decide(upper, lower) == want


def test_producers_number_outputs_like_the_walk_through_inner_calls():
    inner = jax.jit(lambda x: (jnp.sin(x), x * 2.0))

    def f(x, y):
        a, b = inner(x)
        return jnp.exp(b), a, y, 3.0

    closed = jax.make_jaxpr(f)(jnp.ones(3), jnp.ones(2))
    top, _ = jc.open_jaxpr(closed)
    items = search.flatten(top, jc.empty_name_stack())
    srcs = prefix.producers(top)
    names = [items[s[0]].eqn.primitive.name if s else None for s in srcs]
    assert names == ["exp", "sin", None, None]  # an argument passed through; a literal
    assert prefix.watch(srcs, stop=len(items)) == {srcs[0][0]: (0,), srcs[1][0]: (0,)}
    assert prefix.watch(srcs, stop=srcs[0][0]) == {srcs[1][0]: (0,)}


# ------------------------------------------------------------------------------ searches


def test_a_forward_fault_is_decided_by_the_prefix_with_the_reference_answer():
    def loss(w, x):
        return jnp.log(x @ w).sum()

    w, x = jnp.ones((3, 2)), jnp.ones((4, 3)).at[1].set(-1.0)
    (r, sess), (ref, ref_sess) = _both(_step(loss), w, x)
    assert sess.prefix_decided and not ref_sess.prefix_decided
    _same(r, ref)
    assert r.primitive == "log" and r.direction == "forward"
    # the prefix's flags replay and the capture; no flags replay of the whole step
    assert r.replays == 2 and ref.replays == 2


def test_a_fault_only_the_backward_reads_falls_back_to_the_whole_step():
    """``sqrt``'s derivative ``0.5 / sqrt(0)`` is computed in the forward pass (JAX linearizes
    there) but only the backward pass reads it: the prefix cannot tell whether it is masked."""

    def loss(w, x):
        return jnp.sqrt(x @ w).sum()

    w, x = jnp.ones((3, 2)), jnp.ones((4, 3)).at[1].set(0.0)
    (r, sess), (ref, _) = _both(_step(loss), w, x)
    assert not sess.prefix_decided
    _same(r, ref)
    assert r.primitive == "div" and r.kind == "inf"


def test_a_forward_nan_that_only_the_rest_could_mask_is_not_decided_by_the_prefix():
    """The upper bound flags the masked ``log``; nothing in the prefix observes it, so the
    prefix does not decide, and the whole step's replay finds that ``where`` masks it and blames
    ``sqrt``'s derivative instead."""

    def loss(w, x):
        h = x @ w
        dead = jnp.log(h - 10.0)  # NaN, masked below
        kept = jnp.where(h > 10.0, dead, 0.0)
        return (kept + jnp.sqrt(h)).sum()

    w, x = jnp.ones((3, 2)), jnp.ones((4, 3)).at[1].set(0.0)
    (r, sess), (ref, _) = _both(_step(loss), w, x)
    assert not sess.prefix_decided
    _same(r, ref)
    assert r.primitive == "div" and r.kind == "inf"


def test_a_fault_observed_in_the_forward_is_decided_even_when_masked_later():
    """The forward ``isfinite`` observes the NaN: it is live whatever the backward does."""

    def loss(w, x):
        h = jnp.log(x @ w)
        ok = jnp.all(jnp.isfinite(h))
        return jnp.where(ok, h.sum(), 0.0)

    w, x = jnp.ones((3, 2)), jnp.ones((4, 3)).at[1].set(-1.0)
    (r, sess), (ref, _) = _both(_step(loss), w, x)
    assert sess.prefix_decided
    _same(r, ref)
    assert r.primitive == "log"


def test_the_fidelity_check_compares_the_outputs_the_prefix_computed():
    def loss(w, x):
        return jnp.log(x @ w).sum()

    step = _step(loss)
    w, x = jnp.ones((3, 2)), jnp.ones((4, 3)).at[1].set(-1.0)
    closed = jax.make_jaxpr(step)(w, x)
    leaves = jax.tree_util.tree_leaves(step(w, x))
    good = np.asarray([2 if np.isnan(np.asarray(a)).any() else 0 for a in leaves], np.int8)
    r, sess = _run(closed, (w, x), good)
    assert sess.prefix_decided and r.reproducible and r.primitive == "log"
    bad = good.copy()
    bad[1] = 1  # production said the loss (output 1, computed in the forward) was inf
    r, sess = _run(closed, (w, x), bad)
    assert sess.prefix_decided and not r.reproducible and r.primitive is None
    assert "output 1 is nan in the replay but inf in production" in r.reason


@pytest.mark.parametrize("prefix", [True, False], ids=["prefix", "whole_step"])
def test_an_output_only_the_replay_makes_non_finite_is_the_same_fault(prefix):
    """XLA's fused step can drop a NaN the replay's pieces keep (a max-pooled BatchNorm of a
    zero-variance batch: the loss finite, its gradients NaN); the replay then names the first
    value as it should, and says production lost it, where every such step read "transient"."""

    def loss(w, x):
        return jnp.sqrt(x @ w).sum()  # NaN at a negative row, and so is its gradient

    step = _step(loss)
    w, x = jnp.ones((3, 2)), jnp.ones((4, 3)).at[1].set(-1.0)
    closed = jax.make_jaxpr(step)(w, x)
    new_w, value = step(w, x)
    assert np.isnan(np.asarray(new_w)).any() and np.isnan(np.asarray(value))
    lost = np.asarray([2, 0], np.int8)  # as production: new weights NaN, the loss finite
    r, _ = locate_mod._run(closed, (w, x), lost, prefix=prefix)
    assert r.reproducible and r.primitive == "sqrt", str(r)
    assert "production's compiled step kept output(s) [1] finite" in r.explanation
    # a production step with no non-finite output at all is still not reproduced
    r, _ = locate_mod._run(closed, (w, x), np.zeros(2, np.int8), prefix=prefix)
    assert not r.reproducible and "is nan in the replay but finite in production" in r.reason


# ------------------------------------------------------------------------------ scan bodies


def _scan_step(body_extra=None):
    def layer(h, w):
        h = jnp.tanh(h @ w)
        if body_extra is not None:
            h = body_extra(h)
        return jnp.log(h + 1.0), None  # tanh saturates to -1 in layer 2 only: log(0)

    def loss(ws, x):
        h, _ = jax.lax.scan(layer, x, ws)
        return h.sum()

    return _step(loss)


def _scan_args():
    ws = jnp.stack([jnp.eye(3) * 0.5, jnp.eye(3) * 0.5, -jnp.eye(3) * 1e3, jnp.eye(3)])
    return ws, jnp.ones((2, 3))


def test_a_scan_body_is_entered_through_one_capture_with_the_flags_its_loop_replay_computed():
    (r, sess), (ref, _) = _both(_scan_step(), *_scan_args())
    _same(r, ref)
    assert r.primitive == "log" and ("iter", 2) in r.eqn_path
    # The culprit: the forward prefix's flags; the body inputs of iteration 2 (one capture
    # replay); the capture of the log in it; no flags replay of iteration 2's level. The
    # reference: the step's flags, the scan's capture, the step capture, iteration 2's flags,
    # the log's capture. Then each looks for the first NaN (``-inf * 0`` in iteration 3's
    # matmul) in three more replays.
    assert (r.replays, ref.replays) == (3 + 3, 5 + 3)
    assert r.first_nan is not None and ("iter", 3) in r.first_nan.eqn_path


def test_a_body_with_a_branch_gets_its_own_flags_replay():
    """A ``cond`` in the body: its level's replay binds known branch indices, which the loop's
    replay cannot, so the body's flags are not reused."""

    def branchy(h):
        return jax.lax.cond(jnp.sum(h) > 1e9, lambda a: a * 2.0, lambda a: a, h)

    (r, sess), (ref, _) = _both(_scan_step(branchy), *_scan_args())
    _same(r, ref)
    assert r.primitive == "log" and r.replays == ref.replays - 1  # one capture replay saved
