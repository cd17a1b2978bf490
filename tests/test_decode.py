"""nan2safe.decode.generate: a decode loop that rolls a bad token back and re-decodes it one gear
up, compared against a plain decode loop of the same model at the gears it reports.

One tiny fp16 decoder (flax's ``Embed``, ``MultiHeadAttention`` with a KV cache, ``Linear``),
converted. Token 7's embedding row is scaled so that the attention's fp16 logits pass 65504 at
FAST (flax's explicit path, taken with dropout configured): its logits are not finite there,
and they are one gear up.
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import nan2safe_jax as nan2safe
from nan2safe_jax import decode
from nan2safe_jax.gear import Gear

F16 = jnp.float16
B, L, D, V = 2, 8, 16, 32
SCRIPT = [3, 5, 7]  # the tokens fed back first (7: the bad one, fed at step 3), then greedy


class Decoder(nnx.Module):
    def __init__(self, rngs, dtype=F16):
        self.emb = nnx.Embed(V, D, rngs=rngs, dtype=dtype)
        self.attn = nnx.MultiHeadAttention(
            2, D, decode=True, dropout_rate=0.1, deterministic=True, rngs=rngs, dtype=dtype
        )
        self.out = nnx.Linear(D, V, rngs=rngs, dtype=dtype)

    def __call__(self, token):
        x = self.emb(token)[:, None, :]
        return self.out(x + self.attn(x))[:, -1]


def step(model, token):
    return model(token)


def _model(bad_scale: float = 1.0, convert: bool = True, dtype=F16) -> nnx.Module:
    m = Decoder(nnx.Rngs(0), dtype)
    m.emb.embedding[...] = m.emb.embedding[...].at[7].multiply(bad_scale)
    if convert:
        m = nan2safe.nn.convert(m)
    m.attn.init_cache((B, L, D), dtype=dtype)
    return m


def _pick(t: int, logits) -> jax.Array:
    if t < len(SCRIPT):
        return jnp.full((B,), SCRIPT[t], jnp.int32)
    return jnp.argmax(logits, axis=-1)


def _scripted():
    """``pick`` for ``generate``: the script's tokens, then greedy."""
    count = itertools.count()
    return lambda logits: _pick(next(count), logits)


def _plain_decode(model, gears, n):
    """The reference: a plain decode loop, token ``t`` at gear ``gears[t]``, fed as ``generate``
    is fed. Returns the tokens and whether each step's logits were finite."""
    token, tokens, finite = jnp.zeros((B,), jnp.int32), [], []
    for t in range(n):
        decode.set_gear(model, int(gears[t]))
        logits = nnx.jit(step)(model, token)
        finite.append(bool(jnp.isfinite(logits).all()))
        token = _pick(t, logits)
        tokens.append(np.asarray(token))
    return np.stack(tokens, axis=-1), finite


@pytest.mark.parametrize(
    "dtype", [jnp.float16, jnp.bfloat16, jnp.float32], ids=["fp16", "bf16", "f32"]
)
def test_a_healthy_decode_is_the_plain_models_at_fast(dtype):
    got = decode.generate(_model(dtype=dtype), step, jnp.zeros((B,), jnp.int32), 6)
    assert got.tokens.shape == (B, 6) and got.events == [] and (got.gears == 0).all()
    # greedy tokens of the stock flax model, decoded by hand
    plain = _model(convert=False, dtype=dtype)
    token, want = jnp.zeros((B,), jnp.int32), []
    for _ in range(6):
        token = jnp.argmax(nnx.jit(step)(plain, token), axis=-1)
        want.append(np.asarray(token))
    np.testing.assert_array_equal(got.tokens, np.stack(want, axis=-1))


