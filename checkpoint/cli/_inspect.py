"""``ort-trainer-ckpt inspect``: describe a checkpoint file or a manifest's set without loading tensors.

``describe_file`` / ``describe_manifest`` read metadata and the small groups into a JSON-ready
dict; ``format_doc`` turns such a dict into text lines. Nothing is unpickled: a legacy ORTTrainer
``user_dict`` (a hex string of a pickle) and ``__pickle__`` values are reported, not decoded.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..errors import CheckpointError, CheckpointFormatError
from ..format import CheckpointReader, DatasetInfo, open_checkpoint
from ..format import schema as S
from ..format.schema import PartitionInfo
from ..sets import read_manifest
from ._common import EXIT_OK, OUR_KINDS, PROG, input_kind, jsonable, key_str, value_nbytes
from ._remote import path_or_url

__all__ = ["add_command", "describe_file", "describe_manifest", "format_doc"]

LEGACY_USER_DICT = "legacy pickled user_dict (not decoded)"
_MEGATRON_AXES = {0: "column (last axis)", 1: "row (axis 0)"}
_SMALL_GROUPS = (S.TRAINER_OPTIONS_KEY, S.TRAIN_STEP_INFO_KEY, S.LR_SCHEDULER_KEY, S.LOSS_SCALER_KEY)


# ---- gathering (reads files) -----------------------------------------------------------------------
def describe_file(path: Path) -> dict[str, Any]:
    """Everything ``inspect`` reports about one checkpoint file, as JSON-ready values."""
    with open_checkpoint(path) as reader:
        return _describe_reader(reader)


def _describe_reader(reader: CheckpointReader) -> dict[str, Any]:
    keys = set(reader.keys())
    infos = list(reader.walk())
    tree = [
        {"key": key_str(k), "shape": list(i.shape), "dtype": i.dtype_name, "nbytes": value_nbytes(i)} for k, i in infos
    ]
    doc: dict[str, Any] = {
        "path": str(reader.path),
        "kind": "checkpoint",
        "file_size": reader.path.stat().st_size,
        "format_version": reader.format_version,
        "legacy": reader.is_legacy,
        "library_version": reader.attrs.get(S.ATTR_LIBRARY_VERSION),
    }
    doc |= {name: jsonable(reader.read(name)) if name in keys else None for name in _SMALL_GROUPS}
    doc["distributed"] = jsonable(reader.read(S.DISTRIBUTED_KEY)) if S.DISTRIBUTED_KEY in keys else None
    doc["user_dict"] = _user_dict(reader) if S.USER_DICT_KEY in keys else None
    doc["partitions"] = _partitions(reader, doc[S.TRAINER_OPTIONS_KEY]) if S.PARTITION_INFO_KEY in keys else []
    doc["datasets"] = len(tree)
    doc["array_bytes"] = sum(value_nbytes(i) or 0 for _, i in infos if i.is_array)
    doc["tree"] = tree
    return doc


def _user_dict(reader: CheckpointReader) -> dict[str, Any]:
    """Its top-level keys and which values are pickled, read from the structure only (never unpickled)."""
    info = reader.tree_info(S.USER_DICT_KEY)
    if isinstance(info, DatasetInfo):
        if not info.is_array and info.dtype in (str, bytes):
            return {"encoding": "legacy_pickle", "keys": None, "pickled": None, "description": LEGACY_USER_DICT}
        return {"encoding": "unknown", "keys": None, "pickled": None, "description": "unrecognised (not decoded)"}
    prefix: tuple[str, ...] = (S.USER_DICT_KEY,)
    if list(info) == [S.TAG_DICT]:
        prefix = (S.USER_DICT_KEY, S.TAG_DICT)
    pickled = sorted(
        key_str(k[1 : k.index(S.TAG_PICKLE)]) for k, _ in reader.walk(S.USER_DICT_KEY) if S.TAG_PICKLE in k
    )
    return {"encoding": "tree", "keys": reader.keys(prefix), "pickled": pickled}


def _partitions(reader: CheckpointReader, options: Any) -> list[dict[str, Any]]:
    """One entry per ``partition_info/<name>``: full shape, Megatron axis and slice, the stored piece and its range.

    A ZeRO ``offset`` indexes the flattened tensor, or with Megatron the flattened slice ``h`` (rank = d*H + h).
    """
    options = options if isinstance(options, Mapping) else {}
    horizontal = options.get(S.HORIZONTAL_PARALLEL_SIZE_KEY, 1)
    rank = options.get(S.WORLD_RANK_KEY, 0)
    entries = []
    for name in reader.keys(S.PARTITION_INFO_KEY):
        entry: dict[str, Any] = {"name": name}
        try:
            info = PartitionInfo.from_tree(reader.read((S.PARTITION_INFO_KEY, name)))
        except (ValueError, TypeError) as exc:
            entries.append(entry | {"error": str(exc)})
            continue
        stored = _stored_shape(reader, name)
        numel = None if stored is None else math.prod(stored)
        megatron = info.megatron_row_partition in _MEGATRON_AXES
        entry |= {
            "original_dim": list(info.original_dim),
            "megatron_row_partition": info.megatron_row_partition,
            "megatron_axis": _MEGATRON_AXES.get(info.megatron_row_partition),
            "megatron_slice": rank % horizontal if megatron else None,
            "flat_numel": math.prod(info.original_dim) // (horizontal if megatron else 1),
            "offset": info.offset,
            "stored_shape": stored,
            "numel": numel,
            "range": None if info.offset is None or numel is None else [info.offset, info.offset + numel],
        }
        entries.append(entry)
    return entries


def _stored_shape(reader: CheckpointReader, name: str) -> list[int] | None:
    """Shape of the piece this file holds: the first moment (ZeRO pieces), else the weight (Megatron slice)."""
    for key in ((S.OPTIMIZER_KEY, name, S.MOMENT_1_KEY), (S.MODEL_KEY, S.FULL_PRECISION_KEY, name)):
        if key in reader:
            info = reader.tree_info(key)
            if isinstance(info, DatasetInfo):
                return list(info.shape)
    return None


def describe_manifest(path: Path) -> dict[str, Any]:
    """The manifest's identity, each rank file (present? size, datasets) and the set's partitions."""
    manifest = read_manifest(path)
    files, docs = [], []
    for entry, file in zip(manifest.files, manifest.rank_paths(), strict=True):
        item: dict[str, Any] = {"rank": entry.rank, "name": entry.name, "size": entry.size, "crc32": entry.crc32}
        item["exists"] = file.is_file()
        if item["exists"]:
            try:
                docs.append((entry.rank, describe_file(file)))
                item |= {k: docs[-1][1][k] for k in ("file_size", "datasets", "array_bytes")}
            except CheckpointError as exc:
                item["error"] = str(exc)
        files.append(item)
    doc: dict[str, Any] = {
        "path": str(manifest.path),
        "kind": "manifest",
        "run_id": manifest.run_id,
        "world_size": manifest.world_size,
        "step": manifest.step,
        "files": files,
    }
    first = docs[0][1] if docs else {}
    for key in ("format_version", "legacy", "library_version", *_SMALL_GROUPS, "user_dict"):
        doc[key] = first.get(key)
    doc["partitions"] = _merge_partitions(docs)
    return doc


def _merge_partitions(docs: list[tuple[int, dict[str, Any]]]) -> list[dict[str, Any]]:
    """Per partitioned tensor: its full shape and axis, and every rank's piece (in rank order)."""
    merged: dict[str, dict[str, Any]] = {}
    for rank, doc in docs:
        for part in doc["partitions"]:
            common = {k: part.get(k) for k in ("name", "original_dim", "megatron_row_partition", "megatron_axis")}
            target = merged.setdefault(part["name"], common | {"pieces": []})
            piece_keys = ("megatron_slice", "offset", "numel", "flat_numel", "range", "stored_shape", "error")
            piece = {k: part.get(k) for k in piece_keys}
            target["pieces"].append({"rank": rank} | {k: v for k, v in piece.items() if v is not None})
    return [merged[name] for name in sorted(merged)]


