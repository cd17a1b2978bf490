"""replay/reach.py: which outputs a culprit's value can reach (forward dataflow over a jaxpr)."""

import jax
import jax.numpy as jnp
from jax import lax

from nan2safe_jax.replay import _jax_compat as jc
from nan2safe_jax.replay import reach


def _f(w, x):
    @jax.jit
    def inner(w, x):
        a = jnp.log(x)  # eqn 0 of the body: reaches output 0 only
        b = w * 2.0  # eqn 1: reaches output 1 only
        return a.sum(), b

    s, b = inner(w, x)
    c = lax.fori_loop(0, 3, lambda i, v: v + b, b)  # a loop: every output of it
    return s, c, x + 1.0


def test_a_value_reaches_the_outputs_it_flows_into_through_calls_and_loops():
    top, _ = jc.open_jaxpr(jax.make_jaxpr(_f)(jnp.ones(3), jnp.ones(3)))
    call = next(i for i, e in enumerate(top.eqns) if jc.call_body(e) is not None)
    assert reach.tainted_outputs(top, (call, 0)) == {0}
    assert reach.tainted_outputs(top, (call, 1)) == {1}
    assert reach.tainted_outputs(top, (call,)) == {0, 1}  # the call as a whole
    loop = next(i for i, e in enumerate(top.eqns) if e.primitive.name in ("while", "scan"))
    assert reach.tainted_outputs(top, (loop, ("iter", 1), 0)) == {1}
    assert reach.reaches(top, (call, 0), [0]) and not reach.reaches(top, (call, 0), [1, 2])
    assert reach.tainted_outputs(top, ()) == {0, 1, 2}  # no equation named: every output
