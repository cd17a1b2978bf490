"""The Flax NNX MNIST tutorial's CNN, in fp16, adopted with ``nan2safe.nn.convert``.

Source: the ``CNN`` of the Flax NNX MNIST tutorial (https://github.com/google/flax,
``docs_nnx/mnist_tutorial.md``; Apache-2.0): two ``nnx.Conv`` (1->32, 32->64, 3x3) each
followed by ReLU and 2x2 average pooling, then ``nnx.Linear(3136, 256)``, ReLU,
``nnx.Linear(256, 10)``, trained with ``optax.softmax_cross_entropy_with_integer_labels``.
Changed: a compute ``dtype`` (float16 here; parameters stay f32), a ``linear1_init`` argument,
and the loss takes the logits in f32 (as mixed-precision recipes do).

The fault: ``linear1``'s weights far too large for fp16, so its 3136-term dot products pass
65504 and the fp16 output is ``inf``. Here they are made so by the initializer
(``linear1_init=normal(stddev=2000.0)``, about 10^5 times ``lecun_normal``'s scale): a stand-in
for weights grown that large by training, which would take many steps to reproduce.
``convert`` makes the two ``nnx.Conv`` layers and ``linear1`` and ``linear2`` sites; tier 2
then names ``linear1`` and puts it alone in SAFE (f32 arithmetic, saturated back to fp16).

Run it: ``python -m examples.nnx_cnn`` from the repository root (a ``Trainer`` through the
fault, every step printed); ``pytest -m slow tests/test_adopt_examples.py`` checks it.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

import nan2safe_jax as nan2safe

__all__ = ["CNN", "build", "loss_fn", "make_batch"]


class CNN(nnx.Module):
    """A simple CNN model (the tutorial's), with a compute ``dtype``."""

    def __init__(
        self,
        *,
        dtype: Any = None,
        linear1_init: Any = nnx.initializers.lecun_normal(),
        rngs: nnx.Rngs,
    ):
        self.conv1 = nnx.Conv(1, 32, kernel_size=(3, 3), dtype=dtype, rngs=rngs)
        self.conv2 = nnx.Conv(32, 64, kernel_size=(3, 3), dtype=dtype, rngs=rngs)
        self.avg_pool = partial(nnx.avg_pool, window_shape=(2, 2), strides=(2, 2))
        self.linear1 = nnx.Linear(3136, 256, kernel_init=linear1_init, dtype=dtype, rngs=rngs)
        self.linear2 = nnx.Linear(256, 10, dtype=dtype, rngs=rngs)

    def __call__(self, x):
        x = self.avg_pool(nnx.relu(self.conv1(x)))
        x = self.avg_pool(nnx.relu(self.conv2(x)))
        x = x.reshape(x.shape[0], -1)  # flatten
        x = nnx.relu(self.linear1(x))
        return self.linear2(x)


def loss_fn(model: CNN, batch) -> jax.Array:
    """The tutorial's loss, on f32 logits."""
    logits = model(batch["image"]).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(
        logits=logits, labels=batch["label"]
    ).mean()


def make_batch(key, batch: int = 4):
    """Random 28x28 grey images in [0, 1] (float16) and labels."""
    k1, k2 = jax.random.split(key)
    image = jax.random.uniform(k1, (batch, 28, 28, 1)).astype(jnp.float16)
    return {"image": image, "label": jax.random.randint(k2, (batch,), 0, 10)}


def build(*, faulty: bool = True, seed: int = 0):
    """The fp16 CNN (with the fault when ``faulty``), converted. Returns ``(model, report)``."""
    init = nnx.initializers.normal(stddev=2000.0) if faulty else nnx.initializers.lecun_normal()
    model = CNN(dtype=jnp.float16, linear1_init=init, rngs=nnx.Rngs(seed))
    return nan2safe.nn.convert(model, return_report=True)


if __name__ == "__main__":  # python -m examples.nnx_cnn (from the repository root)
    from examples._fit import fit_through_the_fault

    model, report = build(faulty=True)
    batches = [make_batch(jax.random.key(i)) for i in range(6)]
    fit_through_the_fault(model, loss_fn, batches, report)
