"""The main job: train the example transformer in fp16 through real numerical faults, twice.

Run with ``make demo`` (or ``nan2safe demo``). A character-level decoder (2 layers, d_model 128,
fp16 compute, f32 parameters) learns a synthetic arithmetic corpus. Its attention has dropout
configured (``attn_dropout``), so ``flax.nnx.MultiHeadAttention`` takes its explicit-weights path
with the logits in fp16. What goes wrong:

1. From step ``SPIKE`` the q·k scale of layer 1 grows geometrically for a while and then relaxes
   (the attention-logit growth of the write-up: a head whose q/k norms blow up). In fp16 the
   logits pass 65504, overflow to inf, and softmax turns inf - inf into NaN.
2. At step ``JUMP`` the q·k scale of layer 0 jumps for one step (no precursor to see): the fp16
   logits overflow at once.
3. At steps ``LEFT_PADDED`` the data loader hands over a left-padded batch: a padding query sees
   only padding keys. flax fills masked logits with the dtype's minimum, so the row is finite in
   both arms (it was a 0/0 in our old FAST softmax; kept to show it is no fault).

Arm 1, plain optax: the model on stock ``flax.nnx`` layers (``layers="flax"``), adamw, fp16
compute: dies at the first fault, loss NaN. Arm 2, nan2safe: the same model with the
``nan2safe.nn`` sites swapped in (``layers="nan2safe"``: same parameters, same FAST numerics),
trained by the Trainer: tier 1 sees the logits racing toward the limit and downshifts to STABLE
(f32 logits) before anything overflows; staged recovery brings it back to FAST; at the jump
tier 2 replays the failing step, names the attention of layer 0, puts that site in SAFE and
training carries on.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import sys
import time
from pathlib import Path

_REPO = Path(__file__).resolve().parents[1]
if str(_REPO) not in sys.path:
    sys.path.insert(0, str(_REPO))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

import nan2safe_jax as nan2safe  # noqa: E402
from examples.transformer import Transformer, TransformerConfig, lm_loss, set_knob  # noqa: E402
from nan2safe_jax import report as report_lib  # noqa: E402

STEPS = 240
DEFAULT_WORKDIR = _REPO / "runs" / "demo"  # the demo's own folder: always replaced
SPIKE = 70  # first step of the q·k scale growth
SPIKE_UP, SPIKE_HOLD, SPIKE_DOWN = 24, 10, 16
SPIKE_RATE = 1.5
JUMP, JUMP_SCALE = 190, 1e5  # one step: the q·k scale of layer 0
LEFT_PADDED = (150,)
GEARS = ("FAST", "STABLE", "SAFE")
MODEL = TransformerConfig(
    num_layers=2,
    d_model=128,
    num_heads=4,
    seq_len=64,
    vocab=128,
    dtype=jnp.float16,
    param_dtype=jnp.float32,
    pad_mask="keys",
    attn_dropout=0.1,
    layers="nan2safe",  # the nan2safe arm; the plain arm builds it with layers="flax"
)
CFG = nan2safe.Config(
    min_history=24, safe_max_steps=8, recovery_window=32, checkpoint_every=40, log_every=1
)
LR = 2e-3
BATCH = 8


# ------------------------------------------------------------------------------ data


def corpus(n_lines: int = 4000, seed: int = 0) -> str:
    """Synthetic arithmetic sentences ("seven plus two is nine."), deterministic."""
    words = "zero one two three four five six seven eight nine ten eleven twelve".split()
    words += "thirteen fourteen fifteen sixteen seventeen eighteen".split()
    rng = np.random.default_rng(seed)
    lines = []
    for _ in range(n_lines):
        a, b = rng.integers(0, 10, 2)
        if rng.random() < 0.5:
            lines.append(f"{words[a]} plus {words[b]} is {words[a + b]}.")
        else:
            hi, lo = max(a, b), min(a, b)
            lines.append(f"{words[hi]} minus {words[lo]} is {words[hi - lo]}.")
    return " ".join(lines)


def batches(steps: int, seed: int = 0):
    """Character batches ``{"tokens", "mask"}``; right-padded, except the left-padded ones."""
    text = np.frombuffer(corpus().encode("ascii"), np.uint8).astype(np.int32)
    rng = np.random.default_rng(seed)
    t = MODEL.seq_len
    out = []
    for step in range(steps):
        starts = rng.integers(0, len(text) - t, BATCH)
        tokens = np.stack([text[s : s + t] for s in starts])
        lengths = rng.integers(t // 2, t + 1, BATCH)
        mask = np.arange(t)[None, :] < lengths[:, None]
        if step in LEFT_PADDED:
            # Left padding: the real tokens at the end. A padding query then attends only to
            # padding keys (causal), so its attention row is fully masked.
            mask = mask[:, ::-1].copy()
            tokens = np.where(mask, tokens, 0)
        else:
            tokens = np.where(mask, tokens, 0)
        out.append({"tokens": jnp.asarray(tokens), "mask": jnp.asarray(mask)})
    return out


def qk_scale(step: int) -> float:
    """The growing-then-relaxing q·k scale of layer 1 at ``step``."""
    k = step - SPIKE
    if k < 0:
        return 1.0
    if k < SPIKE_UP:
        return SPIKE_RATE**k
    if k < SPIKE_UP + SPIKE_HOLD:
        return SPIKE_RATE**SPIKE_UP
    k -= SPIKE_UP + SPIKE_HOLD
    return max(SPIKE_RATE ** (SPIKE_UP - k * SPIKE_UP / SPIKE_DOWN), 1.0)


def jump_scale(step: int) -> float:
    """The one-step q·k scale of layer 0 at ``step``."""
    return JUMP_SCALE if step == JUMP else 1.0


def _faulted(stream, set_scale):
    for step, batch in enumerate(stream):
        set_scale(step)
        yield batch


def _set_faults(model: nnx.Module, step: int) -> None:
    """Writes the fault knobs of ``step`` into ``model`` (model data: never recompiles)."""
    set_knob(model, "qk_gain", qk_scale(step), layer=1)
    set_knob(model, "qk_gain", jump_scale(step), layer=0)


# ------------------------------------------------------------------------------ arms


def run_plain(data) -> list[dict]:
    """Plain optax: the model on stock flax.nnx layers, adamw, one jitted step."""
    model = Transformer(dataclasses.replace(MODEL, layers="flax"), rngs=nnx.Rngs(0))
    tx = optax.adamw(LR)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    opt = tx.init(params)

    @jax.jit
    def step(params, opt, rest, batch):
        loss, grads = jax.value_and_grad(
            lambda p: lm_loss(nnx.merge(graphdef, p, rest, copy=True), batch)
        )(params)
        updates, opt = tx.update(grads, opt, params)
        return optax.apply_updates(params, updates), opt, loss

    history = []
    dead_since = None
    for t, batch in enumerate(data):
        m = nnx.merge(graphdef, params, rest)
        _set_faults(m, t)
        _, _, rest = nnx.split(m, nnx.Param, ...)
        params, opt, loss = step(params, opt, rest, batch)
        loss = float(loss)
        history.append({"step": t, "loss": loss})
        if not np.isfinite(loss):
            if dead_since is None:
                dead_since = t
                print(
                    f"  plain  step {t:4d}  loss {loss}  <- non-finite; NaN is now in the weights"
                )
            elif t - dead_since >= 5:
                finite = all(
                    bool(jnp.all(jnp.isfinite(p))) for p in jax.tree_util.tree_leaves(params)
                )
                print(f"  plain  step {t:4d}  loss {loss}  weights finite: {finite} -> dead")
                break
        elif t % 20 == 0:
            print(f"  plain  step {t:4d}  loss {loss:.4f}")
    return history


def run_nan2safe(data, workdir: Path):
    """nan2safe: the model with the nan2safe.nn sites, the Trainer with both tiers; prints
    events as they happen."""
    model = Transformer(MODEL, rngs=nnx.Rngs(0))
    trainer = nan2safe.Trainer(
        model, optax.adamw(LR), lm_loss, CFG, workdir, factory="examples.demo:factory"
    )
    shown = 0

    def set_scale(step):
        # The knobs are model data: changing them never recompiles. Write them into the state.
        m = trainer.state.model
        _set_faults(m, step)
        _, _, rest = nnx.split(m, nnx.Param, ...)
        trainer.state = trainer.state.replace(rest=rest)

    def progress(history):
        nonlocal shown
        events = trainer.events
        for e in events[shown:]:
            print("  " + _describe(e))
        shown = len(events)

    stream = _faulted(data, set_scale)
    history = []
    chunk = 10
    while len(history) < len(data):
        got = trainer.fit(stream, steps=chunk)
        if not got:
            break
        history.extend(got)
        progress(history)
        last = got[-1]
        print(
            f"  n2s    step {last['step']:4d}  loss {last['loss']:.4f}  risk {last['risk']:.2f}  "
            f"gear {GEARS[last['gear']]:<6} qk_scale(l1) {qk_scale(last['step']):7.1f}"
        )
    return trainer, history


def factory():
    """``(model, tx, loss_fn, cfg)`` for ``nan2safe locate runs/demo --step N``."""
    return Transformer(MODEL, rngs=nnx.Rngs(0)), optax.adamw(LR), lm_loss, CFG


def _describe(e: dict) -> str:
    t, s = e["type"], e["step"]
    if t == "downshift":
        probes = ", ".join(e.get("probes", [])[:3])
        return (
            f"[tier 1] step {s}: downshift {GEARS[e['from']]} -> {GEARS[e['to']]} "
            f"(risk {e['risk']:.2f}; probes: {probes})"
        )
    if t == "locate":
        r = e["report"]
        return (
            f"[tier 2] step {s}: located `{r['primitive']}` ({r['kind']}, {r['direction']}) at "
            f"{r['source']}, site {r['site']}; diagnosis: {r['diagnosis']}; "
            f"{r['replays']} replays, {r['seconds']:.1f} s -> {e['action']}"
        )
    if t == "safe_enter":
        return f"[SAFE]   step {s}: site {e['site']} in SAFE for {e['steps']} steps"
    if t == "safe_exit":
        return f"[SAFE]   step {s}: site {e['site']} back to STABLE"
    if t == "recover":
        return f"[gear]   step {s}: recovered to {GEARS[e['to']]}"
    if t == "skip":
        return f"[skip]   step {s}: update skipped ({e['reason']}), parameters untouched"
    if t == "checkpoint":
        return f"[ckpt]   step {s}: checkpoint (state finite)"
    return f"[{t}] step {s}: " + ", ".join(
        f"{k}={v}" for k, v in e.items() if k not in ("type", "step", "time")
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument(
        "--workdir",
        type=Path,
        default=DEFAULT_WORKDIR,
        help="the nan2safe arm's run folder, replaced when it holds an earlier demo run "
        "(default: runs/demo in the checkout)",
    )
    ap.add_argument("--steps", type=int, default=STEPS, help=f"steps of each arm (default {STEPS})")
    args = ap.parse_args(argv)
    if args.workdir.exists():
        if args.workdir.resolve() != DEFAULT_WORKDIR.resolve() and not _earlier_demo(args.workdir):
            ap.error(
                f"--workdir {str(args.workdir)!r} exists and holds no earlier demo run; the demo "
                "replaces its folder, so give it a new or empty one"
            )
        shutil.rmtree(args.workdir)
    data = batches(args.steps)
    print(
        f"model: {MODEL.num_layers} layers, d_model {MODEL.d_model}, seq {MODEL.seq_len}, "
        f"fp16 compute; faults: q·k scale of layer 1 grows from step {SPIKE}, "
        f"q·k scale of layer 0 jumps x{JUMP_SCALE:g} at step {JUMP}, "
        f"left-padded batch at step(s) {list(LEFT_PADDED)}\n"
    )
    t0 = time.time()
    print("arm 1: plain optax")
    plain = run_plain(data)
    t1 = time.time()
    print(f"\narm 2: nan2safe  (workdir {args.workdir})")
    trainer, hist = run_nan2safe(data, args.workdir)
    t2 = time.time()
    png = report_lib.dashboard(args.workdir)
    print(f"\ndashboard: {png}")
    summary = report_lib.print_summary(args.workdir)

    plain_dead = next((h["step"] for h in plain if not np.isfinite(h["loss"])), None)
    n2s_final = hist[-1]["loss"] if hist else float("nan")
    print("\nside by side")
    print(f"{'':24}{'plain optax':>16}{'nan2safe':>16}")
    print(f"{'steps trained':24}{len(plain):>16}{len(hist):>16}")
    print(f"{'first non-finite loss':24}{str(plain_dead):>16}{str(_first_bad(hist)):>16}")
    print(f"{'final loss':24}{plain[-1]['loss']:>16.4f}{n2s_final:>16.4f}")
    print(f"{'survived':24}{str(plain_dead is None):>16}{str(bool(np.isfinite(n2s_final))):>16}")
    print(f"{'wall time (s)':24}{t1 - t0:>16.1f}{t2 - t1:>16.1f}")
    del summary
    return 0 if np.isfinite(n2s_final) else 1


def _earlier_demo(workdir: Path) -> bool:
    """Whether ``workdir`` may be replaced: empty, or the run folder of an earlier demo."""
    if workdir.is_dir() and not any(workdir.iterdir()):
        return True
    try:
        run = json.loads((workdir / "run.json").read_text())
    except (OSError, ValueError):
        return False
    return run.get("factory") == "examples.demo:factory"


def _first_bad(hist):
    return next((h["step"] for h in hist if not np.isfinite(h["loss"])), None)


if __name__ == "__main__":
    sys.exit(main())
