"""Tier 1 false alarms on healthy training, and lead time on real precursors.

Two questions, one script (issue 12):

1. **Quiet on healthy training.** Clean runs of the demo decoder (``examples/demo.py``'s model,
   corpus and learning rate; right padding only, so no fully-masked row) with the default
   ``nan2safe.Config``: fp16, bf16, its MoE variant (4 experts, top 2) and its ``scan_layers``
   variant. Per arm and seed: downshifts, steps not in FAST, the fraction of steps with risk
   >= 0.5, and each probe's trigger rate (steps with that probe's risk >= 0.5). Goals: 0
   downshifts, risk >= 0.5 on <= 1% of steps. A run's first incident (a non-finite step that
   is no loss-scale overflow) is located by tier 2 (``replay.locate_step``, what the Trainer's
   ``locate`` event holds): primitive, site, forward/backward, diagnosis, source line.

2. **Early on real faults.** Precursor scenarios, each run *blind* (a ``Config`` whose detector
   can never fire, so every gear stays FAST, as in a run without the library) until the first
   non-finite value; the default detector and policy (``detector.update``, ``gear.decide``) are
   then replayed on the recorded probe statistics. Up to the first downshift a live run computes
   exactly what the blind run computed (gears are the only thing the detector changes, and they
   act from the step after the decision), so the replayed first downshift is the live one.
   Lead time = first non-finite step - first downshift step (> 0: the downshift came first).
   Scenarios: the demo's q·k knob (layer 1's q·k scale grows 1.5x per step from step 70), and
   faults that emerge from training itself: a learning rate warmed up to 20x the demo's with
   no qk-norm (attention-logit growth, as in small-scale proxies of large-model instabilities,
   Wortsman et al., 2023) and the LM head alone trained by adam at 30x (output-logit
   divergence), each in fp16 and bf16. bf16 has the range of f32: its runs may never produce a
   non-finite value, which the table then says.

   What these runs showed (docs/false_alarms.json): in fp16 both emergent faults first appear
   in the *backward* pass (gradients non-finite whatever the loss scale) while the forward
   probes are still far from the fp16 limit (attention logits ~850, 1.3% of 65504; the head's
   logits ~12), so no forward probe can see them coming; the first downshift there comes from
   the loss scale's overflow grace, one step before the incident. In bf16 the attention
   logits grow to ~1e5 without any non-finite value, and the head's logits stay bounded.

3. **What a false alarm costs.** ``alarm_recovery_fp16``: clean training with the default
   Config and a downshift forced at step 300; the steps until FAST again (staged recovery:
   ``recovery_window`` calm steps in STABLE).

"First non-finite value": the first step whose forward pass holds one (any probe's non-finite
count, or the loss), or whose non-finite gradients are an incident rather than a loss-scale
overflow (a scaled-gradient overflow with a finite loss is the dynamic loss scale's business,
and is counted separately).

Every arm runs in its own fresh subprocess, one after another (peak RSS from ``os.wait4``).

Usage: ``python benchmarks/false_alarms.py [--quick] [--steps N] [--seeds N] [--arms a,b]
[--scenarios a,b] [--json PATH]``. ``--quick``: 1 seed x 300 steps, short scenarios.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

_REPO = Path(__file__).resolve().parents[1]
if str(_REPO) not in sys.path:
    sys.path.insert(0, str(_REPO))

import numpy as np  # noqa: E402

ARMS = {
    "fp16": {"dtype": "float16"},
    "bf16": {"dtype": "bfloat16"},
    "moe_fp16": {"dtype": "float16", "num_experts": 4, "top_k": 2},
    "scan_fp16": {"dtype": "float16", "scan_layers": True},
}

# name: (model options, optimizer, peak learning rate as a multiple of the demo's, knob, steps).
# Optimizers: "adamw" (the demo's); "warmup": adamw with a linear warmup to the peak over
# WARMUP steps (so that the run gets past the loss scale's first steps and the fault has to
# grow out of the dynamics); "head": the LM head alone trained by adam (no weight decay) at the
# peak rate after the same warmup, the rest by the demo's adamw (output-logit divergence).
SCENARIOS = {
    "qk_knob_fp16": ({"dtype": "float16"}, "adamw", 1.0, "qk", 140),
    "qk_knob_bf16": ({"dtype": "bfloat16"}, "adamw", 1.0, "qk", 140),
    "attn_lr20_fp16": ({"dtype": "float16"}, "warmup", 20.0, None, 500),
    "attn_lr20_bf16": ({"dtype": "bfloat16"}, "warmup", 20.0, None, 500),
    "logits_head_lr30_fp16": ({"dtype": "float16"}, "head", 30.0, None, 500),
    "logits_head_lr30_bf16": ({"dtype": "bfloat16"}, "head", 30.0, None, 500),
    "alarm_recovery_fp16": ({"dtype": "float16"}, "adamw", 1.0, "alarm", 600),
}
ALARM_AT = 300  # alarm_recovery: a forced (false) downshift at this step of clean training
WARMUP = 100
KNOB_START, KNOB_RATE = 70, 1.5  # the demo's q·k growth: from step 70, x1.5 per step
AFTER_FAULT = 3  # blind steps recorded past the first non-finite one


# ------------------------------------------------------------------------------ child side


def _setup():
    import jax.numpy as jnp

    from examples import demo
    from examples.transformer import Transformer, TransformerConfig, lm_loss, set_knob

    return jnp, demo, Transformer, TransformerConfig, lm_loss, set_knob


def _model_cfg(opts: dict):
    jnp, demo, *_ = _setup()
    kw = dict(opts)
    kw["dtype"] = getattr(jnp, kw["dtype"])
    return dataclasses.replace(demo.MODEL, **kw)


def _clean_batches(seed: int):
    """The demo's batches (same corpus, length and padding law), right-padded only."""
    import jax.numpy as jnp

    from examples import demo

    text = np.frombuffer(demo.corpus().encode("ascii"), np.uint8).astype(np.int32)
    rng = np.random.default_rng(seed)
    t = demo.MODEL.seq_len
    while True:
        starts = rng.integers(0, len(text) - t, demo.BATCH)
        tokens = np.stack([text[s : s + t] for s in starts])
        lengths = rng.integers(t // 2, t + 1, demo.BATCH)
        mask = np.arange(t)[None, :] < lengths[:, None]
        yield {"tokens": jnp.asarray(np.where(mask, tokens, 0)), "mask": jnp.asarray(mask)}


def _host(m: dict, keys) -> dict:
    import jax

    return jax.device_get({k: m[k] for k in keys})


def run_clean(arm: str, seeds: int, steps: int) -> dict:
    """One arm: ``seeds`` clean runs of ``steps`` steps, default Config, live gears."""
    import optax
    from flax import nnx

    import nan2safe_jax as nan2safe

    _, demo, Transformer, _, lm_loss, _ = _setup()
    cfg = nan2safe.Config()
    mcfg = _model_cfg(ARMS[arm])
    step_fn = nan2safe.make_train_step(lm_loss)  # one jitted step for every seed
    runs = []
    for seed in range(seeds):
        t0 = time.time()
        state = nan2safe.TrainState.create(
            Transformer(mcfg, rngs=nnx.Rngs(seed)), optax.adamw(demo.LR), cfg
        )
        names = state.detector.names
        hits = np.zeros(len(names), np.int64)
        gears, risks, losses, rec = [], [], [], []
        first_down, first_incident = None, None
        by_risk = by_nonfinite = incidents = overflows = 0
        data = _clean_batches(seed)
        located = None
        for t in range(steps):
            before, batch = state, next(data)
            state, m = step_fn(state, batch)
            keys = ("risk", "gear", "next_gear", "loss", "probe_risk", "probes", "incident")
            h = _host(m, (*keys, "overflow"))
            rec.append(np.stack([np.asarray(h["probes"][n], np.float32) for n in names]))
            gears.append(int(h["gear"]))
            risks.append(float(h["risk"]))
            losses.append(float(h["loss"]))
            hits += np.asarray([h["probe_risk"][n] >= 0.5 for n in names])
            incidents += int(bool(h["incident"]))
            overflows += int(bool(h["overflow"]))
            if first_incident is None and bool(h["incident"]):
                first_incident = t
                located = _locate(step_fn, before, batch)
            if int(h["next_gear"]) > int(h["gear"]):
                first_down = t if first_down is None else first_down
                # What made the policy downshift: the risk score, or a non-finite step.
                if float(h["risk"]) >= cfg.trigger_risk:
                    by_risk += 1
                else:
                    by_nonfinite += 1
        gears_a, risks_a = np.asarray(gears), np.asarray(risks)
        _record(f"clean_{arm}_s{seed}", names, rec, gears_a)
        runs.append(
            {
                "seed": seed,
                "steps": steps,
                "downshifts": int(state.gear.downshifts),
                "downshifts_by_risk": by_risk,
                "downshifts_by_nonfinite": by_nonfinite,
                "first_downshift": first_down,
                "incident_steps": incidents,
                "first_incident": first_incident,
                "first_incident_located": located,
                "loss_scale_overflow_steps": overflows,
                "recoveries": int(state.gear.recoveries),
                "steps_not_fast": int(np.sum(gears_a != 0)),
                "risk_ge_half": int(np.sum(risks_a >= 0.5)),
                "risk_ge_half_frac": float(np.mean(risks_a >= 0.5)),
                "nonfinite_loss_steps": int(np.sum(~np.isfinite(losses))),
                "loss_first10": float(np.mean(losses[:10])),
                "loss_last10": float(np.mean(losses[-10:])),
                "probe_trigger_rate": {
                    n: float(c) / steps for n, c in zip(names, hits, strict=True)
                },
                "seconds": time.time() - t0,
            }
        )
        print(f"  {arm} seed {seed}: {_clean_line(runs[-1])}", file=sys.stderr, flush=True)
    return {"arm": arm, "model": ARMS[arm], "runs": runs}


def _locate(step_fn, before, batch) -> dict:
    """Tier 2 on a clean run's incident: what the equation was (what the Trainer would log)."""
    from nan2safe_jax import replay

    r = replay.locate_step(step_fn.jitted, before, batch)
    keys = ("primitive", "site", "direction", "kind", "diagnosis", "source", "explanation")
    out = {k: getattr(r, k) for k in keys}
    out["seconds"] = round(r.seconds, 1)
    print(f"    first incident located: {out}", file=sys.stderr, flush=True)
    return out


def _record(tag: str, names, rows, gears) -> None:
    """Saves the probe statistics of a run under ``$N2S_RECORD`` (for offline calibration)."""
    where = os.environ.get("N2S_RECORD")
    if where:
        Path(where).mkdir(parents=True, exist_ok=True)
        np.savez(
            Path(where) / f"{tag}.npz",
            names=np.asarray(names),
            stats=np.stack(rows),
            gears=np.asarray(gears),
        )


def _first_downshift(names, probe_rows, downshift_now, cfg):
    """Replays ``detector.update`` + ``gear.decide`` (``cfg``) on recorded statistics.

    Returns ``(step, probes)``: the first step whose decision leaves FAST, and the probes whose
    risk was >= 0.5 there (``(None, [])`` if none).
    """
    import jax

    from nan2safe_jax import detector, gear

    det = detector.DetectorState.create(names)
    gs = gear.GearState.create({})
    upd = jax.jit(detector.update, static_argnums=2)
    for t, (rows, now) in enumerate(zip(probe_rows, downshift_now, strict=True)):
        det, risk = upd(det, rows, cfg)
        new = gear.decide(gs, risk.risk, now, cfg, calm=risk.calm)
        if int(new.level) > 0:
            per = np.asarray(risk.per_probe)
            return t, [names[i] for i in np.argsort(-per) if per[i] >= 0.5][:4]
    return None, []


def _optimizer(kind: str, lr: float, mult: float):
    """The scenario's optimizer (see ``SCENARIOS``)."""
    import jax
    import optax

    if kind == "adamw":
        return optax.adamw(lr * mult)
    ramp = optax.linear_schedule(lr, lr * mult, WARMUP)
    if kind == "warmup":
        return optax.adamw(ramp)

    def labels(params):
        path_of = lambda path, _: "head" if "head" in jax.tree_util.keystr(path) else "rest"
        return jax.tree_util.tree_map_with_path(path_of, params)

    return optax.multi_transform({"head": optax.adam(ramp), "rest": optax.adamw(lr)}, labels)


def run_recovery(name: str, max_steps: int) -> dict:
    """What a false alarm costs: clean training, live default Config, a downshift forced at
    ``ALARM_AT``; counts the steps until every gear is FAST again (SPEC: one recovery window).
    """
    from flax import nnx

    import nan2safe_jax as nan2safe
    from nan2safe_jax import gear as gear_lib

    _, demo, Transformer, _, lm_loss, _ = _setup()
    opts, opt, lr_mult, _, default_steps = SCENARIOS[name]
    steps = min(max_steps, default_steps)
    cfg = nan2safe.Config()
    state = nan2safe.TrainState.create(
        Transformer(_model_cfg(opts), rngs=nnx.Rngs(0)), _optimizer(opt, demo.LR, lr_mult), cfg
    )
    step_fn = nan2safe.make_train_step(lm_loss)
    data = _clean_batches(0)
    back, not_calm, t0 = None, 0, time.time()
    for t in range(steps):
        if t == ALARM_AT:
            state = state.replace(gear=gear_lib.set_level(state.gear, nan2safe.Gear.STABLE, cfg))
        state, m = step_fn(state, next(data))
        h = _host(m, ("gear", "next_gear", "calm"))
        if t >= ALARM_AT and back is None:
            not_calm += int(not bool(h["calm"]))
            if int(h["next_gear"]) == 0:
                back = t + 1
        if back is not None and t >= back + 20:
            break
    out = {
        "scenario": name,
        "model": opts,
        "optimizer": opt,
        "lr": demo.LR * lr_mult,
        "knob": "alarm",
        "alarm_at": ALARM_AT,
        "back_to_fast_at": back,
        "steps_not_fast": None if back is None else back - ALARM_AT,
        "not_calm_steps_in_stable": not_calm,
        "recovery_window": cfg.recovery_window,
        "downshifts_after": int(state.gear.downshifts),
        "seconds": time.time() - t0,
    }
    print(f"  {name}: back to FAST after {out['steps_not_fast']} steps", file=sys.stderr)
    return out


def run_scenario(name: str, max_steps: int) -> dict:
    """One precursor scenario: a blind run to the first non-finite value, then the replay."""
    if SCENARIOS[name][3] == "alarm":
        return run_recovery(name, max_steps)
    import jax.numpy as jnp
    from flax import nnx

    import nan2safe_jax as nan2safe

    _, demo, Transformer, _, lm_loss, set_knob = _setup()
    opts, opt, lr_mult, knob, default_steps = SCENARIOS[name]
    steps = min(max_steps, default_steps)
    big = 1e30
    blind = nan2safe.Config(z_threshold=big, diff_threshold=big, headroom_limit=1.0)
    tx = _optimizer(opt, demo.LR, lr_mult)
    state = nan2safe.TrainState.create(Transformer(_model_cfg(opts), rngs=nnx.Rngs(0)), tx, blind)
    names = state.detector.names
    # The gradient and update probes flag a loss-scale overflow, which is not a fault.
    forward = np.asarray([n not in ("grad_norm", "update_norm") for n in names])
    step_fn = nan2safe.make_train_step(lm_loss)
    data = _clean_batches(0)
    rows, now, first_bad, first_overflow, losses = [], [], None, None, []
    t0 = time.time()
    for t in range(steps):
        if knob == "qk":
            m = state.model
            scale = KNOB_RATE ** max(t - KNOB_START, 0)
            set_knob(m, "qk_scale", min(scale, 1e30), layer=1)
            state = state.replace(rest=nnx.split(m, nnx.Param, ...)[2])
        state, m = step_fn(state, next(data))
        h = _host(m, ("probes", "loss", "incident", "overflow", "next_gear", "gear"))
        p = np.stack([np.asarray(h["probes"][n], np.float32) for n in names])
        rows.append(jnp.asarray(p))
        losses.append(float(h["loss"]))
        # The blind Config never fires on statistics; a non-finite step still downshifts.
        now.append(bool(int(h["next_gear"]) > int(h["gear"])))
        if first_overflow is None and bool(h["overflow"]):
            first_overflow = t
        bad = bool(np.any(p[forward, 3] > 0)) or not np.isfinite(losses[-1]) or bool(h["incident"])
        if first_bad is None and bad:
            first_bad = t
        if first_bad is not None and t >= first_bad + AFTER_FAULT:
            break
        # The blind run keeps its gears FAST (what a run without the library does).
        state = state.replace(
            gear=nan2safe.GearState.create({k: v.shape for k, v in state.gear.sites.items()})
        )
    _record(f"scenario_{name}", names, [np.asarray(r) for r in rows], np.zeros(len(rows)))
    down, probes = _first_downshift(names, rows, now, nan2safe.Config())
    lead = None if (down is None or first_bad is None) else first_bad - down
    out = {
        "scenario": name,
        "model": opts,
        "optimizer": opt,
        "lr": demo.LR * lr_mult,
        "knob": knob,
        "steps_run": len(rows),
        "first_nonfinite": first_bad,
        "first_loss_scale_overflow": first_overflow,
        "first_downshift": down,
        "downshift_probes": probes,
        "lead_steps": lead,
        "early": bool(lead is not None and lead > 0),
        "loss_first10": float(np.mean(losses[:10])),
        "seconds": time.time() - t0,
    }
    print(f"  {name}: {_scenario_line(out)}", file=sys.stderr, flush=True)
    return out


# ------------------------------------------------------------------------------ parent side


def _clean_line(r: dict) -> str:
    return (
        f"downshifts {r['downshifts']}, not FAST {r['steps_not_fast']}/{r['steps']}, "
        f"risk>=0.5 {r['risk_ge_half']}/{r['steps']} ({100 * r['risk_ge_half_frac']:.2f}%), "
        f"loss {r['loss_first10']:.3f} -> {r['loss_last10']:.3f}"
    )


def _scenario_line(r: dict) -> str:
    return (
        f"first non-finite {r['first_nonfinite']}, first downshift {r['first_downshift']} "
        f"({', '.join(r['downshift_probes'][:2])}), lead {r['lead_steps']}"
    )


def _child(kind: str, name: str, seeds: int, steps: int) -> tuple[dict, float]:
    """Runs one arm in a fresh interpreter; returns its result and peak RSS in MiB."""
    cmd = [sys.executable, __file__, "--child", kind, name, str(seeds), str(steps)]
    env = dict(os.environ, PYTHONPATH=str(_REPO))
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, env=env, text=True) as p:
        out = p.stdout.read()
        _, status, usage = os.wait4(p.pid, 0)
        p.returncode = os.waitstatus_to_exitcode(status)
    if p.returncode != 0:
        raise RuntimeError(f"{kind} {name} failed with exit code {p.returncode}")
    return json.loads(out.strip().splitlines()[-1]), usage.ru_maxrss / 1024