def test_a_non_finite_token_is_rolled_back_and_decoded_one_gear_up():
    traces = []

    def counted(model, token):
        traces.append(1)  # runs once per trace
        return model(token)

    model = _model(bad_scale=1e5)
    got = decode.generate(model, counted, jnp.zeros((B,), jnp.int32), 5, pick=_scripted())
    rollbacks = [e for e in got.events if e["type"] == "rollback"]
    assert rollbacks == [{"type": "rollback", "step": 3, "from": 0, "to": 1}]
    assert got.gears.tolist() == [0, 0, 0, 1, 1]
    assert len(traces) == 1  # the gear is data: one compile for FAST and STABLE
    assert int(model.attn.cache_index[...]) == 5  # the rolled-back token wrote its slot once
    # the same tokens decoded by hand at the gears generate reports, all finite; at FAST the
    # bad token is not
    want, finite = _plain_decode(_model(bad_scale=1e5), got.gears, 5)
    np.testing.assert_array_equal(got.tokens, want)
    assert all(finite)
    assert _plain_decode(_model(bad_scale=1e5), np.zeros(5, int), 5)[1][3] is False


def test_the_gear_comes_back_down_after_calm_tokens():
    cfg = nan2safe.Config(recovery_window=1)
    got = decode.generate(
        _model(bad_scale=1e5), step, jnp.zeros((B,), jnp.int32), 6, cfg, pick=_scripted()
    )
    types = [(e["type"], e["step"]) for e in got.events]
    assert types == [("rollback", 3), ("recover", 3)]
    assert got.gears.tolist() == [0, 0, 0, 1, 0, 0]


def test_a_token_that_no_gear_makes_finite_raises_and_keeps_the_last_good_state():
    model = _model()
    model.emb.embedding[...] = model.emb.embedding[...].at[7].set(jnp.nan)
    with pytest.raises(decode.DecodeError, match="token 3") as info:
        decode.generate(model, step, jnp.zeros((B,), jnp.int32), 5, pick=_scripted())
    assert info.value.step == 3 and info.value.tokens.shape == (B, 3)
    assert int(model.attn.cache_index[...]) == 3  # the cache of the last good token


def test_a_probe_near_the_limit_moves_the_next_tokens_up_before_anything_is_non_finite():
    # token 7's attention logits pass half of fp16's range (headroom_limit: 0.64 of it) but
    # stay finite
    got = decode.generate(
        _model(bad_scale=700.0), step, jnp.zeros((B,), jnp.int32), 5, pick=_scripted()
    )
    assert [e["type"] for e in got.events] == ["downshift"]
    assert got.events[0]["step"] == 3 and got.gears.tolist() == [0, 0, 0, 0, 1]
    assert got.risk[3] == 1.0 and got.events[0]["probes"] == ["attn.probe_logits"]


class SownProbe(Decoder):
    """A probe sown during the call (``site.Probe``), near the fp16 limit at every token (or,
    with ``overflow``, past it: ``h * 6e4`` first)."""

    overflow = False

    def __call__(self, token):
        x = self.emb(token)[:, None, :]
        h = x + self.attn(x)
        m = jnp.max(jnp.abs(h))
        big = h * 6e4 / m if self.overflow else h / m * 6e4
        keep_last = dict(reduce_fn=lambda a, b: b, init_fn=lambda: jnp.zeros(()))
        self.sow(nan2safe.site.Probe, "hprobe", nan2safe.probe.stats(big), **keep_last)
        return self.out(h)[:, -1]


class SownWeights(Decoder):
    def __call__(self, token):
        x = self.emb(token)[:, None, :]
        return self.out(x + self.attn(x, sow_weights=True))[:, -1]


