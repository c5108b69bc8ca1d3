"""``ort-trainer-ckpt convert``: checkpoint <-> ``.pt`` or ``.safetensors`` state dict; training state -> checkpoint.

Checkpoint (ours, legacy, or a manifest's set) -> ``{name: tensor}`` of ``model/full_precision`` and
``model/buffers`` (plus ``optimizer/<name>/<key>`` tensors with ``--optimizer``). The reverse turns a flat
state dict into a weights-only checkpoint: ``model/full_precision/<name>`` (integer tensors in
``model/buffers``), default ``trainer_options`` and zeroed ``train_step_info``. ``.pt`` files are read with
``torch.load(weights_only=True)`` only. A training artifact's folder or state file (docs/anywhere.md: a state a
driver trained in Node or a browser) becomes a whole checkpoint: weights, buffers, moments and update count, which
``ORTTrainer.load_checkpoint`` resumes from.
"""

from __future__ import annotations

import argparse
import pickle
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..errors import CheckpointFormatError
from ..format import open_checkpoint, save
from ..format import schema as S
from ..format.lazy_torch import torch
from ..format.schema import TrainerOptionsRecord
from ..sets import aggregate_checkpoints
from ._common import EXIT_OK, InputKind, check_output, input_kind, output_kind, write_atomically
from ._remote import path_or_url

__all__ = [
    "OPTIMIZER_NAMES",
    "add_command",
    "checkpoint_tensors",
    "drop_counters",
    "flatten",
    "read_state_dict",
    "run_convert",
    "run_convert_training_state",
    "strip_prefix",
    "weights_only_tree",
    "write_tensors",
]

OPTIMIZER_NAMES = ("AdamOptimizer", "LambOptimizer", "SGDOptimizer")
_SKIPPED_BUFFER = "num_batches_tracked"  # int BatchNorm counter (`drop_counters`; convert keeps it in model/buffers)
_MAX_LISTED = 10


def _listed(items: list[str]) -> str:
    more = f" and {len(items) - _MAX_LISTED} more" if len(items) > _MAX_LISTED else ""
    return f"{items[:_MAX_LISTED]}{more}"