def _summary(arms: list[dict]) -> dict:
    runs = [r for a in arms for r in a["runs"]]
    steps = sum(r["steps"] for r in runs)
    return {
        "runs": len(runs),
        "steps": steps,
        "downshifts": sum(r["downshifts"] for r in runs),
        "downshifts_by_risk": sum(r.get("downshifts_by_risk", 0) for r in runs),
        "downshifts_by_nonfinite": sum(r.get("downshifts_by_nonfinite", 0) for r in runs),
        "incident_steps": sum(r.get("incident_steps", 0) for r in runs),
        "steps_not_fast": sum(r["steps_not_fast"] for r in runs),
        "risk_ge_half_frac": sum(r["risk_ge_half"] for r in runs) / max(steps, 1),
        "goal_zero_downshifts": all(r["downshifts"] == 0 for r in runs),
        "goal_zero_false_alarm_downshifts": all(r.get("downshifts_by_risk", 0) == 0 for r in runs),
        "goal_risk_le_1pct": sum(r["risk_ge_half"] for r in runs) <= 0.01 * steps,
    }


def clean_table(clean: list[dict]) -> str:
    """The clean-run table: one line per (arm, seed)."""
    lines = [
        f"{'arm':<11}{'seed':>5}{'steps':>6}{'downshifts':>11}{'(risk/nonfin)':>14}"
        f"{'incidents':>10}{'not FAST':>9}{'risk>=0.5':>10}  top probes (trigger rate)"
    ]
    for a in clean:
        for r in a["runs"]:
            top = sorted(r["probe_trigger_rate"].items(), key=lambda kv: -kv[1])[:2]
            tops = ", ".join(f"{n} {v:.4f}" for n, v in top if v > 0) or "-"
            cause = f"{r.get('downshifts_by_risk', '?')}/{r.get('downshifts_by_nonfinite', '?')}"
            lines.append(
                f"{a['arm']:<11}{r['seed']:>5}{r['steps']:>6}{r['downshifts']:>11}{cause:>14}"
                f"{r.get('incident_steps', '?'):>10}{r['steps_not_fast']:>9}"
                f"{100 * r['risk_ge_half_frac']:>9.2f}%  {tops}"
            )
    for a in clean:
        for r in a["runs"]:
            loc = r.get("first_incident_located")
            if loc:
                lines.append(
                    f"  {a['arm']} seed {r['seed']}, first incident (step {r['first_incident']}): "
                    f"`{loc['primitive']}` ({loc['direction']}) in site {loc['site']}, "
                    f"{loc['diagnosis']}, at {Path(loc['source'] or '?').name}"
                )
    return "\n".join(lines)


