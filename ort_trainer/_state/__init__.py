"""The trainer's state: state dicts (legacy layout and torch's), loads, options, and state across ranks.

Modules: `_compose` (``state_dict()``), `_load` (two-phase ``load_state_dict``), `_options`
(`StateDictOptions`), `_torch_optim` (optimizer state in ``torch.optim``'s format), `_ranks` (full
state under ZeRO, ``broadcast_from_rank0``),
`_stateful` (extra objects in checkpoints), `_onnx` (``save_as_onnx``, the export self-check),
`_checkpoint` (``save_checkpoint`` / ``load_checkpoint``: the trainer's side of ``checkpoint/``).
Everything works on the trainer's `TrainerState` (`ort_trainer.engine.TrainerState`), never on the trainer class.
"""

from ._checkpoint import load_trainer_checkpoint, save_trainer_checkpoint
from ._compose import trainer_state_dict
from ._load import _apply, _validate, check_input, load_trainer_state_dict
from ._onnx import check_model_export, eval_model_with_weights
from ._options import StateDictOptions, resolve_options
from ._stateful import encode_stateful, load_stateful, own_rank_section
from ._torch_optim import load_optimizer_state_dict, optimizer_state_dict

__all__ = [
    "StateDictOptions",
    "_apply",
    "_validate",
    "check_input",
    "check_model_export",
    "encode_stateful",
    "eval_model_with_weights",
    "load_optimizer_state_dict",
    "load_stateful",
    "load_trainer_checkpoint",
    "load_trainer_state_dict",
    "optimizer_state_dict",
    "own_rank_section",
    "resolve_options",
    "save_trainer_checkpoint",
    "trainer_state_dict",
]