# ---- formatting (pure) -----------------------------------------------------------------------------
def format_doc(doc: Mapping[str, Any]) -> list[str]:
    """Text lines for one ``describe_file`` or ``describe_manifest`` result."""
    if doc["kind"] == "manifest":
        lines = _manifest_header(doc)
    else:
        lines = [_file_header(doc)]
    lines += _summary_lines(doc)
    lines += _partition_lines(doc)
    if doc["kind"] == "checkpoint":
        lines += _tree_lines(doc["tree"], doc["array_bytes"])
    return lines


def _file_header(doc: Mapping[str, Any]) -> str:
    if doc["legacy"]:
        what = "legacy ORTTrainer checkpoint (format version 0, no checksums)"
    else:
        what = f"ort_trainer checkpoint, format version {doc['format_version']} (ort_trainer {doc['library_version']})"
    return f"{doc['path']}: {what}, {doc['file_size']:,} bytes"


def _manifest_header(doc: Mapping[str, Any]) -> list[str]:
    lines = [
        f"{doc['path']}: manifest of a {doc['world_size']}-rank save, run_id {doc['run_id']!r}, step {doc['step']}"
    ]
    for f in doc["files"]:
        state = "MISSING" if not f["exists"] else f.get("error") or f"{f['datasets']} datasets"
        lines.append(f"  rank {f['rank']}  {f['name']}  {f['size']:,} bytes  crc32 {f['crc32']:#010x}  {state}")
    return lines


def _kv(values: Any) -> str:
    if not isinstance(values, Mapping):
        return repr(values)
    return " ".join(f"{k}={v}" for k, v in values.items())


