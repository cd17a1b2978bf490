"""``nan2safe`` command line: ``demo``, ``locate``, ``report``, ``bench``."""

from __future__ import annotations

import argparse
import json
import runpy
import sys
import warnings
from pathlib import Path

_REPO = Path(__file__).resolve().parents[1]
_DESCRIPTION = "nan2safe command line: demo, locate, report, bench (each has --help)."


def _demo(args) -> int:
    script = _REPO / "examples" / "demo.py"
    if not script.exists():
        print(f"the demo lives in the repository ({script}); run from a checkout", file=sys.stderr)
        return 2
    sys.path.insert(0, str(_REPO))
    from examples import demo

    extra = [] if args.steps is None else ["--steps", str(args.steps)]
    return demo.main([*extra, *(["--workdir", args.workdir] if args.workdir else [])])


def _locate(args) -> int:
    from nan2safe_jax import replay
    from nan2safe_jax.checkpoint import CheckpointMismatchError
    from nan2safe_jax.train import TrainState, make_train_step
    from nan2safe_jax.trainer import load_factory, load_incident
    from nan2safe_jax.workdir import read_run_record

    workdir = Path(args.workdir)
    if not workdir.is_dir():
        print(f"run directory {str(workdir)!r} does not exist", file=sys.stderr)
        return 2
    run = read_run_record(workdir)
    spec = args.factory or run.get("factory")
    if not spec:
        print(
            f"{workdir} records no factory; pass --factory package.module:function "
            "(returning model, tx, loss_fn, cfg) to rebuild the step",
            file=sys.stderr,
        )
        return 2
    sys.path.insert(0, str(Path.cwd()))
    try:
        factory = load_factory(spec)
    except (ImportError, AttributeError, ValueError) as err:
        print(
            f"cannot load the factory {spec!r} (run from the directory it imports from, or "
            f"pass --factory): {type(err).__name__}: {err}",
            file=sys.stderr,
        )
        return 2
    model, tx, loss_fn, cfg = factory()
    template = TrainState.create(model, tx, cfg)
    try:
        state, batch = load_incident(workdir, args.step, template)
    except CheckpointMismatchError as err:
        print(
            f"the factory {spec!r} builds another state than the run saved at step "
            f"{args.step}; pass the factory of the model and optimizer the run trained: {err}",
            file=sys.stderr,
        )
        return 2
    except FileNotFoundError as err:
        print(err, file=sys.stderr)
        why = _why_not_saved(workdir, args.step)
        if why:
            print(why, file=sys.stderr)
        return 2
    # The step as the run built it: a loss with aux outputs (``Trainer(has_aux=True)``).
    recorded = run.get("has_aux")
    # Without a record (none, or damaged) the loss's own output says: a pair is (loss, aux).
    for has_aux in [bool(recorded)] if recorded is not None else [False, True]:
        step = make_train_step(loss_fn, has_aux=has_aux)
        try:
            report = replay.locate_step(step, state, batch)  # the program the run replayed
            break
        except ValueError as err:
            if "has_aux" not in str(err):
                raise
            if recorded is None and not has_aux:
                continue
            said = (
                "the factory's loss_fn returns neither the loss nor (loss, aux)"
                if recorded is None
                else f"the run recorded has_aux={has_aux} in {workdir / 'run.json'}: the "
                f"factory's loss_fn must return {'(loss, aux)' if has_aux else 'the loss alone'}"
                ", as the run's did"
            )
            print(f"{said} ({err})", file=sys.stderr)
            return 2
    print(report)
    if args.json:
        Path(args.json).write_text(json.dumps(report.to_dict(), indent=1, default=str))
    return 0


def _run_dir(path: str) -> Path | None:
    """The run directory ``path`` names (the folder itself, or the folder of its
    ``events.jsonl`` / ``metrics.jsonl``); None, said on stderr, when it holds no run record."""
    from nan2safe_jax.runlog import EVENTS_FILE, METRICS_FILE

    wd = Path(path)
    if wd.is_file() and wd.name in (EVENTS_FILE, METRICS_FILE):
        wd = wd.parent
    if not wd.is_dir():
        say = f"run directory {str(wd)!r} does not exist; pass the Trainer's workdir"
        print(say, file=sys.stderr)
        return None
    if not any((wd / f).exists() for f in (EVENTS_FILE, METRICS_FILE)):
        print(
            f"{str(wd)!r} holds no run record ({EVENTS_FILE} or {METRICS_FILE}); pass the "
            "Trainer's workdir",
            file=sys.stderr,
        )
        return None
    return wd