def precursor_table(precursors: list[dict]) -> str:
    """The precursor-scenario table: first non-finite step, first downshift, lead."""
    lines = [f"{'scenario':<26}{'first non-finite':>17}{'first downshift':>16}{'lead':>6}  probes"]
    for r in precursors:
        if r["knob"] == "alarm":
            lines.append(
                f"{r['scenario']:<26} forced downshift at {r['alarm_at']}: back to FAST after "
                f"{r['steps_not_fast']} steps (recovery_window {r['recovery_window']})"
            )
            continue
        lines.append(
            f"{r['scenario']:<26}{str(r['first_nonfinite']):>17}"
            f"{str(r['first_downshift']):>16}{str(r['lead_steps']):>6}  "
            f"{', '.join(r['downshift_probes'][:2])}"
        )
    return "\n".join(lines)


def table(doc: dict) -> str:
    """Both tables and the summary line of a ``docs/false_alarms.json`` document."""
    s = doc["summary"]
    summary = (
        f"over {s['steps']} clean steps: risk>=0.5 on {100 * s['risk_ge_half_frac']:.3f}% "
        f"(goal <= 1%), downshifts {s['downshifts']} (by risk {s['downshifts_by_risk']}, "
        f"by non-finite steps {s['downshifts_by_nonfinite']}; goal 0)"
    )
    return "\n\n".join([clean_table(doc["clean"]), precursor_table(doc["precursors"]), summary])


