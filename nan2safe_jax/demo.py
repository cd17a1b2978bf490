"""The demo run: a real fp16 training run in which activations grow toward fp16's limit.

A small residual MLP is trained in fp16 through ``make_train_step`` while its input scale grows
geometrically (a stand-in for the write-up's attention logits growing with a q/k scale): tier 1
watches the hidden activations, the loss and the gradient norm, and downshifts to STABLE before
the first non-finite value. Printed: step, loss, risk, gear, loss scale.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from nan2safe_jax import detector
from nan2safe_jax.config import Config
from nan2safe_jax.optax import guard
from nan2safe_jax.site import Probe, SiteGear, site_scope
from nan2safe_jax.train import TrainState, make_train_step

GEAR_NAMES = ("FAST", "STABLE", "SAFE")


class _Block(nnx.Module):
    def __init__(self, d: int, *, rngs: nnx.Rngs, dtype=jnp.float16):
        self.up = nnx.Linear(d, 4 * d, rngs=rngs, dtype=dtype, param_dtype=dtype)
        self.down = nnx.Linear(4 * d, d, rngs=rngs, dtype=dtype, param_dtype=dtype)
        self.gear = SiteGear(jnp.zeros((), jnp.int32))
        self.site_name = "block"
        self.probe_hidden = Probe(jnp.zeros(detector.NUM_STATS, jnp.float32))

    def __call__(self, x):
        with site_scope(self.site_name):
            h = self.up(x)
            self.probe_hidden[...] = detector.stats(h)
            return x + self.down(jax.nn.gelu(h))


class _Net(nnx.Module):
    def __init__(self, d: int, *, rngs: nnx.Rngs, dtype=jnp.float16):
        self.blocks = nnx.List([_Block(d, rngs=rngs, dtype=dtype) for _ in range(2)])
        self.head = nnx.Linear(d, 1, rngs=rngs, dtype=dtype, param_dtype=dtype)

    def __call__(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _loss(model, batch):
    x, y = batch
    out = model(x).astype(jnp.float32)
    return jnp.mean(jax.nn.softplus(out) - y * out)


def run_tier1_demo(steps: int = 160, calm_steps: int = 80, growth: float = 1.3, seed: int = 0):
    """Trains the fp16 MLP through growing activations; returns the per-step records."""
    d = 32
    rng = np.random.default_rng(seed)
    base_x = rng.normal(size=(16, 64, d)).astype(np.float32)
    base_y = (base_x.sum(-1, keepdims=True) > 0).astype(np.float32)
    cfg = Config(loss_scale_init=2.0**8)
    state = TrainState.create(_Net(d, rngs=nnx.Rngs(seed)), guard(optax.adam(1e-3), cfg), cfg)
    step = make_train_step(_loss)
    records = []
    print(f"{'step':>5} {'loss':>10} {'risk':>5} {'gear':>7} {'loss_scale':>10}  event")
    for t in range(steps):
        scale = 1.0 if t < calm_steps else growth ** (t - calm_steps + 1)
        x = jnp.asarray(base_x[t % 16] * scale, jnp.float16)
        state, m = step(state, (x, jnp.asarray(base_y[t % 16])))
        rec = {k: float(m[k]) for k in ("loss", "risk", "loss_scale")}
        rec.update(step=t, gear=int(m["gear"]), next_gear=int(m["next_gear"]))
        rec["finite"] = bool(m["finite"])
        records.append(rec)
        event = ""
        if rec["next_gear"] > rec["gear"]:
            event = f"tier 1: downshift {GEAR_NAMES[rec['gear']]} -> {GEAR_NAMES[rec['next_gear']]}"
        elif rec["next_gear"] < rec["gear"]:
            event = f"recovered to {GEAR_NAMES[rec['next_gear']]}"
        if not rec["finite"]:
            event = (event + "; " if event else "") + "non-finite step skipped"
        if event or t % 20 == 0 or t >= calm_steps:
            print(
                f"{t:5d} {rec['loss']:10.4g} {rec['risk']:5.2f} "
                f"{GEAR_NAMES[rec['gear']]:>7} {rec['loss_scale']:10.4g}  {event}"
            )
        if not rec["finite"] and t > calm_steps + 5:
            break
    first_down = next((r["step"] for r in records if r["next_gear"] > r["gear"]), None)
    first_bad = next((r["step"] for r in records if not r["finite"]), None)
    print(f"\nfirst downshift at step {first_down}; first non-finite step {first_bad}")
    return records
