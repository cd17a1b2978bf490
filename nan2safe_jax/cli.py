"""``nan2safe`` command line: ``demo``, ``locate``, ``report``, ``bench``."""

from __future__ import annotations

import argparse
import sys


def _demo(args) -> int:
    from nan2safe_jax.demo import run_tier1_demo

    run_tier1_demo(steps=args.steps)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="nan2safe", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="train a small fp16 model through a real numerical fault")
    demo.add_argument("--steps", type=int, default=160)
    demo.set_defaults(fn=_demo)
    args = parser.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
