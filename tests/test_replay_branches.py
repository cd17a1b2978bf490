"""``replay/branches.py``: gear switches are replayed with their branch index as a constant."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from nan2safe_jax import ops
from nan2safe_jax.gear import Gear
from nan2safe_jax.replay import _jax_compat as jc
from nan2safe_jax.replay import branches, cache, locate
from nan2safe_jax.replay.search import Session


def _known(f, *args):
    closed = jax.make_jaxpr(f)(*args)
    top, consts = jc.open_jaxpr(closed)
    sess = Session(closed)
    leaves = jax.tree_util.tree_leaves(args)
    return (
        sess,
        top,
        consts,
        leaves,
        sess.known("top", top, list(consts), leaves, jc.empty_name_stack()),
    )


def _heavy(x):
    for _ in range(3):
        x = jnp.tanh(x @ x.T) + jnp.sin(x)
    return x


@pytest.mark.parametrize("gear", [0, 1, 2])
def test_a_gear_index_is_known_and_compiled_alone(gear):
    """The index of a gear switch comes from an int32 scalar through scalar ops: known. The flags
    replay binds it as a constant, and XLA compiles no conditional for it."""

    def f(x, g):
        g = jnp.clip(g + 0, 0, 2)
        return lax.switch(g, [lambda x: x, _heavy, lambda x: _heavy(_heavy(x))], x).sum()

    x = jnp.ones((8, 8), jnp.float32)
    sess, top, consts, leaves, known = _known(f, x, jnp.int32(gear))
    assert list(known.values()) == [gear]
    sess.flags("top", top, list(consts), leaves, jc.empty_name_stack(), top=True)
    key = (("flags", "top", True, tuple(sorted(known.items()))), cache.quick())
    hlo = sess._jits[key].lower(list(consts), leaves).compile().as_text()
    assert "conditional" not in hlo


def test_an_index_from_a_large_value_is_not_evaluated():
    """A ``cond`` steered by a reduction over a large array stays a ``cond``: computing its index
    would be a replay of its own."""

    def f(x):
        return lax.cond(x.sum() > 0, lambda x: x * 2, lambda x: x, x).sum()

    x = jnp.ones((branches.SMALL + 1,), jnp.float32)
    *_, known = _known(f, x)
    assert known == {}


def test_small_indices_inside_a_jitted_call_are_numbered_like_the_walk():
    """Flat numbers count the equations of inlined calls, as ``interpret.walk`` does."""

    @jax.jit
    def inner(x, g):
        return ops.linear(x, jnp.eye(4, dtype=x.dtype), None, gear=g)

    def f(x, g):
        y = jnp.sin(x)
        return inner(y, g).sum()

    x = jnp.ones((2, 4), jnp.float16)
    _, top, _, _, known = _known(f, x, jnp.int32(Gear.SAFE))
    conds = [k for k, b in known.items()]
    assert conds and all(b == Gear.SAFE for b in known.values())
    from nan2safe_jax.replay.search import flatten

    items = flatten(top, jc.empty_name_stack())
    assert all(items[k].eqn.primitive.name == "cond" for k in conds)


@pytest.mark.parametrize("gear", [Gear.FAST, Gear.SAFE])
def test_locate_is_the_same_with_known_branches(gear, monkeypatch):
    """The culprit does not depend on whether the branch was bound as a constant."""

    def f(x, w, g):
        y = ops.linear(x, w, None, gear=g)
        return jnp.log(1.0 - x[0, 0]) + y.astype(jnp.float32).sum()

    x = jnp.full((2, 4), 300.0, jnp.float16)
    w = jnp.full((4, 3), 300.0, jnp.float16)
    args = [x, w, jnp.int32(gear)]
    jaxpr = jax.make_jaxpr(jax.grad(f, argnums=1))(*args)
    with_known = locate(jaxpr, args)
    monkeypatch.setattr(branches, "known_indices", lambda *a, **k: {})
    without = locate(jaxpr, args)
    assert (with_known.primitive, with_known.eqn_path) == (without.primitive, without.eqn_path)
    assert with_known.primitive == ("dot_general" if gear == Gear.FAST else "log")
    assert np.isfinite(float(with_known.seconds))