def _merge(doc: dict, clean: list[dict], precursors: list[dict]) -> dict:
    """``doc`` with ``clean`` arms and ``precursors`` replacing the entries of the same name."""
    names = {c["arm"] for c in clean}
    doc["clean"] = [c for c in doc["clean"] if c["arm"] not in names] + clean
    doc["clean"].sort(key=lambda c: list(ARMS).index(c["arm"]))
    names = {p["scenario"] for p in precursors}
    doc["precursors"] = [p for p in doc["precursors"] if p["scenario"] not in names]
    doc["precursors"] += precursors
    doc["precursors"].sort(key=lambda p: list(SCENARIOS).index(p["scenario"]))
    return doc


def _write(
    args,
    command,
    steps,
    seeds,
    arm_seeds,
    arm_steps,
    arms,
    scenarios,
    sc_steps,
    clean,
    precursors,
    rss,
    t_start,
    final=False,
) -> None:
    """Writes (or, with ``--update``, merges into) ``--json``; called after every arm, so an
    interrupted run keeps what finished (``runs[-1].complete`` says whether it all ran)."""
    import jax

    from nan2safe_jax import Config

    doc = {"runs": [], "clean": [], "precursors": []}
    base = getattr(args, "_base", None)
    if base is None:
        base = json.loads(args.json.read_text()) if args.update and args.json.exists() else doc
        args._base = base
    doc = _merge(json.loads(json.dumps(base)), clean, precursors)
    for extra in args.merge:
        other = json.loads(Path(extra).read_text())
        doc = _merge(doc, other["clean"], other["precursors"])
        doc["runs"] += other["runs"]
    doc["runs"].append(
        {
            "command": command,
            "complete": final,
            "quick": args.quick,
            "steps": steps,
            "seeds": seeds,
            "arm_seeds": arm_seeds,
            "arm_steps": arm_steps,
            "arms": arms,
            "scenarios": scenarios,
            "scenario_step_cap": None if sc_steps >= 10**9 else sc_steps,
            "jax": jax.__version__,
            "backend": jax.default_backend(),
            "wall_s": round(time.time() - t_start, 1),
            "peak_rss_mib": rss,
        }
    )
    doc["config"] = dataclasses.asdict(Config())
    doc["models"] = {"clean": ARMS, "scenarios": {k: list(v) for k, v in SCENARIOS.items()}}
    doc["summary"] = _summary(doc["clean"])
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(doc, indent=1) + "\n")
    if final:
        print()
        print(clean_table(doc["clean"]))
        print()
        print(precursor_table(doc["precursors"]))
        print(f"\nsummary: {json.dumps(doc['summary'])}")
        print(f"wrote {args.json}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="1 seed x 300 steps, short scenarios")
    ap.add_argument("--steps", type=int, default=None, help="clean steps per seed (2000)")
    ap.add_argument("--seeds", type=int, default=None, help="seeds per clean arm (3)")
    ap.add_argument("--arm-seeds", default="", help="per-arm seeds, e.g. moe_fp16=1,scan_fp16=1")
    ap.add_argument("--arm-steps", default="", help="per-arm steps, e.g. moe_fp16=1000")
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--scenarios", default=",".join(SCENARIOS))
    ap.add_argument("--scenario-steps", type=int, default=None, help="cap on scenario steps")
    ap.add_argument("--json", type=Path, default=_REPO / "docs" / "false_alarms.json")
    ap.add_argument(
        "--update", action="store_true", help="merge into --json: replace only what this run ran"
    )
    ap.add_argument(
        "--merge", nargs="*", default=[], help="also merge these JSON files (other runs)"
    )
    ap.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    if args.child:
        kind, name, seeds, steps = args.child
        res = (
            run_clean(name, int(seeds), int(steps))
            if kind == "clean"
            else run_scenario(name, int(steps))
        )
        print(json.dumps(res))
        return 0

    steps = args.steps or (300 if args.quick else 2000)
    seeds = args.seeds or (1 if args.quick else 3)
    arm_seeds, arm_steps = {}, {}
    for spec, into in ((args.arm_seeds, arm_seeds), (args.arm_steps, arm_steps)):
        for item in filter(None, spec.split(",")):
            k, _, v = item.partition("=")
            into[k] = int(v)
    sc_steps = args.scenario_steps or (200 if args.quick else 10**9)
    arms = [a for a in args.arms.split(",") if a]
    scenarios = [s for s in args.scenarios.split(",") if s]
    for a in [*arms, *arm_seeds, *arm_steps]:
        if a not in ARMS:
            ap.error(f"unknown arm {a!r}; known: {', '.join(ARMS)}")
    for s in scenarios:
        if s not in SCENARIOS:
            ap.error(f"unknown scenario {s!r}; known: {', '.join(SCENARIOS)}")

    t_start = time.time()
    command = " ".join(["python", "benchmarks/false_alarms.py", *sys.argv[1:]])
    clean, precursors, rss = [], [], {}
    for a in arms:
        n, k = arm_seeds.get(a, seeds), arm_steps.get(a, steps)
        print(f"clean {a}: {n} seed(s) x {k} steps, default Config", flush=True)
        res, mib = _child("clean", a, n, k)
        res.update(command=command, peak_rss_mib=round(mib))
        clean.append(res)
        rss[f"clean/{a}"] = round(mib)
        _write(
            args,
            command,
            steps,
            seeds,
            arm_seeds,
            arm_steps,
            arms,
            scenarios,
            sc_steps,
            clean,
            precursors,
            rss,
            t_start,
        )
    for s in scenarios:
        print(f"scenario {s}", flush=True)
        res, mib = _child("scenario", s, 1, sc_steps)
        res.update(command=command, peak_rss_mib=round(mib))
        precursors.append(res)
        rss[f"scenario/{s}"] = round(mib)
        _write(
            args,
            command,
            steps,
            seeds,
            arm_seeds,
            arm_steps,
            arms,
            scenarios,
            sc_steps,
            clean,
            precursors,
            rss,
            t_start,
        )

    _write(
        args,
        command,
        steps,
        seeds,
        arm_seeds,
        arm_steps,
        arms,
        scenarios,
        sc_steps,
        clean,
        precursors,
        rss,
        t_start,
        final=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