def _why_not_saved(workdir: Path, step: int) -> str | None:
    """What the run log says about ``step`` when no incident was saved for it (the trainer
    saves located incidents only: a polluted input, a transient or damage has nothing to
    replay)."""
    from nan2safe_jax.runlog import read_events

    kinds = {"polluted_input", "transient", "damaged"}
    try:
        seen = [e for e in read_events(workdir) if e.get("step") == step and e["type"] in kinds]
    except (OSError, ValueError):
        return None
    if not seen:
        return None
    said = ", ".join(sorted({e["type"] for e in seen}))
    return (
        f"step {step} was logged as {said}: the data, a replay that stayed finite or a damaged "
        "state, not a located fault, so no incident was saved to replay (see events.jsonl)"
    )


def _report(args) -> int:
    # The summary, the dashboard and TensorBoard each read the logs: a torn line is said once,
    # as a message of the command (not a library file's warning with its line number).
    # Other warnings (a library's) keep Python's filters and form.
    seen: set[str] = set()

    def show(message, category, filename, lineno, file=None, line=None):
        ours = issubclass(category, RuntimeWarning) and "nan2safe_jax" in str(filename)
        text = (
            f"warning: {message}"
            if ours
            else warnings.formatwarning(message, category, filename, lineno, line).rstrip()
        )
        if text not in seen:
            seen.add(text)
            print(text, file=sys.stderr)

    with warnings.catch_warnings():
        warnings.showwarning = show
        return _report_once(args)


def _report_once(args) -> int:
    from nan2safe_jax import runlog as report

    wd = _run_dir(args.workdir)
    if wd is None:
        return 2
    report.print_summary(wd)
    out = Path(args.out) if args.out else wd / report.DASHBOARD_FILE
    try:
        path = report.dashboard(wd, out)
    except OSError as err:
        print(f"cannot write the dashboard ({err}); pass --out PATH", file=sys.stderr)
        return 2
    print(f"dashboard: {path}")
    # a folder per dashboard: one --out folder may hold several runs' reports
    tb = wd / "tensorboard" if not args.out else out.with_name(f"{out.stem}_tensorboard")
    try:
        written = report.write_tensorboard(wd, tb)
    except OSError as err:
        print(f"tensorboard: not written ({err})")
    else:
        print(f"tensorboard: {tb}" if written else "tensorboard: not written (needs tensorboardX)")
    return 0


def _benchmarks() -> list[str]:
    """The scripts of ``benchmarks/`` that run as a program (not the modules they share, e.g.
    ``measure``, which printed nothing and exited 0 when named)."""
    return sorted(
        p.stem
        for p in (_REPO / "benchmarks").glob("*.py")
        if p.stem[0] != "_" and 'if __name__ == "__main__":' in p.read_text()
    )


def _bench(args) -> int:
    have = _benchmarks()
    if args.name is None:
        print(f"nan2safe bench NAME [ARGS...]: name one of {have}", file=sys.stderr)
        return 2
    script = _REPO / "benchmarks" / f"{args.name}.py"
    if args.name not in have:
        print(f"no benchmark {args.name!r}; have {have}", file=sys.stderr)
        return 2
    sys.argv = [str(script), *args.rest]
    runpy.run_path(str(script), run_name="__main__")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="nan2safe", description=_DESCRIPTION)
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser(
        "demo", help="train the example transformer in fp16 through real faults, two arms"
    )
    demo.add_argument("--steps", type=int, default=None, help="steps of each arm (default 240)")
    demo.add_argument(
        "--workdir",
        default=None,
        help="the nan2safe arm's run folder, replaced when it holds an earlier demo run "
        "(default: runs/demo in the checkout); another folder that exists is refused",
    )
    demo.set_defaults(fn=_demo)

    loc = sub.add_parser("locate", help="re-run localization offline for a saved incident")
    loc.add_argument("workdir", help="the Trainer's workdir (its run.json names the factory)")
    loc.add_argument("--step", type=int, required=True)
    loc.add_argument("--factory", help="package.module:function -> (model, tx, loss_fn, cfg)")
    loc.add_argument("--json", help="also write the report as JSON here")
    loc.set_defaults(fn=_locate)

    rep = sub.add_parser(
        "report", help="print a run's summary and write its dashboard (WORKDIR/dashboard.png)"
    )
    rep.add_argument("workdir", help="the Trainer's workdir, or its events.jsonl")
    rep.add_argument(
        "--out", help="write the dashboard here instead (and NAME_tensorboard/ beside it)"
    )
    rep.set_defaults(fn=_report)

    names = _benchmarks()
    bench = sub.add_parser("bench", help="run benchmarks/NAME.py with the given arguments")
    bench.add_argument(
        "name", nargs="?", help=f"one of {', '.join(names)} (a checkout's benchmarks/)"
    )
    bench.add_argument("rest", nargs=argparse.REMAINDER, help="the benchmark's own arguments")
    bench.set_defaults(fn=_bench)

    args = parser.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