def _summary_lines(doc: Mapping[str, Any]) -> list[str]:
    lines = []
    source = " (rank 0)" if doc["kind"] == "manifest" else ""
    for key in _SMALL_GROUPS:
        lines.append(f"{key}{source}: {'absent' if doc[key] is None else _kv(doc[key])}")
    lines.append(f"{S.USER_DICT_KEY}: {_user_dict_text(doc['user_dict'])}")
    dist = doc.get("distributed")
    if dist is not None:
        order = dist.get(S.FLAT_ORDER_KEY)
        extra = "" if order is None else f", flat_order of {len(order)} parameters"
        lines.append(f"{S.DISTRIBUTED_KEY}: run_id {dist.get(S.RUN_ID_KEY)!r}{extra}")
    return lines


def _user_dict_text(user_dict: Mapping[str, Any] | None) -> str:
    if user_dict is None:
        return "absent"
    if user_dict["encoding"] == "legacy_pickle":
        return LEGACY_USER_DICT
    if user_dict["encoding"] != "tree":
        return "unrecognised (not decoded)"
    text = f"keys {user_dict['keys']}"
    if user_dict["pickled"]:
        text += f"; pickled values (not decoded): {user_dict['pickled']}"
    return text


def _partition_lines(doc: Mapping[str, Any]) -> list[str]:
    parts = doc["partitions"]
    if not parts:
        return ["partitions: none"]
    opts = doc.get(S.TRAINER_OPTIONS_KEY) or {}
    keys = (S.ZERO_STAGE_KEY, S.DATA_PARALLEL_SIZE_KEY, S.HORIZONTAL_PARALLEL_SIZE_KEY)
    topo = ", ".join(f"{k} {opts[k]}" for k in keys if k in opts)
    lines = [f"partitions: {len(parts)} partitioned tensor(s) ({topo})"]
    for part in parts:
        if "error" in part:
            lines.append(f"  {part['name']}  malformed: {part['error']}")
            continue
        text = f"  {part['name']}  full {tuple(part['original_dim'])}"
        if part["megatron_axis"]:
            text += f"  Megatron {part['megatron_axis']}"
        pieces = part.get("pieces") or [part]
        lines.append(f"{text}  " + ", ".join(_piece_text(p) for p in pieces))
    return lines


def _piece_text(piece: Mapping[str, Any]) -> str:
    """'[slice h: ]ZeRO piece [lo, hi) of N elements' or '[slice h: ]stored (shape)', after the rank in a set."""
    where = f"rank {piece['rank']}: " if "rank" in piece else ""
    if piece.get("error"):
        return f"{where}malformed: {piece['error']}"
    if piece.get("megatron_slice") is not None:
        where += f"slice {piece['megatron_slice']} "
    if piece.get("range"):
        lo, hi = piece["range"]
        return f"{where}ZeRO piece [{lo}, {hi}) of {piece['flat_numel']} elements"
    stored = tuple(piece["stored_shape"]) if piece.get("stored_shape") is not None else "unknown"
    return f"{where}stored {stored}"


def _tree_lines(tree: list[Mapping[str, Any]], array_bytes: int) -> list[str]:
    lines = [f"tree: {len(tree)} datasets, {array_bytes:,} bytes of array data"]
    rows = [
        (e["key"], str(tuple(e["shape"])), e["dtype"], "-" if e["nbytes"] is None else str(e["nbytes"])) for e in tree
    ]
    widths = [max((len(r[i]) for r in rows), default=0) for i in range(4)]
    for row in rows:
        lines.append(f"  {row[0]:<{widths[0]}}  {row[1]:<{widths[1]}}  {row[2]:<{widths[2]}}  {row[3]:>{widths[3]}}")
    return lines


# ---- the subcommand --------------------------------------------------------------------------------
def add_command(sub: argparse._SubParsersAction, command) -> None:
    """Register ``inspect`` on the CLI's subparsers (``command`` adds the shared ``--debug`` flag)."""
    p = command(sub, "inspect", _run, "show the tree, options, step info, user_dict keys and partitions")
    p.add_argument("paths", nargs="+", type=path_or_url, metavar="PATH", help="checkpoint file or manifest")
    p.add_argument("--json", action="store_true", help="print one JSON document (a list for several PATHs)")


def _run(args: argparse.Namespace) -> int:
    docs = [_describe(path) for path in args.paths]
    if args.json:
        print(json.dumps(docs[0] if len(docs) == 1 else docs, indent=2))
    else:
        print("\n\n".join("\n".join(format_doc(doc)) for doc in docs))
    return EXIT_OK


def _describe(path: Path) -> dict:
    kind = input_kind(path, OUR_KINDS)
    if kind == "manifest":
        return describe_manifest(path)
    if kind != "checkpoint":
        raise CheckpointFormatError(
            f"{path} is a {kind} file; inspect reads checkpoints and manifests (convert it first: "
            f"{PROG} convert {path} -o <file>.ortcp)"
        )
    return describe_file(path)
