"""Which `TrainingArguments` the ONNX Runtime integration honours, and the ORTTrainer options they become.

Every argument is either honoured (it reaches HF's own loop, HF's LR scheduler, the AdamW config or the
ORTTrainer options) or refused here, at construction, with a ValueError naming it: nothing is silently
ignored. Arguments that only steer HF's own loop (logging, saving, evaluation, data loading, callbacks)
keep working untouched and are not listed.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

__all__ = ["SUPPORTED_OPTIMIZERS", "check_training_arguments", "ort_options"]

SUPPORTED_OPTIMIZERS = ("adamw_torch", "adamw_torch_fused")

# argument -> (is the value acceptable?, why it is refused)
_REFUSED: dict[str, tuple[Any, str]] = {
    "optim_args": (lambda v: not v, "optimizer arguments belong to optimizers other than AdamW"),
    "optim_target_modules": (lambda v: v is None, "GaLore/APOLLO-style optimizers are not available"),
    "bf16": (lambda v: not v, "bfloat16 training is not implemented by ort_trainer.amp (use fp16)"),
    "bf16_full_eval": (lambda v: not v, "evaluation runs the ONNX Runtime eval graph in float32"),
    "fp16_full_eval": (lambda v: not v, "evaluation runs the ONNX Runtime eval graph in float32"),
    "tf32": (lambda v: not v, "TF32 is a CUDA matmul setting of PyTorch; ONNX Runtime does not read it"),
    "torch_compile": (lambda v: not v, "the model is exported to ONNX, not compiled by torch.compile"),
    "use_liger_kernel": (lambda v: not v, "Liger kernels are PyTorch/Triton kernels"),
    "neftune_noise_alpha": (lambda v: v is None, "NEFTune adds noise from a PyTorch forward hook"),
    "auto_find_batch_size": (lambda v: not v, "it retries after CUDA out-of-memory errors of PyTorch"),
    "fsdp": (lambda v: not v, "use ZeRO through ort_options (distributed.deepspeed_zero_optimization)"),
    "deepspeed": (lambda v: v is None, "use ZeRO through ort_options (distributed.deepspeed_zero_optimization)"),
    "parallelism_config": (lambda v: v is None, "tensor/context/sequence parallel are not implemented"),
    "debug": (lambda v: not v, "debug options hook PyTorch modules"),
}


def _value(value: Any) -> Any:
    return getattr(value, "value", value)  # HF enums (OptimizerNames, ...) -> their string


def check_training_arguments(args: Any) -> None:
    """ValueError naming the first `TrainingArguments` field the integration cannot honour."""
    optim = _value(args.optim)
    if optim not in SUPPORTED_OPTIMIZERS:
        raise ValueError(
            f"TrainingArguments.optim={optim!r} is not supported by ort_trainer.hf.Trainer: the update runs in "
            f"ONNX Runtime, which implements AdamW; use one of {list(SUPPORTED_OPTIMIZERS)}"
        )
    if getattr(args, "gradient_checkpointing", False) or getattr(args, "activation_checkpointing", False):
        # transformers 5: each is the other's alias, both True when either is set; name the one users know first
        raise ValueError(
            "TrainingArguments.gradient_checkpointing=True / TrainingArguments.activation_checkpointing=True (one "
            "setting under two names) is not supported by ort_trainer.hf.Trainer: ONNX Runtime keeps activations in "
            "its own graph"
        )
    for name, (acceptable, why) in _REFUSED.items():
        value = getattr(args, name, None)
        if not acceptable(value):
            raise ValueError(f"TrainingArguments.{name}={value!r} is not supported by ort_trainer.hf.Trainer: {why}")
    if args.n_gpu > 1:
        raise ValueError(
            f"TrainingArguments.n_gpu={args.n_gpu}: torch.nn.DataParallel is not supported by ort_trainer.hf.Trainer; "
            "launch one process per device with torchrun instead"
        )


def _merge(base: dict, extra: Mapping, where: str) -> dict:
    for key, value in extra.items():
        if isinstance(value, Mapping) and isinstance(base.get(key), dict):
            base[key] = _merge(base[key], value, f"{where}{key}.")
        else:
            base[key] = value
    return base


_OWNED = {
    ("batch", "gradient_accumulation_steps"): "TrainingArguments.gradient_accumulation_steps",
    ("lr_scheduler",): "TrainingArguments.lr_scheduler_type",
    ("utils", "grad_norm_clip"): "TrainingArguments.max_grad_norm",
    ("distributed", "world_rank"): "torchrun (TrainingArguments.process_index)",
    ("distributed", "world_size"): "torchrun (TrainingArguments.world_size)",
    ("mixed_precision",): "TrainingArguments.fp16 (mixed precision is not available through the HF Trainer yet)",
}


def _check_owned(user: Mapping) -> None:
    for path, owner in _OWNED.items():
        node: Any = user
        for key in path:
            if not isinstance(node, Mapping) or key not in node:
                break
            node = node[key]
        else:
            raise ValueError(f"ort_options[{']['.join(repr(k) for k in path)}] is set by {owner}; remove it")


def ort_options(args: Any, user: Mapping[str, Any] | None) -> dict[str, Any]:
    """ORTTrainer options from the `TrainingArguments` (+ the caller's ``ort_options``, e.g. ZeRO)."""
    if user is not None and not isinstance(user, Mapping):
        raise TypeError(f"ort_options must be a dict of ORTTrainer options, got {type(user).__name__}")
    user = copy.deepcopy(dict(user or {}))
    _check_owned(user)
    device = args.device
    options = {
        "device": {"id": "cpu" if device.type == "cpu" else str(device)},
        "batch": {"gradient_accumulation_steps": args.gradient_accumulation_steps},
        "utils": {"grad_norm_clip": args.max_grad_norm > 0},
        "distributed": {"world_rank": args.process_index, "world_size": args.world_size},
    }
    return _merge(options, user, "")
