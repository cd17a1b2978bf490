"""Geared ops inside ``shard_map`` with a replicated weight: gradients at every gear, traced or
not, equal the same op's on the whole batch without ``shard_map`` (2 simulated CPU devices, in
a subprocess).

A ``custom_vjp``'s backward must return each cotangent with its primal's type: a weight that is
invariant over the mesh (``P()``) gets its per-device cotangent summed (``psum``), as JAX's own
autodiff does. The SAFE kernels and the gear switch returned it varying: a type error at the
first gradient (review22).
"""

from __future__ import annotations

import json
import sys

import jax.numpy as jnp
import numpy as np
from tiny_models import run_on_devices

from nan2safe_jax.manual_axes import cotangents_like, varying_axes

OPS = ("rms_norm", "layer_norm", "softmax", "linear")


def test_outside_shard_map_cotangents_are_unchanged():
    ct, w = jnp.ones(3), jnp.zeros(3)
    assert varying_axes(ct) == frozenset()
    got = cotangents_like((ct, None), (w, None))
    assert got[0] is ct and got[1] is None


def test_geared_ops_differentiate_in_shard_map_with_a_replicated_weight():
    out = run_on_devices(__file__, 2, "run")
    assert sorted(out) == sorted(f"{op}/{g}/{t}" for op in OPS for g in (0, 1, 2) for t in "ts")
    bad = {k: v for k, v in out.items() if not v <= 1e-5}  # a NaN error is bad too
    assert not bad, bad


def _run() -> dict:
    import jax
    from jax import lax
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    from nan2safe_jax import ops

    mesh = Mesh(np.array(jax.devices()[:2]), ("d",))
    rng = np.random.default_rng(0)
    xs = jnp.asarray(rng.normal(size=(4, 6)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(6,)), jnp.float32)
    kernel = jnp.asarray(rng.normal(size=(6, 6)), jnp.float32)

    def apply(op, x, w, g):
        if op == "rms_norm":
            return ops.rms_norm(x, w, gear=g)
        if op == "layer_norm":
            return ops.layer_norm(x, w, w * 0.5, gear=g)
        if op == "softmax":
            return ops.softmax(x * w, gear=g)
        return ops.linear(x, kernel * w, gear=g)

    def whole(x, w, op, g):
        return jnp.sum(apply(op, x, w, g) ** 2)

    def sharded(x, w, gear, op, g):
        """``g`` None: the gear traced (``gear``, one program for every gear); else static."""

        def body(xb, w, gear):
            return lax.psum(jnp.sum(apply(op, xb, w, gear if g is None else g) ** 2), "d")

        specs = (P("d"), P(), P())
        return jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=P())(x, w, gear)

    whole_grad = jax.jit(jax.grad(whole, argnums=(0, 1)), static_argnums=(2, 3))
    sharded_grad = jax.jit(jax.grad(sharded, argnums=(0, 1)), static_argnums=(3, 4))
    out = {}
    for op in OPS:
        for g in (0, 1, 2):
            want = whole_grad(xs, w, op, g)
            for traced in (True, False):
                got = sharded_grad(xs, w, jnp.int32(g), op, None if traced else g)
                err = max(
                    float(jnp.max(jnp.abs(a - b)) / (1 + float(jnp.max(jnp.abs(b)))))
                    for a, b in zip(got, want, strict=True)
                )
                out[f"{op}/{g}/{'t' if traced else 's'}"] = err
    return out


if __name__ == "__main__" and sys.argv[1:] == ["run"]:
    print(json.dumps(_run()))
