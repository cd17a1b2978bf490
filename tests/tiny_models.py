"""Tiny models shared by the core tests: a user-written site with a declared probe."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from nan2safe_jax import detector
from nan2safe_jax.ops import dispatch
from nan2safe_jax.site import Probe, SiteGear, site_gears, site_scope

D = 16

# LLVM at -O0: XLA's HLO passes still run, LLVM's are skipped; compiles take a fifth to a half
# less time. The whole suite runs so (tests/conftest.py puts LLVM_O0 in XLA_FLAGS; a test's
# subprocess with XLA_FLAGS of its own adds it there). The last bits of a result can move with
# it (a converted model's FAST forward stops matching flax's bit for bit), so a test that
# compares bits with flax compiles at XLA's default level (3), as a user's program is compiled.
# With them, where this jaxlib knows the flag, the older fusion emitters (tests/conftest.py);
# ``BITS_OPTIONS`` compiles with the default ones again.
LLVM_O0 = os.environ.get("NAN2SAFE_TEST_XLA_FLAGS", "--xla_backend_optimization_level=0")
DEFAULT_EMITTERS = (
    {"xla_cpu_use_fusion_emitters": True} if "fusion_emitters=false" in LLVM_O0 else {}
)
BITS_OPTIONS = {"xla_backend_optimization_level": 3, **DEFAULT_EMITTERS}
jit_llvm_default = functools.partial(jax.jit, compiler_options=BITS_OPTIONS)


def jit_bits(fn):
    """``nnx.jit(fn)`` for ``fn(module, *arrays)``, compiled with XLA's default fusion emitters
    (``DEFAULT_EMITTERS``; ``nnx.jit`` takes no ``compiler_options``): for a comparison of bits
    with flax at the suite's LLVM level. The module's state after the call is written back, as
    ``nnx.jit`` does."""
    if not DEFAULT_EMITTERS:
        return nnx.jit(fn)

    def run(module, *args):
        graphdef, state = nnx.split(module)

        def pure(state, *args):
            m = nnx.merge(graphdef, state)
            return fn(m, *args), nnx.state(m)

        out, new = jax.jit(pure, compiler_options=DEFAULT_EMITTERS)(state, *args)
        nnx.update(module, new)
        return out

    return run


def run_on_devices(script: str, devices: int, *args: str, timeout: int = 600) -> dict:
    """Runs ``python script *args`` with ``devices`` simulated CPU devices (LLVM at -O0) from
    the repository root, and returns the JSON of its last stdout line. The main pytest process
    imported JAX with one device, so a multi-device test runs its body in such a subprocess."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices} {LLVM_O0}"
    env["JAX_PLATFORMS"] = "cpu"
    proc = subprocess.run(
        [sys.executable, script, *args],
        env=env,
        cwd=Path(__file__).resolve().parents[1],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stderr[-6000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def set_fast_only(module: nnx.Module) -> nnx.Module:
    """Every site gear of ``module`` (in place) FAST known at trace time: what the train step's
    FAST-only program traces (each site's FAST path, no gear switch). Returns ``module``."""
    for var in site_gears(module).values():
        var.set_value(dispatch.fast_only_gear(jnp.shape(var.get_value())))
    return module


class Block(nnx.Module):
    """A minimal user-written site: its own gear, one declared probe, a residual MLP."""

    def __init__(self, d, *, rngs, dtype=jnp.float32):
        self.up = nnx.Linear(d, 2 * d, rngs=rngs, dtype=dtype, param_dtype=dtype)
        self.down = nnx.Linear(2 * d, d, rngs=rngs, dtype=dtype, param_dtype=dtype)
        self.gear = SiteGear(jnp.zeros((), jnp.int32))
        self.site_name = "Block"
        self.probe_hidden = Probe(jnp.zeros(detector.NUM_STATS, jnp.float32))

    def __call__(self, x):
        with site_scope(self.site_name):
            h = self.up(x)
            self.probe_hidden[...] = detector.stats(h)
            return x + self.down(jax.nn.relu(h))


class Net(nnx.Module):
    def __init__(self, *, rngs, dtype=jnp.float32):
        self.blocks = nnx.List([Block(D, rngs=rngs, dtype=dtype) for _ in range(2)])
        self.head = nnx.Linear(D, 1, rngs=rngs, dtype=dtype, param_dtype=dtype)

    def __call__(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def loss_fn(model, batch):
    x, y = batch
    return jnp.mean(jnp.square(model(x).astype(jnp.float32) - y))


def logistic_loss(model, batch):
    x, y = batch
    out = model(x).astype(jnp.float32)
    return jnp.mean(jax.nn.softplus(out) - (y > 0) * out)


def data(n, scale=None, seed=0, dtype=jnp.float32):
    """``n`` batches ``(x f[n, 32, D], y f32[n, 32, 1])``."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 32, D)).astype(np.float32)
    if scale is not None:
        x *= np.asarray(scale, np.float32)[:, None, None]
    y = np.sin(x.sum(-1, keepdims=True) / 4)
    return jnp.asarray(x, dtype), jnp.asarray(y, jnp.float32)


class Monitor(nnx.Variable):
    """A user's running statistic: written by the forward pass, not by the optimizer."""


class MonitoredNet(nnx.Module):
    """``Net`` plus a running monitor of its input's peak, outside every site: ``max|x| ** 8``
    overflows f32 for a batch of large (finite) values while the loss stays finite."""

    def __init__(self, *, rngs):
        self.net = Net(rngs=rngs)
        self.peak = Monitor(jnp.zeros((), jnp.float32))

    def __call__(self, x):
        self.peak[...] = 0.9 * self.peak[...] + 0.1 * jnp.max(jnp.abs(x)) ** 8
        return self.net(x)


class FragileBlock(nnx.Module):
    """A site with a real degenerate case: LayerNorm with eps=0 turns a constant row into 0/0.

    FAST/STABLE: ``(h - mean) / sqrt(var)``; SAFE: the variance is floored and a zero-variance
    row normalises to 0 (what ``nan2safe.ops.layer_norm`` does in SAFE).
    """

    def __init__(self, d, *, rngs):
        self.up = nnx.Linear(d, d, rngs=rngs)
        self.gear = SiteGear(jnp.zeros((), jnp.int32))
        self.site_name = "FragileBlock"
        self.probe_out = Probe(jnp.zeros(detector.NUM_STATS, jnp.float32))

    def __call__(self, x):
        with site_scope(self.site_name):
            mean = jnp.mean(x, -1, keepdims=True)
            var = jnp.mean(jnp.square(x - mean), -1, keepdims=True)

            def fast(x):
                return (x - mean) / jnp.sqrt(var)

            def safe(x):
                ok = var > 0
                inv = jnp.where(ok, 1.0 / jnp.sqrt(jnp.where(ok, var, 1.0)), 0.0)
                return (x - mean) * inv

            y = jax.lax.switch(jnp.clip(self.gear[...], 0, 2), [fast, fast, safe], x)
            self.probe_out[...] = detector.stats(y)
            return self.up(y)


class FragileNet(nnx.Module):
    def __init__(self, *, rngs):
        self.blocks = nnx.List([FragileBlock(D, rngs=rngs), FragileBlock(D, rngs=rngs)])
        self.head = nnx.Linear(D, 1, rngs=rngs)

    def __call__(self, x):
        for b in self.blocks:
            x = x + b(x)
        return self.head(x)


def make_fragile():
    """Factory for ``nan2safe locate --factory tiny_models:make_fragile``."""
    import optax

    from nan2safe_jax import Config

    cfg = Config(checkpoint_every=5, safe_max_steps=3, recovery_window=8, min_history=8)
    return FragileNet(rngs=nnx.Rngs(0)), optax.adam(1e-2), loss_fn, cfg


def loss_with_aux(model, batch):
    """``loss_fn`` and the mean prediction as aux (a ``has_aux=True`` loss)."""
    x, _ = batch
    out = model(x).astype(jnp.float32)
    return loss_fn(model, batch), {"mean_out": jnp.mean(out), "rows": out}


def make_fragile_aux():
    """``make_fragile`` with ``loss_with_aux``: for ``Trainer(has_aux=True, factory=...)``."""
    model, tx, _, cfg = make_fragile()
    return model, tx, loss_with_aux, cfg
