"""The `aiocoll` command: parses the sub-command and hands over to its module.

Each sub-command lives in its own module (coordinator, run, bench, status, timeline,
analyze) exposing
``add_arguments(parser)`` and ``main(args) -> int``; modules are imported only when their
sub-command runs, so `aiocoll status` never imports torch or numpy-heavy code.
"""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys
from collections.abc import Sequence

__all__ = ["build_parser", "main"]

_SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "coordinator": ("aiocoll.cli.coordinator", "run the coordinator service (key-value store + rendezvous)"),
    "run": ("aiocoll.cli.run", "launch a multi-process job, as torchrun does"),
    "bench": ("aiocoll.cli.bench", "measure collectives, side by side with torch gloo"),
    "status": ("aiocoll.cli.status", "show a coordinator's jobs, members and liveness"),
    "timeline": ("aiocoll.cli.timeline", "merge the ranks' timeline records or dumps into one Chrome trace"),
    "analyze": ("aiocoll.cli.analyze", "read flight-recorder dumps; name the rank holding a job back"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="aiocoll",
        description="Collective communication for Python on asyncio.",
        epilog="Run 'aiocoll COMMAND --help' for a command's options.",
    )
    from .. import __version__

    parser.add_argument("--version", action="version", version=f"aiocoll {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name, (module_name, help_text) in _SUBCOMMANDS.items():
        module = importlib.import_module(module_name)
        sub_parser = sub.add_parser(
            name,
            help=help_text,
            description=(module.__doc__ or help_text).strip().splitlines()[0],
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        module.add_arguments(sub_parser)
        sub_parser.set_defaults(_module=module)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args._module.main(args) or 0)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # The reader went away (`aiocoll status --json | head`): stop quietly, as a killed writer
        # would, and keep Python from complaining about the unflushed stdout at exit.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 128 + signal.SIGPIPE


if __name__ == "__main__":
    sys.exit(main())