# ---- pure transformations ------------------------------------------------------------------------------
def flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """{'a': {'b': v}} -> {'a/b': v} (prefix joined with '/')."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}/{key}" if prefix else str(key)
        flat |= flatten(value, name) if isinstance(value, Mapping) else {name: value}
    return flat


def _as_tensors(values: Mapping[str, Any], source: Path, what: str) -> dict[str, torch.Tensor]:
    """Tensors as they are, python numbers as 0-d tensors; anything else is an error listing every offender."""
    out, bad = {}, []
    for key, value in values.items():
        if isinstance(value, torch.Tensor):
            out[key] = value
        elif isinstance(value, bool | int | float):
            out[key] = torch.tensor(value)
        else:
            bad.append(f"{key} ({type(value).__name__})")
    if bad:
        raise CheckpointFormatError(f"{source}: {what} values that are not tensors: {_listed(sorted(bad))}")
    return out


def strip_prefix(tensors: Mapping[str, Any], prefix: str | None, source: Path) -> dict[str, Any]:
    """Drop ``prefix`` (e.g. 'module.' of DDP) from the names that start with it; at least one must."""
    if not prefix:
        return dict(tensors)
    if not any(name.startswith(prefix) for name in tensors):
        raise CheckpointFormatError(
            f"--prefix-strip {prefix!r}: no name in {source} starts with it (names: {_listed(sorted(tensors))})"
        )
    out: dict[str, Any] = {}
    for name, value in tensors.items():
        new = name.removeprefix(prefix)
        if not new or new in out:
            raise CheckpointFormatError(f"--prefix-strip {prefix!r}: '{name}' becomes {new!r}, empty or a duplicate")
        out[new] = value
    return out


def weights_only_tree(tensors: Mapping[str, torch.Tensor], optimizer_name: str) -> dict[str, Any]:
    """A single-process checkpoint tree of model weights, as ``ORTTrainer.load_checkpoint`` reads it.

    Names ``optimizer/<name>/<key>`` (as ``convert --optimizer`` writes them) go back into the optimizer group;
    tensors that are not floating point (integer buffers: a step counter, ``num_batches_tracked``) into
    ``model/buffers``, where the trainer reads them.
    """
    prefix = f"{S.OPTIMIZER_KEY}/"
    model = {name: t.detach() for name, t in tensors.items() if not name.startswith(prefix)}
    weights = {name: t for name, t in model.items() if t.is_floating_point() or t.is_complex()}
    buffers = {name: t for name, t in model.items() if name not in weights}
    optimizer: dict[str, Any] = {}
    for name, tensor in tensors.items():
        if name.startswith(prefix):
            *groups, leaf = name.removeprefix(prefix).split("/")
            node = optimizer
            for group in groups:
                node = node.setdefault(group, {})
            node[leaf] = tensor.detach()
    options = TrainerOptionsRecord(
        mixed_precision=False,
        zero_stage=0,
        world_rank=0,
        world_size=1,
        optimizer_name=optimizer_name,
        data_parallel_size=1,
        horizontal_parallel_size=1,
    )
    tree = {
        S.MODEL_KEY: {S.FULL_PRECISION_KEY: weights} | ({S.BUFFERS_KEY: buffers} if buffers else {}),
        S.TRAINER_OPTIONS_KEY: options.to_tree(),
        S.TRAIN_STEP_INFO_KEY: {S.OPTIMIZATION_STEP_KEY: 0, S.TRAIN_STEP_KEY: 0},
    }
    return tree | ({S.OPTIMIZER_KEY: optimizer} if optimizer else {})


# ---- reading ---------------------------------------------------------------------------------------------
def checkpoint_tensors(source: Path, kind: InputKind, optimizer: bool) -> dict[str, torch.Tensor]:
    """``{name: tensor}`` of the model weights (+ ``optimizer/<name>/<key>``) of a checkpoint or a manifest's set."""
    if kind == "manifest":
        state = aggregate_checkpoints(source)
    else:
        with open_checkpoint(source) as reader:
            options = reader.read(S.TRAINER_OPTIONS_KEY) if S.TRAINER_OPTIONS_KEY in reader else {}
            _refuse_partitioned(options, source, optimizer)
            weights_key = (S.MODEL_KEY, S.FULL_PRECISION_KEY)
            state = {S.MODEL_KEY: {S.FULL_PRECISION_KEY: reader.read(weights_key)}} if weights_key in reader else {}
            buffers_key = (S.MODEL_KEY, S.BUFFERS_KEY)
            if state and buffers_key in reader:
                state[S.MODEL_KEY][S.BUFFERS_KEY] = reader.read(buffers_key)
            if optimizer and S.OPTIMIZER_KEY in reader:
                state[S.OPTIMIZER_KEY] = reader.read(S.OPTIMIZER_KEY)
    weights = state.get(S.MODEL_KEY, {}).get(S.FULL_PRECISION_KEY)
    if not isinstance(weights, Mapping):
        raise CheckpointFormatError(f"{source} has no '{S.MODEL_KEY}/{S.FULL_PRECISION_KEY}' group of weights")
    tensors = _as_tensors(weights, source, f"'{S.MODEL_KEY}/{S.FULL_PRECISION_KEY}' has")
    buffers = state[S.MODEL_KEY].get(S.BUFFERS_KEY)  # integer buffers (num_batches_tracked): a module's state too
    if isinstance(buffers, Mapping):
        buffers = _as_tensors(buffers, source, f"'{S.MODEL_KEY}/{S.BUFFERS_KEY}' has")
        both = sorted(set(buffers) & set(tensors))
        if both:
            raise CheckpointFormatError(
                f"{source}: {_listed(both)} are both in '{S.MODEL_KEY}/{S.FULL_PRECISION_KEY}' and "
                f"'{S.MODEL_KEY}/{S.BUFFERS_KEY}'"
            )
        tensors |= buffers
    if optimizer:
        if not isinstance(state.get(S.OPTIMIZER_KEY), Mapping) or not state[S.OPTIMIZER_KEY]:
            raise CheckpointFormatError(f"{source} has no '{S.OPTIMIZER_KEY}' state; convert without --optimizer")
        tensors |= _as_tensors(flatten(state[S.OPTIMIZER_KEY], S.OPTIMIZER_KEY), source, "the optimizer has")
    return tensors