def test_variables_a_call_creates_are_probed_and_rolled_back():
    """review23: the variables were listed before the first token, when a module's sown ones
    do not exist yet. A sown probe was never scored, and a rolled-back token's sown attention
    weights stayed (one entry too many)."""
    model = nan2safe.nn.convert(SownProbe(nnx.Rngs(0)))
    model.attn.init_cache((B, L, D), dtype=F16)
    got = decode.generate(model, step, jnp.zeros((B,), jnp.int32), 3)
    assert got.events == [{"type": "downshift", "step": 0, "risk": 1.0, "probes": ["hprobe"]}]
    # a probe that reads an inf is a fault, as in the train step, even with finite logits: this
    # one is outside every site, so no gear cures it
    model = nan2safe.nn.convert(SownProbe(nnx.Rngs(0)))
    model.overflow = True
    model.attn.init_cache((B, L, D), dtype=F16)
    with pytest.raises(decode.DecodeError, match="token 0: logits or a probe"):
        decode.generate(model, step, jnp.zeros((B,), jnp.int32), 3)

    # a probe the decode step never writes (a norm run once, outside decoding, on an input that
    # overflowed it) reads zeros, not its stale inf: review28 saw every token fail on it
    model = _model()
    model.spare = nan2safe.nn.LayerNorm(D, dtype=F16, rngs=nnx.Rngs(0))
    model.spare(jnp.full((1, D), jnp.inf, F16))
    assert not bool(nan2safe.probe.rows_finite(model.spare.probe_input[...]))
    got = decode.generate(model, step, jnp.zeros((B,), jnp.int32), 3)
    assert got.tokens.shape == (B, 3) and got.events == []

    model = SownWeights(nnx.Rngs(0))
    model.emb.embedding[...] = model.emb.embedding[...].at[7].multiply(1e5)
    model = nan2safe.nn.convert(model)
    model.attn.init_cache((B, L, D), dtype=F16)
    got = decode.generate(model, step, jnp.zeros((B,), jnp.int32), 5, pick=_scripted())
    assert [e["type"] for e in got.events] == ["rollback"]
    sown = jax.tree_util.tree_leaves(
        nnx.state(model, nnx.Intermediate), is_leaf=lambda x: isinstance(x, tuple)
    )
    assert [len(x) for x in sown] == [5]  # one per token decoded, none of the rejected try


@pytest.mark.parametrize(
    "kw, field",
    [({"steps": -1}, "steps"), ({"cfg": {"window": 3}}, "cfg")],
    ids=["steps", "cfg"],
)
def test_bad_arguments_are_value_errors_naming_them(kw, field):
    args = {"steps": 2} | kw
    with pytest.raises(ValueError, match=field):
        decode.generate(_model(), step, jnp.zeros((B,), jnp.int32), **args)


def test_misuse_is_a_value_error_at_the_first_token():
    """newuser38: these failed deep in flax, or (a ``jax.jit`` step, which does not write the
    model's cache back) decoded wrong tokens silently."""
    zero = jnp.zeros((B,), jnp.int32)
    with pytest.raises(ValueError, match="did not update the model's KV cache"):
        decode.generate(_model(), jax.jit(step), zero, 2)
    with pytest.raises(ValueError, match="pick must return integer tokens"):
        decode.generate(_model(), step, zero, 2, pick=lambda logits: jnp.argmax(logits))
    with pytest.raises(ValueError, match="step_fn must return"):
        decode.generate(_model(), lambda m, tok: (m(tok), None)[1], zero, 2)
    with pytest.raises(ValueError, match="token must be integer"):
        decode.generate(_model(), step, jnp.zeros((B,)), 2)


def test_a_failure_at_the_first_token_and_a_raising_step_leave_the_model_at_fast():
    model = _model()
    model.emb.embedding[...] = model.emb.embedding[...].at[0].set(jnp.nan)
    with pytest.raises(decode.DecodeError) as info:
        decode.generate(model, step, jnp.zeros((B,), jnp.int32), 3)
    assert info.value.step == 0 and info.value.tokens.shape == (B, 0)
    assert all(int(v.get_value()) == 0 for v in nan2safe.site.site_gears(model).values())

    def broken_pick(logits):
        raise RuntimeError("the sampler failed")

    model = _model(bad_scale=1e5)
    with pytest.raises(RuntimeError, match="sampler"):
        decode.generate(model, step, jnp.full((B,), 7, jnp.int32), 3, pick=broken_pick)
    assert all(int(v.get_value()) == 0 for v in nan2safe.site.site_gears(model).values())


def test_a_model_without_sites_is_told_to_convert():
    with pytest.raises(ValueError, match="convert"):
        decode.generate(_model(convert=False), step, jnp.zeros((B,), jnp.int32), 2)


def test_set_gear_sets_every_site():
    model = _model()
    decode.set_gear(model, Gear.SAFE)
    gears = nan2safe.site.site_gears(model)
    assert gears and all(int(v.get_value()) == 2 for v in gears.values())
