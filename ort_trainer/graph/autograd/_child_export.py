"""The dynamo exporter run in a forked child process, so that its memory never joins the training process's.

An export imports the exporter (onnxscript, onnx_ir and torch.onnx's dynamo exporter: ~63 MiB of modules) and
leaves a heap behind that the process keeps for its life; both sit under the activations of the first training
step, where the peak RSS is reached (GPT-2 124M, batch 4 x 128, cold build: +150 MiB, peak 1.15x eager PyTorch's
against 1.10x when the graph came from the cache). A child forked for the export inherits the traced graph, exports
it, sends back the serialized model and exits: its memory goes back to the OS before the first step. (Inductor
compiles in subprocess workers for the same kind of reason.) The child pays for the exporter's import and its
translation registry on every export (1-3 s), so by default ("auto") only graphs whose inputs (the parameters
among them) take at least `AUTO_BYTES` go to a child: from a model of a few million parameters up (GPT-2 with 4
layers of width 256, 5.2M: ORTModule's peak RSS 1064 -> 955 MiB) the export's memory is a good
share of the peak and its time the smaller part of the build; the tiny models of tests and quick checks export in
this process.

``ORT_TRAINER_EXPORT_IN_CHILD``: ``auto`` (default), ``1`` (every export in a child), ``0`` (none). The export
stays in this process where a fork is not possible or not safe: no ``os.fork`` (Windows), macOS (system
frameworks are not fork-safe), or CUDA initialised here (a forked child cannot use it). A child that fails for
any reason (the export's own error, a signal) is not trusted with an answer: the export then runs here, and
returns or raises exactly as it always did. The child's warnings and the ``ort_trainer`` log records it makes
are replayed here, where the user's filters and handlers are.

`ORTTrainer`'s autograd engine forks before its trace (``engine.autograd._build._GraphBuilder.graphs``): the child
traces, hits the cache or exports, and sends back the graph with what the trace taught the engine in its metadata,
so the tracer's lazy imports and its heap (~27 MiB at BERT small) stay out of the process too. Inside a child,
`export_in_child` says no: nothing forks twice.
"""

from __future__ import annotations

import json
import logging
import os
import struct
import sys
import warnings
from collections.abc import Callable, Sequence

import onnx
import torch

__all__ = ["AUTO_BYTES", "ENV", "build_in_child", "export_in_child"]

ENV = "ORT_TRAINER_EXPORT_IN_CHILD"
AUTO_BYTES = 16 << 20  # graph inputs of 16 MiB and more (4M float parameters) export in a child

_log = logging.getLogger("ort_trainer")
_HEADER = struct.Struct("<Q")  # the JSON part's length, then the JSON, then the model's bytes
_in_a_child = False  # True in a child of `build_in_child`


def export_in_child(inputs: Sequence[object]) -> bool:
    """Whether the export of a graph whose inputs are ``inputs`` runs in a forked child (``ORT_TRAINER_EXPORT_IN_CHILD``
    and where a fork can work); `ValueError` naming the variable for a value that is not auto, 1 or 0."""
    setting = os.environ.get(ENV, "auto").strip().lower()
    if setting not in ("auto", "1", "0"):
        raise ValueError(f"{ENV} must be auto, 1 or 0, got {os.environ[ENV]!r}")
    if setting == "0" or _in_a_child or not _fork_is_safe():  # a child builds in itself: no grandchild
        return False
    if setting == "1":
        return True
    size = sum(x.numel() * x.element_size() for x in inputs if isinstance(x, torch.Tensor))
    return size >= AUTO_BYTES


def _fork_is_safe() -> bool:
    if not hasattr(os, "fork") or sys.platform == "darwin":
        return False
    return not (torch.cuda.is_available() and torch.cuda.is_initialized())