def _refuse_partitioned(options: Any, source: Path, optimizer: bool) -> None:
    """One rank's file of a Megatron save (or of a ZeRO save, with --optimizer) holds only pieces."""
    get = options.get if isinstance(options, Mapping) else (lambda key, default: default)
    world, zero = get(S.WORLD_SIZE_KEY, 1), get(S.ZERO_STAGE_KEY, 0)
    megatron = get(S.HORIZONTAL_PARALLEL_SIZE_KEY, 1) > 1
    if world > 1 and (megatron or (optimizer and zero > 0)):
        what = "Megatron-partitioned weights" if megatron else "ZeRO pieces of the optimizer state"
        raise CheckpointFormatError(
            f"{source} is rank {get(S.WORLD_RANK_KEY, '?')} of a {world}-rank save and holds {what}; "
            "convert the save's manifest (<path>.manifest.json) instead, or aggregate it first"
        )


def read_state_dict(source: Path, kind: InputKind) -> dict[str, Any]:
    """A ``.safetensors`` file, or a ``.pt`` file through ``torch.load(weights_only=True)`` (never full pickle)."""
    if kind == "safetensors":
        return dict(_safetensors().load_file(str(source)))
    try:
        data = torch.load(source, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError) as exc:
        raise CheckpointFormatError(
            f"{source} cannot be read with torch.load(weights_only=True) (no full unpickling here): {_reason(exc)}"
        ) from None
    if not isinstance(data, Mapping):
        raise CheckpointFormatError(f"{source} holds a {type(data).__name__}, expected a {{name: tensor}} state dict")
    bad = sorted(f"{k} ({type(v).__name__})" for k, v in data.items() if not isinstance(v, torch.Tensor))
    if bad:
        raise CheckpointFormatError(
            f"{source}: expected a flat {{name: tensor}} state dict (e.g. model.state_dict()), "
            f"got non-tensor values at {_listed(bad)}"
        )
    return dict(data)


def _reason(exc: BaseException) -> str:
    """The useful line of torch's long weights-only message (the refused global), without ANSI codes."""
    lines = [re.sub(r"\x1b\[[0-9;]*m", "", line).strip() for line in str(exc).splitlines() if line.strip()]
    found = [line for line in lines if "Unsupported" in line or "Unpickler error" in line]
    return (found or lines or [type(exc).__name__])[0]


def drop_counters(tensors: Mapping[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], list[str]]:
    """Remove BatchNorm ``num_batches_tracked`` counters (not weights; ``convert`` now keeps them in
    ``model/buffers``, as the trainer saves them: this stays for callers that want the weights alone)."""
    dropped = sorted(k for k in tensors if k.rsplit(".", 1)[-1] == _SKIPPED_BUFFER)
    return {k: v for k, v in tensors.items() if k not in dropped}, dropped


# ---- writing ---------------------------------------------------------------------------------------------
def write_tensors(tensors: Mapping[str, torch.Tensor], target: Path, *, overwrite: bool) -> None:
    """``torch.save`` of the dict (.pt) or ``safetensors.torch.save_file`` (.safetensors), atomically."""
    if output_kind(target) == "safetensors":
        st = _safetensors()
        data = {k: v.detach().contiguous().clone() for k, v in tensors.items()}  # safetensors refuses shared memory
        metadata = {"format": "pt"}
        write_atomically(target, lambda tmp: st.save_file(data, str(tmp), metadata=metadata), overwrite=overwrite)
    else:
        data = {k: v.detach() for k, v in tensors.items()}
        write_atomically(target, lambda tmp: torch.save(data, tmp), overwrite=overwrite)


