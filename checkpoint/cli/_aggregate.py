"""``ort-trainer-ckpt aggregate``: combine the rank files of a distributed save into one checkpoint (streamed)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from ..sets import aggregate_to_file
from ._common import EXIT_OK, check_output
from ._remote import path_or_url

__all__ = ["add_command"]


def add_command(sub: argparse._SubParsersAction, command) -> None:
    """Register ``aggregate`` on the CLI's subparsers."""
    p = command(sub, "aggregate", _run, "combine the rank files of a distributed save into one checkpoint")
    p.add_argument("paths", nargs="+", type=path_or_url, metavar="PATH", help="every rank's file, or the manifest")
    p.add_argument("-o", "--output", type=path_or_url, required=True, metavar="OUT", help="checkpoint to write")
    p.add_argument("--pytorch-format", action="store_true", help="write only {name: weight} of the model")
    p.add_argument("--overwrite", action="store_true", help="replace OUT if it exists")


def _run(args: argparse.Namespace) -> int:
    check_output(args.output, args.overwrite)
    paths = args.paths[0] if len(args.paths) == 1 else args.paths
    done = [0]
    with _Progress(done) as progress:
        aggregate_to_file(
            paths, args.output, pytorch_format=args.pytorch_format, overwrite=args.overwrite, progress=progress
        )
    size = args.output.stat().st_size
    print(f"wrote {args.output}: {done[0]} values, {size:,} bytes")
    return EXIT_OK


class _Progress:
    """A tqdm bar on stderr when it is a terminal, nothing otherwise; counts values written into ``done[0]``."""

    def __init__(self, done: list[int]) -> None:
        self.done, self.bar = done, None

    def __enter__(self) -> Callable[[int, int], None]:
        if sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(desc="aggregate", unit="value", file=sys.stderr, leave=False)
        return self.update

    def update(self, done: int, total: int) -> None:
        self.done[0] = done
        if self.bar is not None:
            self.bar.total = total
            self.bar.update(done - self.bar.n)

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.close()