def build_in_child(build: Callable[[], onnx.ModelProto], what: str) -> onnx.ModelProto:
    """``build()``'s model, built in a forked child (`export_in_child` decides whether to ask); where the child
    gives no model, ``build()`` here. ``what`` names the graph in the debug log."""
    read_fd, write_fd = os.pipe()
    with warnings.catch_warnings():
        # Python 3.12+ warns that a fork of a process with threads (ORT's, torch's) may deadlock in the child: the
        # child runs Python and fake tensors only, on one torch thread, and never touches those threads' locks
        warnings.filterwarnings("ignore", category=DeprecationWarning, message=r".*fork\(\)")
        pid = os.fork()
    if pid == 0:  # pragma: no cover - the child; its work is checked by what the parent receives
        _child(build, read_fd, write_fd)
    os.close(write_fd)
    with os.fdopen(read_fd, "rb") as pipe:
        data = pipe.read()
    _, status = os.waitpid(pid, 0)
    model = _received(data, what, pid) if os.waitstatus_to_exitcode(status) == 0 else None
    if model is None:
        _log.debug("%s graph: the export child ended with status %s; exporting in this process", what, status)
        return build()
    return model


def _child(build: Callable[[], onnx.ModelProto], read_fd: int, write_fd: int) -> None:
    """Export, write the answer to ``write_fd``, and leave with ``os._exit`` (no exit handler of the parent's)."""
    global _in_a_child
    _in_a_child = True
    code = 1
    try:
        os.close(read_fd)
        torch.set_num_threads(1)  # no OpenMP pool of the parent's is used in the child
        records: list[dict] = []
        logger = logging.getLogger("ort_trainer")
        logger.handlers[:] = [_Collect(records)]
        logger.propagate = False  # the parent's handlers (inherited here) print only what the parent replays
        with warnings.catch_warnings(record=True) as caught:
            try:
                body = build().SerializeToString()
                error = None
            except Exception as failure:  # noqa: BLE001 - the parent raises it, from its own export
                body, error = b"", f"{type(failure).__name__}: {failure}"
        said = [
            {"message": str(w.message), "category": w.category.__name__, "module": w.category.__module__,
             "filename": w.filename, "lineno": w.lineno}
            for w in caught
        ]  # fmt: skip
        head = {"error": error, "warnings": said, "records": records, "private_kib": _private_kib()}
        head = json.dumps(head).encode()
        with os.fdopen(write_fd, "wb") as pipe:
            pipe.write(_HEADER.pack(len(head)) + head + body)
        code = 0
    finally:
        os._exit(code)


class _Collect(logging.Handler):
    def __init__(self, records: list[dict]):
        super().__init__(logging.NOTSET)
        self.records = records

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append({"name": record.name, "level": record.levelno, "message": record.getMessage()})


def _private_kib() -> int | None:
    """KiB of this process's own pages (not shared with the parent): what the child adds to the machine's use."""
    try:
        with open("/proc/self/smaps_rollup") as rollup:
            fields = dict(line.split(":", 1) for line in rollup if ":" in line)
        return sum(int(fields[key].split()[0]) for key in ("Private_Clean", "Private_Dirty"))
    except (OSError, KeyError, ValueError):
        return None


def _received(data: bytes, what: str, pid: int) -> onnx.ModelProto | None:
    """The child's model, its warnings and log records replayed here; None where it sent no model."""
    if len(data) < _HEADER.size:
        return None
    (length,) = _HEADER.unpack_from(data)
    try:
        head = json.loads(data[_HEADER.size : _HEADER.size + length])
    except ValueError:
        return None
    if head["error"] is not None:  # the export here says it all again
        return None
    try:
        model = onnx.load_from_string(data[_HEADER.size + length :])
    except Exception:  # noqa: BLE001 - a cut-off answer (protobuf's DecodeError): the export here answers instead
        return None
    for record in head["records"]:
        logging.getLogger(record["name"]).log(record["level"], "%s", record["message"])
    for said in head["warnings"]:
        warnings.warn_explicit(said["message"], _category(said), said["filename"], said["lineno"])
    if head["private_kib"] is not None:
        _log.debug("%s graph exported in a child (pid %d): %d MiB of its own", what, pid, head["private_kib"] // 1024)
    return model


def _category(said: dict) -> type[Warning]:
    """The warning's class where its module is loaded here (no import on the child's word), else UserWarning."""
    found = getattr(sys.modules.get(said["module"]), said["category"], None)
    return found if isinstance(found, type) and issubclass(found, Warning) else UserWarning
