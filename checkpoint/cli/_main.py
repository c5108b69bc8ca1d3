"""``ort-trainer-ckpt`` (or ``python -m ort_trainer.checkpoint``): the parser and the entry point.

Each subcommand lives in its own module (``_inspect``, ``_verify``, ``_aggregate``, ``_convert``,
``_diff``) with an ``add_command`` that declares its arguments and a ``_run`` that returns the exit
code. Errors print one line, ``ort-trainer-ckpt: error: <message>``, on stderr and exit with 2 (a
traceback only with ``--debug``). See ``docs/cli.md``.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from collections.abc import Callable, Sequence

from ... import __version__
from ..errors import CheckpointError
from . import _aggregate, _convert, _diff, _inspect, _remote, _verify
from ._common import EXIT_ERROR, EXIT_OK, PROG

__all__ = ["build_parser", "main"]

_COMMANDS = (_inspect, _verify, _aggregate, _convert, _diff)


def _command(
    sub: argparse._SubParsersAction, name: str, run: Callable[[argparse.Namespace], int], text: str
) -> argparse.ArgumentParser:
    """A subcommand parser with the shared ``--debug`` flag; ``run`` becomes ``args.func``."""
    p = sub.add_parser(name, help=text, description=text)
    p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show the traceback of an error")
    p.set_defaults(func=run)
    return p


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description="Inspect, verify, aggregate, convert and diff checkpoints.")
    parser.add_argument("--debug", action="store_true", help="show the traceback of an error")
    parser.add_argument("--version", action="version", version=f"{PROG} (ort_trainer) {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in _COMMANDS:
        module.add_command(sub, _command)
    return parser


def _one_line(exc: BaseException) -> str:
    """The message on one line; a listed error ('head:\\n  - a\\n  - b') becomes 'head: a; b'."""
    text = exc.args[0] if isinstance(exc, KeyError) and exc.args else str(exc)
    parts = [line.strip() for line in str(text).splitlines() if line.strip()] or [type(exc).__name__]
    items = [p.removeprefix("- ") for p in parts[1:]]
    message = f"{parts[0].rstrip(':')}: {'; '.join(items)}" if items else parts[0]
    if isinstance(exc, CheckpointError | OSError):
        return message
    return f"{type(exc).__name__}: {message}"


def main(argv: Sequence[str] | None = None) -> int:
    """Run one subcommand; return its exit code (0 ok, 1 differences/damage found, 2 error)."""
    args = build_parser().parse_args(argv)
    try:
        return _remote.run(args)
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # e.g. piped into `head`: not an error of ours
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_OK
    except Exception as exc:
        if args.debug:  # the traceback, but the documented exit status (an uncaught raise would give 1)
            traceback.print_exc()
        print(f"{PROG}: error: {_one_line(exc)}", file=sys.stderr)
        return EXIT_ERROR
