"""Tier 2 inside ``shard_map`` and ``pmap`` (8 simulated CPU devices, in a subprocess).

``jax.pmap`` lowers to ``jit(shard_map(...))`` on jax >= 0.8, so both go through the ``shard_map``
rule: the body is replayed under the same ``shard_map`` with flags as extra per-shard outputs,
and the report names the primitive, its line, the kind and the shard / device.
"""

from __future__ import annotations

import json
from pathlib import Path

from tiny_models import run_on_devices


def _run() -> dict:
    # LLVM at -O0: less compile time; where a NaN or inf first appears does not depend on it
    return run_on_devices(__file__, 8, "run")


def _line(marker: str) -> int:
    src = Path(__file__).read_text().splitlines()
    hits = [i + 1 for i, s in enumerate(src) if s.rstrip().endswith(f"# FAULT:{marker}")]
    assert len(hits) == 1, marker
    return hits[0]


def test_shard_map_and_pmap_name_the_shard():
    out = _run()
    for case, (prim, marker, kind, shard) in {
        "shard_map_psum": ("log", "sm_log", "nan", 2),
        "shard_map_one_input": ("div", "sm_div", "inf", 5),
        "pmap": ("log", "pmap_log", "nan", 6),
        "grad_pmap": ("div", "gp_sqrt", "inf", 3),  # d sqrt(x) = 0.5 / sqrt(x) at x = 0
        # jax.make_mesh's default axes (Explicit in jax 0.10), and a fault made from the
        # device's own index, which the replay's liveness loop must carry as device-varying
        "explicit_mesh": ("log", "sm_log", "nan", 2),
        "axis_index": ("sqrt", "sm_idx", "nan", 3),
    }.items():
        r = out[case]
        assert r["primitive"] == prim, (case, r)
        assert r["source"].endswith(f"test_replay_shard.py:{_line(marker)}"), (case, r)
        assert r["kind"] == kind and r["shard"] == shard, (case, r)
        assert r["device"] == f"TFRT_CPU_{shard}" or r["device"].endswith(str(shard)), r
        assert any(isinstance(p, list) and p[0] == "shard" for p in r["eqn_path"]), r
    assert out["clean"] is None


# ----------------------------------------------------------------- the cases (in the subprocess)


def _cases() -> dict:
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    from nan2safe_jax import replay

    assert jax.device_count() == 8, jax.device_count()
    mesh = jax.make_mesh((8,), ("i",), axis_types=(jax.sharding.AxisType.Auto,))

    def loc(f, *args):
        r = replay.locate(jax.make_jaxpr(f)(*args), args)
        return None if r is None else r.to_dict()

    def psum_body(x):
        y = jnp.log(x)  # FAULT:sm_log
        return jax.lax.psum(y, "i")

    sm = jax.jit(jax.shard_map(psum_body, mesh=mesh, in_specs=P("i"), out_specs=P()))
    x = jnp.arange(1.0, 17.0).at[5].set(-1.0)  # shard 2 holds rows 4, 5

    def div_body(x, d):
        return x / d  # FAULT:sm_div

    sm2 = jax.jit(jax.shard_map(div_body, mesh=mesh, in_specs=(P("i"), P("i")), out_specs=P("i")))
    d = jnp.ones((16, 4)).at[11, 2].set(0.0)  # shard 5 holds rows 10, 11

    pm = jax.pmap(lambda x: jnp.log(x).sum())  # FAULT:pmap_log
    xp = jnp.arange(1.0, 17.0).reshape(8, 2).at[6, 1].set(-3.0)

    def gp(x):
        return jax.pmap(lambda x: jnp.sqrt(x).sum())(x).sum()  # FAULT:gp_sqrt

    xg = jnp.arange(1.0, 17.0).reshape(8, 2).at[3, 0].set(0.0)

    explicit = jax.make_mesh((8,), ("i",))  # the default axis types
    sm_e = jax.jit(jax.shard_map(psum_body, mesh=explicit, in_specs=P("i"), out_specs=P()))

    def idx_body(x):
        y = jnp.where(jax.lax.axis_index("i") == 3, -1.0, 1.0) * x
        return jax.lax.psum(jnp.sqrt(y).sum(), "i")  # FAULT:sm_idx

    sm_i = jax.jit(jax.shard_map(idx_body, mesh=mesh, in_specs=P("i"), out_specs=P()))
    return {
        "explicit_mesh": loc(sm_e, jax.device_put(x, jax.NamedSharding(explicit, P("i")))),
        "axis_index": loc(sm_i, jnp.arange(1.0, 17.0)),
        "shard_map_psum": loc(sm, x),
        "shard_map_one_input": loc(sm2, jnp.ones((16, 4)), d),
        "pmap": loc(pm, xp),
        "grad_pmap": loc(jax.grad(gp), xg),
        "clean": loc(sm, jnp.arange(1.0, 17.0)),
    }


if __name__ == "__main__":
    print(json.dumps(_cases(), default=str))
