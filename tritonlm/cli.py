"""`tritonlm` command line. Each subcommand lives in its own module under tritonlm/commands;
this file only wires them into one argparse tree."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from tritonlm.errors import CliError

# module -> it defines add_parser(subparsers) registering its subcommand(s). Only
# tritonlm/commands registers subcommands: the packages they drive stay plain libraries.
SUBCOMMAND_MODULES = [
    "tritonlm.commands.serve",
    "tritonlm.commands.doctor",
    "tritonlm.commands.perf_analyzer",
    "tritonlm.commands.instances",
    "tritonlm.commands.export",
    "tritonlm.commands.serve_default",
    "tritonlm.commands.generate",
    "tritonlm.commands.perf",
    "tritonlm.commands.openai",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tritonlm", description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in SUBCOMMAND_MODULES:
        importlib.import_module(name).add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except CliError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
