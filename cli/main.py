"""``autopar``: the command line. The only place in autopar that prints.

Each subcommand lives in ``cli/commands/<name>.py``. Commands that execute on torch.distributed
(``calibrate``, ``validate``) import ``runtime`` inside their ``run``: the CLI is the edge that composes the
packages; library code in ``planner`` never imports ``runtime``. Exit status: ``cli.exit``.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import logging
import os
import sys

from cli.exit import EPILOG, EXIT_ERROR, EXIT_INTERRUPTED
from costmodel.errors import AutoparError

# Order is the order ``autopar --help`` lists them.
COMMANDS = (
    "trace", "plan", "explain",
    "whatif", "export", "diff",
    "calibrate", "estimate", "validate", "check",
    "launch",
)


def version() -> str:
    """The installed distribution's version (package metadata)."""
    try:
        return importlib.metadata.version("autopar")
    except importlib.metadata.PackageNotFoundError:
        return "unknown (not installed: pip install -e .)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="autopar",
        description="Automatic parallelization planner for PyTorch training.",
        epilog=EPILOG,
    )
    parser.add_argument("--version", action="version", version=f"autopar {version()}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress at INFO level")
    # -v after the subcommand too; SUPPRESS keeps a -v given before it
    verbose = argparse.ArgumentParser(add_help=False)
    verbose.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                         help="log progress at INFO level")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        mod = importlib.import_module(f"cli.commands.{name}")
        p = sub.add_parser(mod.NAME, help=mod.HELP, description=mod.HELP, parents=[verbose], epilog=EPILOG)
        mod.add_arguments(p)
        p.set_defaults(_run=mod.run, _passthrough=getattr(mod, "PASSTHROUGH", False))
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    rest: list[str] | None = None
    if "--" in argv:  # `autopar launch plan.json [opts] -- train.py ARGS`: what follows -- is the command's, verbatim
        cut = argv.index("--")
        argv, rest = argv[:cut], argv[cut + 1:]
    args = parser.parse_args(argv)
    if rest is not None:
        if not getattr(args, "_passthrough", False):
            parser.error(f"unexpected arguments after --: {' '.join(rest)}")
        args.passthrough = rest
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s"
    )
    if not getattr(args, "_run", None):
        parser.print_help()
        return EXIT_ERROR
    try:
        return int(args._run(args) or 0)
    except AutoparError as e:
        print(f"autopar {args.command}: error: {e}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        print(f"autopar {args.command}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # the reader went away (`autopar explain plan.json | head`): not an error of ours
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error when Python flushes
        return 0


if __name__ == "__main__":
    sys.exit(main())
