"""numerics: tree finiteness (device and host), saturating counters."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from nan2safe_jax import numerics
from nan2safe_jax import optax as n2s_optax
from nan2safe_jax.numerics import MAX_I32


def test_saturating_add_holds_at_the_top_instead_of_wrapping():
    top = jnp.int32(MAX_I32)
    # what the old ``jnp.minimum(x + 1, MAX_I32)`` did: wrap first, then keep the wrapped value
    assert int(jnp.minimum(top + 1, MAX_I32)) < 0
    assert int(numerics.saturating_add(top)) == MAX_I32
    assert int(numerics.saturating_add(jnp.int32(MAX_I32 - 1))) == MAX_I32
    assert int(numerics.saturating_add(jnp.int32(MAX_I32 - 3), 2)) == MAX_I32 - 1
    assert int(numerics.saturating_add(top, 0)) == MAX_I32
    np.testing.assert_array_equal(
        jax.jit(numerics.saturating_add)(jnp.asarray([0, 5, MAX_I32], jnp.int32)), [1, 6, MAX_I32]
    )


def test_skip_counters_saturate_at_the_top():
    tx = n2s_optax.skip_nonfinite(optax.sgd(0.1))
    params = {"w": jnp.ones(3)}
    state = tx.init(params)
    state = state._replace(skipped=jnp.int32(MAX_I32), streak=jnp.int32(MAX_I32))
    _, state = tx.update({"w": jnp.full(3, jnp.nan)}, state, params)
    assert int(state.skipped) == MAX_I32 and int(state.streak) == MAX_I32


def test_all_finite_checks_float_leaves_only():
    ok = {"a": jnp.ones(2), "i": jnp.arange(3), "h": jnp.ones(2, jnp.bfloat16)}
    assert bool(numerics.all_finite(ok)) and bool(numerics.all_finite({}))
    assert not bool(numerics.all_finite({**ok, "h": jnp.asarray([1.0, jnp.inf], jnp.bfloat16)}))
    assert not bool(jax.jit(numerics.all_finite)({**ok, "a": jnp.asarray([0.0, jnp.nan])}))


@pytest.mark.parametrize("dtype", [np.float32, np.float16, jnp.bfloat16])
def test_first_nonfinite_names_the_leaf(dtype):
    tree = {"x": np.ones((2, 2), dtype), "y": [np.zeros(3, np.int32), np.ones(4, dtype)]}
    assert numerics.first_nonfinite(tree) is None and numerics.tree_is_finite(tree)
    tree["y"][1][2] = np.nan
    assert numerics.first_nonfinite(tree) == "['y'][1]"
    assert not numerics.tree_is_finite(tree)


def test_host_check_skips_keys_and_sees_complex():
    tree = {"key": jax.random.key(0), "c": np.asarray([1 + 1j], np.complex64)}
    assert numerics.tree_is_finite(tree)
    tree["c"] = np.asarray([1 + 1j * np.inf], np.complex64)  # only the imaginary part is bad
    assert numerics.first_nonfinite(tree) == "['c']"


@pytest.mark.parametrize("dtype", [np.float32, np.float64, jnp.bfloat16, np.float16])
def test_huge_values_are_the_same_verdict_on_the_host_and_in_the_step(dtype):
    """``nonfinite_kinds``'s third flag (in the step) and ``first_huge`` (on the host) against
    a float64 reference: a finite value of magnitude 2**64 or more that is no mask fill
    (above -1e37, each bound as the leaf's dtype rounds it); fp16 holds none; ``-inf``, NaN,
    ints, keys and Python floats are never huge."""
    values = [1.0, 2.0**64, -(2.0**64), 1e30, -1e30, 3e38, -1e37, -3.4e38, 1e19, -np.inf]
    wide = jnp.finfo(dtype).max > 2.0**64
    for v in values:
        x = np.zeros(4, np.float64)
        x[2] = v
        # a float64 leaf stays float64 on the host; the step reads it as float32 (x64 off)
        leaf = x if dtype == np.float64 else np.asarray(jnp.asarray(x, dtype))
        ref = numerics.device_view(leaf).astype(np.float64)[2]
        fill = float(np.asarray(np.asarray(-1e37, numerics.device_view(leaf).dtype), np.float64))
        want = bool(wide and np.isfinite(ref) and abs(ref) >= 2.0**64 and ref > fill)
        tree = {"x": leaf, "i": np.arange(3), "k": jax.random.key(0), "f": 0.5}
        got = bool(jax.jit(lambda t: numerics.nonfinite_kinds(t)[2])(tree))
        assert got is want, (v, dtype)
        assert (numerics.first_huge(tree) == "['x']") is want, (v, dtype)
    assert bool(numerics.nonfinite_kinds({"f": 1e30})[2])  # a Python float leaf, eagerly


@pytest.mark.parametrize("dtype", [np.float32, np.float16, jnp.bfloat16])
@pytest.mark.parametrize("bad", [None, "small", "large"])
def test_sum_of_squares_matches_float64_with_small_leaves_batched(dtype, bad):
    rng = np.random.default_rng(0)
    # leaves on both sides of SMALL_LEAF: the small ones are reduced as one vector
    shapes = [(3,), (64, 64), (7, 5), (), (numerics.SMALL_LEAF,), (2, 3, 4)]
    leaves = [rng.normal(size=s).astype(np.float32) * 3 for s in shapes]
    tree = {f"p{i}": jnp.asarray(x).astype(dtype) for i, x in enumerate(leaves)}
    if bad is not None:
        key = "p2" if bad == "small" else "p1"
        tree[key] = tree[key].at[(0,) * tree[key].ndim].set(jnp.inf)
    got = float(jax.jit(numerics.sum_of_squares)(tree))
    ref = sum(float(np.sum(np.square(np.asarray(x, np.float64)))) for x in tree.values())
    if bad is None:
        assert got == pytest.approx(ref, rel=1e-5)
    else:
        assert not np.isfinite(got)


@pytest.mark.parametrize("dtype", [np.float32, np.float16, jnp.bfloat16])
@pytest.mark.parametrize("bad", [None, "small", "large"])
def test_sum_of_squares_of_a_difference_matches_float64(dtype, bad):
    """``minus=``: the squares of ``tree - minus`` taken in f32 (a step's change to its
    parameters), small leaves concatenated on both sides before the subtraction."""
    rng = np.random.default_rng(1)
    shapes = [(3,), (64, 64), (7, 5), (), (numerics.SMALL_LEAF,), (2, 3, 4)]
    old = {f"p{i}": jnp.asarray(rng.normal(size=s), dtype) for i, s in enumerate(shapes)}
    new = {
        k: (v.astype(jnp.float32) + 0.01 * (i + 1)).astype(dtype)
        for i, (k, v) in enumerate(old.items())
    }
    if bad is not None:
        key = "p2" if bad == "small" else "p1"
        new[key] = new[key].at[(0,) * new[key].ndim].set(jnp.nan)
    got = float(jax.jit(lambda a, b: numerics.sum_of_squares(a, minus=b))(new, old))
    f64 = lambda x: np.asarray(jnp.asarray(x, jnp.float32), np.float64)
    ref = sum(float(np.sum(np.square(f64(new[k]) - f64(old[k])))) for k in old)
    if bad is None:
        assert got == pytest.approx(ref, rel=1e-5)
    else:
        assert not np.isfinite(got)
    # an unchanged tree: exactly 0
    assert float(numerics.sum_of_squares(old, minus=old)) == 0.0
    with pytest.raises(ValueError, match="minus"):
        numerics.sum_of_squares(old, minus={"p0": old["p0"]})


def _jax_keeps_producers() -> bool:
    """Whether this JAX's jit tracers name the equation that made them (jax 0.10 does); on one
    that does not, ``sum_of_squares`` reads the transposed gradient as it is."""
    from nan2safe_jax.replay import _jax_compat

    seen = []
    jax.make_jaxpr(lambda a: seen.append(_jax_compat.traced_producer(a.T)))(jnp.ones((2, 3)))
    return seen[0] is not None


def _squared_operands(jaxpr) -> list:
    """For every sum of squares in ``jaxpr``: the primitive that made the squared operand."""
    made = {v: e for e in jaxpr.eqns for v in e.outvars}
    out = []
    for e in jaxpr.eqns:
        sq = made.get(e.invars[0]) if e.primitive.name == "reduce_sum" else None
        if sq is not None and sq.primitive.name == "square":
            out.append(made[sq.invars[0]].primitive.name)
    return out


@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16])
@pytest.mark.parametrize("bad", [None, np.nan, np.inf])
def test_sum_of_squares_reads_a_transposed_gradient_through_its_transpose(dtype, bad):
    """A kernel's gradient is ``transpose(dot_general(...))``: in f32 the sum reads the dot's
    output (the same values; one XNNPACK kernel on the CPU instead of a transposed copy and two
    reductions); a bfloat16 one is summed as it is. Same value as float64 either way, and a
    NaN / inf in the gradient still makes it non-finite."""
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.normal(size=(64, 96)), dtype)
    if bad is not None:
        x = x.at[5, 7].set(bad)
    kernel = jnp.asarray(rng.normal(size=(96, 4, 16)) * 0.1, dtype)

    def grads(kernel):
        loss = lambda k: jnp.sum(jnp.tanh(jnp.einsum("bi,ihd->bhd", x, k)).astype(jnp.float32))
        return jax.grad(loss)(kernel)

    def f(kernel):
        g = grads(kernel)
        return numerics.sum_of_squares({"k": g}), g

    got, g = jax.jit(f)(kernel)
    if bad is None:
        ref = float(np.sum(np.square(np.asarray(g, np.float64))))
        assert float(got) == pytest.approx(ref, rel=1e-6)
    else:
        assert not np.isfinite(float(got))
    jaxpr = jax.make_jaxpr(f)(kernel).jaxpr
    assert any(e.primitive.name == "transpose" for e in jaxpr.eqns)  # the case this is about
    f32_reads = "dot_general" if _jax_keeps_producers() else "transpose"
    want = f32_reads if dtype == np.float32 else "convert_element_type"
    assert _squared_operands(jaxpr) == [want]


def test_traced_producer_names_the_equation_or_none():
    from nan2safe_jax.replay import _jax_compat

    if not _jax_keeps_producers():
        pytest.skip("this JAX's tracers do not keep their equation (the caller falls back)")

    seen = []

    def f(a):
        t = jnp.transpose(a, (1, 0))
        seen.append(_jax_compat.traced_producer(t))
        seen.append(_jax_compat.traced_producer(a))  # an argument: made by no equation
        return t

    jax.make_jaxpr(f)(jnp.ones((2, 3)))
    name, ins, params = seen[0]
    assert name == "transpose" and len(ins) == 1 and tuple(params["permutation"]) == (1, 0)
    assert seen[1] is None and _jax_compat.traced_producer(jnp.ones(2)) is None


def _plain_large_sum(xs, ys):
    """What ``large_sum`` computes, on one device."""
    diff = xs if ys is None else [x - y for x, y in zip(xs, ys, strict=True)]
    return sum(jnp.sum(jnp.square(d)) for d in diff)


@pytest.mark.parametrize("with_minus", [False, True])
def test_sum_of_squares_hands_the_large_leaves_to_large_sum(with_minus):
    """``large_sum=`` (a sharded step's ``Rules.sum_of_squares``) gets exactly the large leaves,
    in f32, with their ``minus`` leaves; the small ones stay in the one concatenated sum."""
    rng = np.random.default_rng(2)
    shapes = [(3,), (64, 64), (7, 5), (numerics.SMALL_LEAF,), (2, 3, 4)]
    tree = {f"p{i}": jnp.asarray(rng.normal(size=s), jnp.bfloat16) for i, s in enumerate(shapes)}
    old = jax.tree_util.tree_map(lambda x: x * 0.5, tree) if with_minus else None
    seen = []

    def large_sum(xs, ys):
        seen.append(([x.shape for x in xs], ys is None, {x.dtype for x in xs}))
        return _plain_large_sum(xs, ys)

    got = float(numerics.sum_of_squares(tree, minus=old, large_sum=large_sum))
    want = float(numerics.sum_of_squares(tree, minus=old))
    assert got == pytest.approx(want, rel=1e-6)
    assert seen == [([(64, 64), (numerics.SMALL_LEAF,)], not with_minus, {jnp.dtype("float32")})]


@pytest.mark.parametrize("with_minus", [False, True])
def test_sum_of_squares_concatenates_only_the_replicated_small_leaves(with_minus):
    """``replicated=`` (a sharded step's ``Rules.replicates``): a small leaf the devices do not
    hold whole goes to ``large_sum`` with the large ones; the sum is the same."""
    rng = np.random.default_rng(3)
    shapes = [(3,), (64, 64), (8, 16), (7, 5)]
    tree = {f"p{i}": jnp.asarray(rng.normal(size=s), jnp.float32) for i, s in enumerate(shapes)}
    old = jax.tree_util.tree_map(lambda x: x * 0.5, tree) if with_minus else None
    seen = []

    def large_sum(xs, ys):
        seen.append([x.shape for x in xs])
        return _plain_large_sum(xs, ys)

    split = lambda x: x.shape != (8, 16)  # noqa: E731  (the one small leaf split over devices)
    got = numerics.sum_of_squares(tree, minus=old, large_sum=large_sum, replicated=split)
    f64 = lambda t: [np.asarray(x, np.float64) for x in jax.tree_util.tree_leaves(t)]  # noqa: E731
    diffs = f64(tree) if old is None else [a - b for a, b in zip(f64(tree), f64(old), strict=True)]
    assert float(got) == pytest.approx(sum(float(np.sum(d * d)) for d in diffs), rel=1e-6)
    assert seen == [[(64, 64), (8, 16)]]


@pytest.mark.parametrize("pred", [True, False])
def test_computed_once_is_fn_whatever_the_predicate(pred):
    """Both branches are ``fn``: the predicate changes nothing but must survive compilation
    (the conditional is what makes XLA compute the operands once)."""
    parts = {"a": jnp.arange(5.0), "b": jnp.full((5,), 2.0)}

    def step(parts, p):
        finished = {k: jnp.sqrt(v) * 3.0 + 1.0 for k, v in parts.items()}  # a cheap chain
        stacked = numerics.computed_once(lambda f: jnp.stack([f["a"], f["b"]]), p, finished)
        return finished, stacked

    jitted = jax.jit(step)
    finished, stacked = jitted(parts, jnp.asarray(pred))
    np.testing.assert_allclose(stacked, np.stack([finished["a"], finished["b"]]))
    np.testing.assert_allclose(stacked[0], np.sqrt(np.arange(5.0)) * 3.0 + 1.0, rtol=1e-6)
    hlo = jitted.lower(parts, jnp.asarray(pred)).compile().as_text()
    assert "conditional(" in hlo  # not folded: XLA reads the finished values as values


def test_sum_of_squares_without_producers_reads_the_gradient_as_it_is(monkeypatch):
    """A JAX whose tracers keep no equation: the same sum, of the transposed gradient."""
    from nan2safe_jax.replay import _jax_compat

    monkeypatch.setattr(_jax_compat, "traced_producer", lambda x: None)
    rng = np.random.default_rng(4)
    x = jnp.asarray(rng.normal(size=(64, 96)), jnp.float32)
    kernel = jnp.asarray(rng.normal(size=(96, 80)) * 0.1, jnp.float32)

    def f(kernel):
        g = jax.grad(lambda k: jnp.sum(jnp.tanh(x @ k)))(kernel)
        return numerics.sum_of_squares({"k": g}), g

    got, g = jax.jit(f)(kernel)
    ref = float(np.sum(np.square(np.asarray(g, np.float64))))
    assert float(got) == pytest.approx(ref, rel=1e-6)
    assert _squared_operands(jax.make_jaxpr(f)(kernel).jaxpr) == ["transpose"]
