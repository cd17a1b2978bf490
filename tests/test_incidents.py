"""Tier 2's host decisions (``nan2safe_jax.incidents``): which steps a loss scale can save."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from nan2safe_jax import incidents


def _grad_of(dtype, nest):
    """``jax.grad`` of a small loss computing in ``dtype``, its ops nested as ``nest`` says."""

    def core(w, x):
        return jnp.tanh(x.astype(dtype) @ w.astype(dtype)).astype(jnp.float32).sum()

    if nest == "scan":

        def loss(w, x):
            def body(c, xi):
                return c + core(w, xi[None]), None

            return lax.scan(body, jnp.float32(0), x)[0]

    elif nest == "remat":
        loss = jax.checkpoint(core)
    elif nest == "cond":

        def loss(w, x):
            return lax.cond(x.sum() > 0, core, lambda w, x: jnp.float32(0), w, x)

    else:
        loss = core
    return jax.jit(jax.grad(loss))


@pytest.mark.parametrize(
    "dtype, narrow, nest",
    [(jnp.float32, False, n) for n in ("flat", "scan", "remat", "cond")]
    + [(jnp.float16, True, n) for n in ("flat", "scan", "remat", "cond")]
    + [(jnp.bfloat16, False, "flat"), (jnp.float8_e4m3fn, True, "flat")]
    + [(jnp.float8_e5m2, True, "scan")],
    ids=lambda v: getattr(v, "__name__", str(v)),
)
def test_a_loss_scale_matters_only_where_a_value_is_narrower_than_bfloat16(dtype, narrow, nest):
    """fp16 and fp8 gradients are what a loss scale keeps in range; bf16 and f32 reach ~3.4e38,
    so a non-finite gradient there is a fault, however deep in the program the value is."""
    w, x = jnp.ones((4, 3), jnp.float32), jnp.ones((2, 4), jnp.float32)
    assert incidents.loss_scale_matters(_grad_of(dtype, nest), w, x) is narrow
    assert incidents.holds_narrow_float(jax.make_jaxpr(_grad_of(dtype, nest))(w, x)) is narrow


def test_a_prng_key_or_an_integer_is_no_float():
    def f(key, n):
        return jax.random.normal(key, (3,)) * n

    jaxpr = jax.make_jaxpr(f)(jax.random.key(0), np.int32(2))
    assert not incidents.holds_narrow_float(jaxpr)


def test_a_step_that_cannot_be_traced_keeps_the_steps_own_rule():
    def f(x, y):
        raise RuntimeError("not traceable here")

    assert incidents.loss_scale_matters(f, 1.0, 2.0) is True


def _unsited(primitive="rsqrt", source="/home/u/model.py:17"):
    base = incidents.Report.no_equation(
        kind="inf",
        inputs=[],
        channels={},
        diagnosis="division by ~0",
        explanation="",
        replays=1,
        seconds=0.1,
    )
    return dataclasses.replace(base, primitive=primitive, source=source, user_source=source)


@pytest.mark.parametrize("sites", [{}, {"head": ()}], ids=["no_sites", "converted"])
def test_the_hint_for_a_culprit_outside_every_site_fits_the_model(sites):
    """A model with no sites is told to run convert; a converted one (newuser40's CNN, whose
    BatchNorm convert left alone) was told the same, and is now told what is left to do."""
    hint = incidents.unsited_hint(_unsited(), sites, nearest="head" if sites else None)
    assert "model.py:17" in hint and "outside every site" in hint
    if sites:
        assert "nearest site is 'head'" in hint and "nn.Site(" in hint
        assert "run nan2safe.nn.convert" not in hint and "left alone" in hint
    else:
        assert "no sites at all" in hint and "run nan2safe.nn.convert(model)" in hint


def _bookkeeping(big):
    square = dataclasses.replace(
        _unsited("square", incidents._PACKAGE + "numerics.py:145"),
        inputs=[{"max_abs": big, "shape": [8]}],
    )
    assert incidents.in_step_bookkeeping(square)
    return square


@pytest.mark.parametrize(
    "big, scale, cures",
    [(1e30, 32768.0, False), (1e22, 32768.0, True), (1e22, 1.0, False), (1e19, 1.0, True)],
)
def test_no_loss_scale_cures_gradients_that_square_past_f32_at_the_smallest_scale(
    big, scale, cures
):
    """The scaled gradients at ``scale``, brought to ``loss_scale_min`` (1), against f32's
    square root of max (~1.84e19)."""
    want = big / scale * 1.0 > float(np.sqrt(np.finfo(np.float32).max))
    assert want is not cures
    assert incidents.no_scale_cures(_bookkeeping(big), scale, 1.0) is want
    # a sum of the squares past f32 (no one square is) is what halving cures, whatever it read
    summed = dataclasses.replace(_bookkeeping(big), primitive="reduce_sum")
    assert incidents.no_scale_cures(summed, scale, 1.0) is False


def test_the_hint_for_the_steps_own_sum_of_squares_names_the_largest_weights():
    params = {
        "head": {"kernel": jnp.full((2, 2), -(2.0**49), jnp.bfloat16)},  # bf16: not np.inexact
        "blocks": [{"up": {"kernel": jnp.ones((2,)) * 0.5}}, {"up": {"kernel": jnp.ones(3)}}],
        "step": jnp.int32(7),  # no float: never named
    }
    largest = incidents.largest_weights(params, k=2)
    assert largest == "head.kernel (5.63e+14), blocks.1.up.kernel (1)", largest
    hint = incidents.unsited_hint(_bookkeeping(1e30), {"head": ()}, nearest=largest)
    assert "own bookkeeping" in hint and hint.endswith(f"(the largest: {largest})")


def test_an_empty_batch_is_every_row_leaf_with_no_rows():
    empty = {"x": np.zeros((0, 4), np.float32), "y": np.zeros((0,), np.int32)}
    assert incidents.empty_batch(empty) == "['x']"
    with_key = dict(empty, key=jax.random.key(0), scale=np.float32(2.0))
    assert incidents.empty_batch(with_key) == "['x']"  # a key and a scalar hold no rows
    assert incidents.empty_batch({"x": np.zeros((0, 4)), "y": np.zeros((3,))}) is None
    assert incidents.empty_batch({"x": np.zeros((2, 0))}) is None  # rows with no features
    assert incidents.empty_batch({"s": np.float32(1.0)}) is None
    text = str(incidents.empty_report(empty, "['x']"))
    assert "polluted input: ['x']" in text and "the batch has no rows" in text  # said in print