def run_convert(
    source: Path,
    target: Path,
    kind: InputKind,
    *,
    optimizer: bool,
    prefix: str | None,
    optimizer_name: str,
    overwrite: bool,
) -> str:
    """Convert in the direction the input kind and output suffix give; return a one-line summary."""
    out_kind = output_kind(target)
    from_checkpoint = kind in ("checkpoint", "manifest")
    if from_checkpoint == (out_kind == "checkpoint"):
        want = "a .pt or .safetensors output" if from_checkpoint else "a checkpoint output (e.g. .ortcp)"
        raise CheckpointFormatError(f"cannot convert {source} ({kind}) to {target} ({out_kind}): expected {want}")
    if from_checkpoint:
        tensors = strip_prefix(checkpoint_tensors(source, kind, optimizer), prefix, source)
        write_tensors(tensors, target, overwrite=overwrite)
        note = ""
    else:
        if optimizer:
            raise CheckpointFormatError("--optimizer applies only when converting from a checkpoint")
        tensors = strip_prefix(read_state_dict(source, kind), prefix, source)
        save(weights_only_tree(tensors, optimizer_name), target, overwrite=overwrite)
        note = ""
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    return f"wrote {target}: {len(tensors)} tensors, {nbytes:,} bytes of data, from {source}{note}"


def _safetensors() -> Any:
    try:
        import safetensors.torch
    except ImportError:
        raise CheckpointFormatError(
            "reading or writing .safetensors needs the 'safetensors' package, which is not installed: "
            'pip install safetensors (or, in a clone of ort_trainer, pip install ".[safetensors]")'
        ) from None
    return safetensors.torch


# ---- the subcommand --------------------------------------------------------------------------------
def add_command(sub: argparse._SubParsersAction, command) -> None:
    """Register ``convert`` on the CLI's subparsers."""
    p = command(sub, "convert", _run, "checkpoint -> .pt/.safetensors state dict, or a state dict -> checkpoint")
    p.add_argument(
        "input",
        type=path_or_url,
        metavar="IN",
        help="checkpoint, manifest, .pt or .safetensors file, or a training artifact's folder (docs/anywhere.md)",
    )
    p.add_argument(
        "-o", "--output", type=path_or_url, required=True, metavar="OUT", help="output; its suffix picks the format"
    )
    p.add_argument("--optimizer", action="store_true", help="also write optimizer tensors as optimizer/<name>/<key>")
    p.add_argument("--prefix-strip", metavar="PREFIX", help="drop PREFIX from names (e.g. 'module.' of DDP)")
    p.add_argument(
        "--optimizer-name", choices=OPTIMIZER_NAMES, default="AdamOptimizer", help="trainer_options/optimizer_name"
    )
    p.add_argument("--overwrite", action="store_true", help="replace OUT if it exists")


def run_convert_training_state(source: Path, target: Path, *, optimizer_name: str, overwrite: bool) -> str:
    """A training artifact's state (its folder, or a state file alone: ``optimizer_name`` then says whose moments it
    holds) -> a checkpoint of weights, buffers, optimizer state and update count."""
    from ort_trainer.export import load_training_state

    if output_kind(target) != "checkpoint":
        raise CheckpointFormatError(
            f"{source} is a training artifact's state: convert it to a checkpoint (e.g. .ortcp)"
        )
    try:
        state = load_training_state(source, optimizer=None if source.is_dir() else optimizer_name)
    except ValueError as error:  # ArtifactError: a bad file, said by name
        raise CheckpointFormatError(str(error)) from None
    save(state.trainer_state_dict(), target, overwrite=overwrite)
    return (
        f"wrote {target}: {len(state.weights) + len(state.buffers)} model tensors, {state.optimizer} state of "
        f"{len(state.moments)} parameters, update count {state.step}, from {source}"
    )


def _training_state(path: Any) -> bool:
    if not isinstance(path, Path):
        return False
    from ort_trainer.export import is_training_state

    return is_training_state(path)


def _run(args: argparse.Namespace) -> int:
    check_output(args.output, args.overwrite)
    if _training_state(args.input):
        print(
            run_convert_training_state(
                args.input, args.output, optimizer_name=args.optimizer_name, overwrite=args.overwrite
            )
        )
        return EXIT_OK
    summary = run_convert(
        args.input,
        args.output,
        input_kind(args.input),
        optimizer=args.optimizer,
        prefix=args.prefix_strip,
        optimizer_name=args.optimizer_name,
        overwrite=args.overwrite,
    )
    print(summary)
    return EXIT_OK
