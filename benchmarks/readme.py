"""Renders the README's result tables from the committed ``docs/*.json``.

Each table sits between two marker comments in README.md,

    <!-- results:NAME -->
    ...generated...
    <!-- /results:NAME -->

and is regenerated from ``docs/<json>`` by the same formatter the benchmark prints with. Every
block names the exact command that wrote its JSON: the ``command`` the benchmark recorded, or,
for a JSON written before benchmarks recorded it, the command rebuilt from the parameters the
JSON does record (said so in the block).

Usage::

    python benchmarks/readme.py           # rewrite README.md in place
    python benchmarks/readme.py --check   # exit 1 when README.md is not what the JSON gives
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

_MARK = re.compile(r"(<!-- results:(\w+) -->\n)(.*?)(<!-- /results:\2 -->)", re.S)


def _overhead_command(rec: dict, path: str) -> str:
    cmd = ["python benchmarks/overhead.py", f"--rounds {rec['rounds']}"]
    cmd += [f"--steps {rec['steps_per_round']}", f"--dtype {rec['dtype']}"]
    cmd += [f"--batch {rec['batch']}"]
    if rec.get("sharding"):
        cmd += [f"--devices {rec['devices']}", f"--sharding {rec['sharding']}"]
    return " ".join(cmd + [f"--json {path}"])


def _ops_command(rec: dict, path: str) -> str:
    cmd = ["python benchmarks/ops.py", f"--rounds {rec['rounds']}", f"--dtype {rec['dtype']}"]
    if rec.get("mode") == "forward":
        cmd.append("--forward")
    return " ".join(cmd + [f"--json {path}"])


def _zoo_command(records: list, path: str) -> str:
    import zoo

    steps = {r["steps"] for r in records}
    size = "--quick" if steps == {100} else f"--steps {max(steps)}"
    names = list(dict.fromkeys(r["scenario"] for r in records))
    only = "" if set(names) == set(zoo.SCENARIOS) else f" --only {','.join(names)}"
    arms = tuple(dict.fromkeys(r["arm"] for r in records))
    only += "" if arms == zoo.ARMS else f" --arms {','.join(arms)}"
    return f"python benchmarks/zoo.py {size}{only} --json {path}"


def _overhead(data: dict) -> str:
    import overhead

    return overhead.table(data)


def _overhead_processes(data: dict) -> str:
    import overhead_processes

    return overhead_processes.table(data)


def _ops(data: dict) -> str:
    import ops

    return ops.table(data)


def _zoo(data: list) -> str:
    import zoo

    nan = float("nan")  # the JSON writes a non-finite loss as null
    fix = lambda r: {
        **r,
        **{k: nan if r[k] is None else r[k] for k in ("final_loss", "clean_loss")},
    }
    text = zoo.table([fix(r) for r in data], omit=("t/plain",))
    return text.split("\n", 1)[1]  # the header line's configuration is in the README text


def _locate_command(data: dict, path: str) -> str:
    if data.get("commands"):  # recorded by the script (with --merge: every run merged in)
        return "; ".join(data["commands"])
    recs = data["ladder"]
    rungs = sorted({r["rung"] for r in recs})
    layouts = sorted({r["layout"] for r in recs})
    faults = sorted({r["fault"] for r in recs})
    return (
        f"python benchmarks/locate.py --rungs {','.join(rungs)} --layouts {','.join(layouts)} "
        f"--faults {','.join(faults)} --json {path}"
    )


def _false_alarms_command(doc: dict, path: str) -> str:
    return "; ".join(r["command"] for r in doc["runs"])


def _locate(data: dict) -> str:
    import locate

    return locate.markdown_ladder(data["ladder"])


def _locate_stable(data: dict) -> str:
    import locate

    return locate.markdown_stable(data["ladder"])


def _false_alarms(doc: dict) -> str:
    import false_alarms

    return false_alarms.table(doc)


def _probe_set(data: dict) -> str:
    import probe_set

    return probe_set.table(data)


# name -> (json path, table renderer, command rebuilt from the JSON's own parameters)
TABLES: dict[str, tuple[str, Callable, Callable]] = {
    "overhead": ("docs/overhead.json", _overhead, _overhead_command),
    "overhead_processes": (
        "docs/overhead_processes.json",
        _overhead_processes,
        lambda rec, path: rec["command"],  # recorded since the script's first run
    ),
    "overhead_restart": (
        "docs/overhead_restart.json",
        _overhead,
        lambda doc, path: "; ".join(r["command"] for r in doc["restart"].values()),
    ),
    "overhead_dp8": ("docs/overhead_dp8.json", _overhead, _overhead_command),
    "overhead_fsdp8": ("docs/overhead_fsdp8.json", _overhead, _overhead_command),
    "overhead_dp8_b64": ("docs/overhead_dp8_b64.json", _overhead, _overhead_command),
    "overhead_zero3": ("docs/overhead_zero3.json", _overhead, _overhead_command),
    "overhead_zero3_b64": ("docs/overhead_zero3_b64.json", _overhead, _overhead_command),
    "overhead_dp8_ablation": ("docs/overhead_dp8_ablation.json", _overhead, _overhead_command),
    "overhead_dp8_sync": ("docs/overhead_dp8_sync.json", _overhead, _overhead_command),
    "overhead_donate": ("docs/overhead_donate.json", _overhead, _overhead_command),
    "overhead_dp8_donate": ("docs/overhead_dp8_donate.json", _overhead, _overhead_command),
    "overhead_host": ("docs/overhead_host.json", _overhead, _overhead_command),
    "overhead_dp8_host": ("docs/overhead_dp8_host.json", _overhead, _overhead_command),
    "zoo": ("docs/zoo_quick.json", _zoo, _zoo_command),
    "zoo_lr_cut": ("docs/zoo_lr_cut.json", _zoo, _zoo_command),
    "ops": ("docs/ops.json", _ops, _ops_command),
    "locate": ("docs/locate.json", _locate, _locate_command),
    "locate_stable": ("docs/locate_stable.json", _locate_stable, _locate_command),
    "false_alarms": ("docs/false_alarms.json", _false_alarms, _false_alarms_command),
    "probe_set": ("docs/probe_set.json", _probe_set, lambda rec, path: rec["command"]),
}
MARKDOWN = {
    "locate",
    "locate_stable",
}  # renderers that return a markdown table, not preformatted text
MERGED = {"false_alarms", "overhead_restart"}  # JSONs that runs merge into, a command each


def render_block(name: str) -> str:
    """The generated text of one marker block (without the markers)."""
    path, table, rebuild = TABLES[name]
    data = json.loads((ROOT / path).read_text())
    recorded = isinstance(data, dict) and data.get("command")
    if name in MERGED:
        how = f"Written by `{rebuild(data, path)}` (each run merged into `{path}`)."
    elif recorded:
        how = f"Written by `{data['command']}`."
    else:
        how = (
            f"Written by `{rebuild(data, path)}` (rebuilt from the parameters `{path}` "
            "records; the script now records its command)."
        )
    body = "\n".join(line.rstrip() for line in table(data).splitlines())
    if name in MARKDOWN:
        return f"{how}\n\n{body}\n"
    return f"{how}\n\n```\n{body}\n```\n"


def render(text: str) -> str:
    """``text`` with every known marker block regenerated; unknown names raise ValueError."""

    def sub(m: re.Match) -> str:
        name = m.group(2)
        if name not in TABLES:
            raise ValueError(f"README marker results:{name} has no table; have {sorted(TABLES)}")
        return m.group(1) + render_block(name) + m.group(4)

    return _MARK.sub(sub, text)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="only report whether README is current")
    ap.add_argument("--readme", type=Path, default=ROOT / "README.md")
    args = ap.parse_args(argv)
    old = args.readme.read_text()
    new = render(old)
    if args.check:
        if new != old:
            print(f"{args.readme} is out of date: run python benchmarks/readme.py")
            return 1
        print(f"{args.readme} is current")
        return 0
    args.readme.write_text(new)
    print(f"rendered {len(_MARK.findall(old))} tables into {args.readme}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
