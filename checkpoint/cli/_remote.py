"""fsspec URLs on the command line: remote inputs are downloaded, a remote output is uploaded at the end.

Every subcommand works on local files. :func:`localized` swaps each URL argument (``s3://…``,
``memory://…``; ``file://`` is simply local) for a local copy in a temporary spool folder before the
subcommand runs: an input is fetched (a manifest with its rank files), an output gets a local path
that is published to its URL atomically (temporary key, then move) once the subcommand succeeded.
Credentials and endpoints come from the environment (e.g. ``AWS_ACCESS_KEY_ID``, ``AWS_ENDPOINT_URL``)
or fsspec's configuration (``FSSPEC_S3_...`` variables).
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Iterator
from pathlib import Path

from ..io import LocalLocation, RemoteLocation, is_url, local_inputs, resolve, spool_folder
from ._common import EXIT_OK

__all__ = ["localized", "path_or_url", "publish_outputs", "run"]

_INPUTS = ("paths", "input", "a", "b")


def path_or_url(text: str) -> Path | str:
    """argparse type: a URL stays a str (``Path`` would fold ``s3://`` into ``s3:/``), anything else is a Path."""
    if is_url(text):
        location = resolve(text)
        return location.path if isinstance(location, LocalLocation) else text
    return Path(text)


@contextlib.contextmanager
def localized(args: argparse.Namespace) -> Iterator[list[RemoteLocation]]:
    """Replace URL arguments of ``args`` by local files for the duration of the command.

    Yields the list of outputs to publish; :func:`publish_outputs` uploads them.
    """
    with contextlib.ExitStack() as stack:
        for name in _INPUTS:
            value = getattr(args, name, None)
            if value is None:
                continue
            items = value if isinstance(value, list) else [value]
            if any(isinstance(item, str) for item in items):
                local = stack.enter_context(local_inputs(items))
                setattr(args, name, [Path(p) for p in local] if isinstance(value, list) else Path(local[0]))
        outputs: list[tuple[RemoteLocation, Path]] = []
        output = getattr(args, "output", None)
        if isinstance(output, str):
            remote = resolve(output)
            remote.refuse_existing(getattr(args, "overwrite", False))
            spool = stack.enter_context(spool_folder())
            args.output = spool / remote.name
            outputs.append((remote, args.output))
        yield outputs


def publish_outputs(outputs: list[tuple[RemoteLocation, Path]], overwrite: bool) -> None:
    """Upload every local output to its URL (atomically: temporary key, then move)."""
    for remote, local in outputs:
        remote.publish_file(local, overwrite=overwrite)
        print(f"uploaded {remote.display}")


def run(args: argparse.Namespace) -> int:
    """Run the subcommand of ``args`` on local copies of its URL arguments; upload its output if it succeeded."""
    with localized(args) as outputs:
        code = args.func(args)
        if code == EXIT_OK:
            publish_outputs(outputs, getattr(args, "overwrite", False))
        return code
