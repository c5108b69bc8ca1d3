"""The ``ort-trainer-ckpt`` command line: one module per subcommand, the parser and entry point in ``_main``.

Subcommands: ``_inspect``, ``_verify``, ``_diff``, ``_convert``, ``_aggregate``; ``_common``: exit codes, input
kinds, JSON values, atomic output; ``_remote``: fsspec URLs (remote inputs downloaded, a remote output uploaded).
"""

from ._main import build_parser, main

__all__ = ["build_parser", "main"]
