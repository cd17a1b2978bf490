"""Which probes: detection lead time on precursor faults vs what each probe set costs.

The default probe set (``nan2safe_jax.probe.DEFAULT_PROBES``, ``Config.probes``) is chosen from
this measurement. Each candidate set runs:

- **detection**, on four faults with a precursor (something grows for a few dozen steps until
  an fp16 value overflows), on the fault zoo's 2-layer fp16 decoder (``benchmarks/zoo.py``):
  ``qk_growth`` (the zoo's: one layer's q·k scale grows until the fp16 logits overflow),
  ``moe_router`` (the zoo's: the router scores grow until they overflow), ``logit_growth``
  (the LM logits grow: knob ``head_scale``) and ``act_growth`` (the embeddings entering the
  residual stream grow until an fp16 activation overflows: knob ``embed_scale``); both new ones
  grow x1.6 per step from step 30 of 100 for 24 steps, then hold, as ``qk_growth`` does. The
  ``nan2safe`` arm of each, with ``Config(probes=SET)`` and the zoo's short-run config, on
  identical data and seeds: the first *risk* downshift (FAST -> STABLE before anything is
  non-finite), the probes that fired, whether the fault was prevented (no non-finite step at
  all), and a fault-free run of the same arm for false alarms (a downshift there). **Lead** =
  the step the plain arm (stock ``flax.nnx``, no guard) first goes non-finite minus the first
  risk downshift.
- **cost**, on the demo-size decoder of ``benchmarks/overhead.py`` (4 layers, d_model 256,
  seq 128, batch 8, f32): the step time of ``make_train_step`` with ``Config(probes=SET)``
  against the plain optax + NNX step (median of interleaved rounds, CPU clock), and the number
  of fusions in its compiled FAST-only program (``Compiled.as_text()``): a count that does not
  depend on machine noise.

The chosen set: the one with the fewest fusions among the sets that prevent every fault the
widest set (``all``) prevents, with a lead within ``--lead-slack`` steps of it on every
scenario and no false alarm; ties go to the lower step time. After the leave-one-out sets
(``default-KIND``) the script also runs the default without every kind whose removal alone
lost nothing, so the answer can be a set no name listed.

Usage::

    python benchmarks/probe_set.py [--sets none,default,all,default-attn_logits,...]
                                   [--steps 100] [--rounds 5] [--timing-steps 6] [--jobs 2]
                                   [--json docs/probe_set.json]

``--sets`` names candidates: ``none`` (no site probe: only the loss and gradient probes),
``default``, ``all`` (every kind), ``default-KIND[-KIND...]`` (the default without those kinds)
or ``KIND+KIND`` (exactly those kinds). Detection runs ``--jobs`` sets at a time, each in its
own process; the cost arms run afterwards in this process, one after another.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
# The timed steps run the FAST-only program alone (no background compile beside them).
os.environ.setdefault("NAN2SAFE_BACKGROUND_COMPILE", "0")

import jax  # noqa: E402
import optax  # noqa: E402
import overhead  # noqa: E402
import zoo  # noqa: E402
from measure import program_size  # noqa: E402

import nan2safe_jax as nan2safe  # noqa: E402
from examples.transformer import make_batch  # noqa: E402
from nan2safe_jax.probe import DEFAULT_PROBES, PROBE_KINDS  # noqa: E402

# The precursor faults: something grows for a few dozen steps until an fp16 value overflows.
# Two are the zoo's; two more grow the values the other probe kinds watch (the LM logits, the
# residual stream), with the same schedule as qk_growth (x1.6 per step from step 30 of 100 for
# 24 steps, then held).
SCENARIOS: dict[str, zoo.Scenario] = {
    "qk_growth": zoo.SCENARIOS["qk_growth"],
    "moe_router": zoo.SCENARIOS["moe_router"],
    **{
        name: zoo.Scenario(
            name,
            mechanism,
            "lm",
            lambda steps, faulty: zoo.lm_batches(steps),
            knobs=lambda step, steps, faulty, knob=knob: (
                ((knob, zoo._growth(step, steps, 0.3, 1.6, 24) if faulty else 1.0, None),)
            ),
        )
        for name, knob, mechanism in [
            ("logit_growth", "head_scale", "the LM logits grow x1.6/step: fp16 logits > 65504"),
            (
                "act_growth",
                "embed_scale",
                "the embeddings entering the residual stream grow x1.6/step: an fp16 residual "
                "add overflows",
            ),
        ]
    },
}
# ``linear_output`` is only on a Linear / Embed built with ``probe=True``; no model here has
# one, so dropping it changes nothing these runs can see: it is not a candidate to drop.
UNMEASURED = ("linear_output",)
DEFAULT_SETS = (
    "none",
    "default",
    "all",
    *(f"default-{k}" for k in DEFAULT_PROBES if k not in UNMEASURED),
)


def parse_set(name: str) -> tuple[str, ...]:
    """The probe kinds a candidate's name stands for (see the module docstring).

    Raises:
      ValueError: for a name that is none of the forms, or names a kind not in ``PROBE_KINDS``.
    """
    if name == "none":
        kinds: tuple[str, ...] = ()
    elif name == "default":
        kinds = DEFAULT_PROBES
    elif name == "all":
        kinds = PROBE_KINDS
    elif name.startswith("default+"):
        kinds = DEFAULT_PROBES + tuple(k for k in name.split("+")[1:] if k not in DEFAULT_PROBES)
    elif name.startswith("default-"):
        drop = name.removeprefix("default-").split("-")
        missing = [k for k in drop if k not in DEFAULT_PROBES]
        if missing:
            raise ValueError(f"--sets: {missing} not in the default set {DEFAULT_PROBES}")
        kinds = tuple(k for k in DEFAULT_PROBES if k not in drop)
    else:
        kinds = tuple(name.split("+"))
    unknown = [k for k in kinds if k not in PROBE_KINDS]
    if unknown:
        raise ValueError(f"--sets: unknown probe kind(s) {unknown} in {name!r}; have {PROBE_KINDS}")
    return kinds


def onsets(steps: int) -> dict[str, int | None]:
    """Per scenario, the step the plain arm (stock flax.nnx, no guard) first goes non-finite."""
    out = {}
    for name, sc in SCENARIOS.items():
        out[name] = zoo._run_functional(sc, "plain", steps, True, sc.batches(steps, True))[
            "first_nonfinite"
        ]
    return out


def detection(kinds: tuple[str, ...], steps: int) -> dict:
    """The nan2safe arm of every scenario with ``Config(probes=kinds)``, faulty and fault-free.

    Returns:
      Per scenario: ``first_risk_downshift`` (None: none), ``fired`` (its probes),
      ``first_nonfinite``, ``prevented`` (no non-finite step and finite parameters at the end),
      ``false_alarm`` (the fault-free run's first downshift) and ``false_alarm_probes``.
    """
    zoo._cache_locate_jaxprs(True)
    cfg = dataclasses.replace(zoo.CFG, probes=kinds)
    saved = zoo.CFG
    zoo.CFG = cfg  # _run_nan2safe reads the module's config
    out = {}
    try:
        with tempfile.TemporaryDirectory(prefix="probe_set_") as tmp:
            for name, sc in SCENARIOS.items():
                runs = {}
                for faulty in (True, False):
                    data = sc.batches(steps, faulty)
                    runs[faulty] = zoo._run_nan2safe(
                        sc, steps, faulty, data, Path(tmp) / f"{name}_{faulty}"
                    )
                out[name] = _detected(runs[True], runs[False])
    finally:
        zoo.CFG = saved
    return out


def _detected(faulty: dict, clean: dict) -> dict:
    def first_risk(run):
        return next(
            (e for e in run["events"] if e["type"] == "downshift" and e["cause"] == "risk"), None
        )

    f, c = first_risk(faulty), first_risk(clean)
    return dict(
        first_risk_downshift=f["step"] if f else None,
        fired=f["probes"] if f else [],
        first_nonfinite=faulty["first_nonfinite"],
        prevented=faulty["first_nonfinite"] is None and faulty["params_finite"],
        false_alarm=c["step"] if c else None,
        false_alarm_probes=c["probes"] if c else [],
    )


def cost(sets: dict[str, tuple[str, ...]], rounds: int, steps: int) -> dict:
    """Per set (and ``plain``): the step's median CPU time over interleaved rounds, its ratio to
    plain's, and the fusions of its compiled FAST-only program."""
    size = dict(dtype="float32", layers=4, d_model=256, heads=4, seq=128, scan_layers=False)
    cfg = overhead._model_cfg(argparse.Namespace(**size))
    tx = optax.adamw(3e-4)
    batches = [make_batch(jax.random.key(i), cfg, 8) for i in range(4)]
    arms = {"plain": overhead.make_plain(cfg, tx)}
    for name, kinds in sets.items():
        arms[name] = overhead.make_n2s(cfg, tx, n2s_cfg=nan2safe.Config(probes=kinds))
    fusions = {
        k: program_size(run.lower(batches[0]).compile())["kernels"] for k, run in arms.items()
    }
    for run in arms.values():
        overhead.time_steps(run, batches, 3)
    times: dict[str, list[float]] = {k: [] for k in arms}
    for _ in range(rounds):
        for name, run in arms.items():
            times[name].append(overhead.time_steps(run, batches, steps)[1])
    med = {k: statistics.median(v) for k, v in times.items()}
    return {
        k: dict(cpu_ms=med[k] * 1e3, x_plain=med[k] / med["plain"], fusions=fusions[k])
        for k in arms
    }


def qualifies(rec: dict, widest: dict, lead_slack: int) -> bool:
    """Whether a set detects as well as the widest: it prevents every fault the widest prevents,
    with a lead within ``lead_slack`` steps of the widest's, and raises no false alarm."""
    for sc, ref in widest.items():
        d = rec[sc]
        if ref["prevented"] and not d["prevented"]:
            return False
        if ref["lead"] is not None and (d["lead"] is None or d["lead"] < ref["lead"] - lead_slack):
            return False
        if d["false_alarm"] is not None:
            return False
    return True


def choose(records: dict, lead_slack: int) -> str | None:
    """The qualifying set with the fewest fusions (then the lower step time); None if none."""
    widest = records["all"]["detection"]
    ok = [k for k, r in records.items() if qualifies(r["detection"], widest, lead_slack)]
    if not ok:
        return None
    return min(ok, key=lambda k: (records[k]["cost"]["fusions"], records[k]["cost"]["x_plain"]))


def table(record: dict) -> str:
    """The record of ``main`` (or its JSON) as the printed table."""
    scs = record["scenarios"]
    lines = [
        "plain's first non-finite step: "
        + ", ".join(f"{sc} {record['onset'][sc]}" for sc in scs)
        + f" (of {record['steps']}); nan2safe arm: {record['zoo_config']}",
        f"cost: demo decoder f32, CPU clock per step; plain {record['cost']['plain']['cpu_ms']:.0f}"
        f" ms, {record['cost']['plain']['fusions']} fusions",
        "lead = plain's first non-finite step - the first risk downshift; prev = prevented (no "
        "non-finite step); clean = a downshift in the fault-free run",
    ]
    head = f"{'set':<34} {'fusions':>7} {'x plain':>7}"
    for sc in scs:
        head += f" | {sc:<12} {'prev':>4} {'clean':>5}"
    lines += [head, "-" * len(head)]
    for name, rec in record["sets"].items():
        c = rec["cost"]
        row = f"{name:<34} {c['fusions']:>7} {c['x_plain']:>7.3f}"
        for sc in scs:
            d = rec["detection"][sc]
            lead = "-" if d["lead"] is None else str(d["lead"])
            clean = "-" if d["false_alarm"] is None else str(d["false_alarm"])
            row += f" | {lead:<12} {'yes' if d['prevented'] else 'NO':>4} {clean:>5}"
        lines.append(row)
    lines.append("the probes of set 'all' that fired first:")
    for sc in scs:
        fired = record["sets"]["all"]["detection"][sc]["fired"]
        lines.append(f"  {sc}: {', '.join(fired) or 'none (no risk downshift)'}")
    lines.append(
        f"chosen (fewest fusions among the sets that detect as early as 'all', within "
        f"{record['lead_slack']} step): {record['chosen']}  (current default: "
        f"{'+'.join(record['default'])})"
    )
    return "\n".join(lines)


def _detect_all(names: dict, steps: int, jobs: int) -> dict:
    if jobs <= 1:
        return {n: detection(k, steps) for n, k in names.items()}
    ctx = multiprocessing.get_context("spawn")
    # A fresh process per set: each keeps its compiled steps and replays, ~GBs after a few sets.
    with concurrent.futures.ProcessPoolExecutor(
        jobs, mp_context=ctx, max_tasks_per_child=1
    ) as pool:
        futs = {pool.submit(detection, k, steps): n for n, k in names.items()}
        out = {}
        for f in concurrent.futures.as_completed(futs):
            out[futs[f]] = f.result()
            print(f"[{futs[f]}] {json.dumps(out[futs[f]])}", flush=True)  # kept if a later set dies
        return {n: out[n] for n in names}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sets", default=",".join(DEFAULT_SETS))
    ap.add_argument("--steps", type=int, default=100, help="steps per zoo run")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved timing rounds")
    ap.add_argument("--timing-steps", type=int, default=6, help="steps per timing round")
    ap.add_argument("--lead-slack", type=int, default=1, help="steps of lead a set may lose")
    ap.add_argument("--jobs", type=int, default=2, help="detection runs in parallel processes")
    ap.add_argument("--json", type=Path)
    ap.add_argument(
        "--detection-from",
        type=Path,
        help="take onsets and detection from this earlier JSON; only time the cost again",
    )
    args = ap.parse_args(argv)
    try:
        sets = {n: parse_set(n) for n in args.sets.split(",") if n}
    except ValueError as e:
        ap.error(str(e))
    sets.setdefault("all", PROBE_KINDS)  # the reference for "as early as"
    t0 = time.time()
    if args.detection_from:
        old = json.loads(args.detection_from.read_text())
        start = old["onset"]
        det = {
            n: {sc: _no_lead(d) for sc, d in r["detection"].items()} for n, r in old["sets"].items()
        }
        sets = {n: tuple(r["kinds"]) for n, r in old["sets"].items()}
        args.steps = old["steps"]
    else:
        start = onsets(args.steps)
        det = _detect_all(sets, args.steps, args.jobs)
    widest = _with_lead(det["all"], start)
    # The default less every kind whose removal alone lost nothing: run that set too.
    loose = [
        n.removeprefix("default-")
        for n in sets
        if n.startswith("default-")
        and qualifies(_with_lead(det[n], start), widest, args.lead_slack)
    ]
    if len(loose) > 1 and not args.detection_from:
        name = "default-" + "-".join(loose)
        sets[name] = parse_set(name)
        det |= _detect_all({name: sets[name]}, args.steps, 1)
    costs = cost(sets, args.rounds, args.timing_steps)
    records = {
        n: dict(kinds=list(k), detection=_with_lead(det[n], start), cost=costs[n])
        for n, k in sets.items()
    }
    record = dict(
        scenarios=list(SCENARIOS),
        onset=start,
        steps=args.steps,
        sets=records,
        cost=dict(plain=costs["plain"]),
        lead_slack=args.lead_slack,
        chosen=choose(records, args.lead_slack),
        default=list(DEFAULT_PROBES),
        zoo_config=zoo.CFG_TEXT,
        seconds=round(time.time() - t0),
        command="python benchmarks/probe_set.py "
        + " ".join(sys.argv[1:] if argv is None else argv),
    )
    if args.detection_from:  # the detection columns come from the earlier run's command
        record["command"] = f"{old['command']}; then {record['command']}"
    print(table(record))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(record, indent=1))
    return record


def _no_lead(d: dict) -> dict:
    return {k: v for k, v in d.items() if k != "lead"}


def _with_lead(det: dict, start: dict) -> dict:
    out = {}
    for sc, d in det.items():
        first = d["first_risk_downshift"]
        lead = None if first is None or start[sc] is None else start[sc] - first
        out[sc] = dict(d, lead=lead)
    return out


if __name__ == "__main__":
    main()
