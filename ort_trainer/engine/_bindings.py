"""`BindingGuard`: no step runs on bindings that no longer point at the trainer's state (issue S, point 2).

ONNX Runtime reads the flat parameter / gradient buffers and the frozen state through raw pointers, bound
once (DLPack). Two kinds of user action break that silently:

* **The storage moves in place.** ``model.share_memory()``, or a ``torch.multiprocessing`` Queue / Pipe
  carrying ``model.state_dict()`` (pickling a CPU tensor for another process moves its storage into shared
  memory), swap the memory under the very tensors the trainer holds and free the old block, which ORT still
  reads. This is followed: the step sees the new address and rebinds (`rebind_state` of the session), so
  training goes on, equal to PyTorch.
* **The module stops being a view of the trainer's buffers** (``utils.share_module_parameters``, the
  default): ``model.half()`` / ``.double()`` / ``.to(dtype)`` or ``.to(device)``, ``p.data = ...``, a
  parameter or buffer replaced, a second ORTTrainer built over the same module (it makes the module views
  of *its* buffers), or ``requires_grad_`` changed after construction (the trained set is fixed when the
  trainer is built). The trainer would go on training a state the module no longer shows; this raises
  at the next step, naming the tensor and the cause, before anything runs.

Both checks are pointer comparisons: one ``data_ptr()`` per flat buffer and frozen tensor, and one per
tensor of the module (plus its ``requires_grad``); docs/reproducibility.md has the measured cost.
"""

from __future__ import annotations

import itertools
import logging
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ort_trainer.graph import canonical_name

from ._step_session import StepSession

__all__ = ["BindingGuard", "ModuleLinks", "link_module"]

_log = logging.getLogger("ort_trainer")

# module -> the token of the `ModuleLinks` that last made it views of a trainer's buffers (a second trainer
# over the same module takes it over; the first one learns it here)
_OWNER: weakref.WeakKeyDictionary[torch.nn.Module, int] = weakref.WeakKeyDictionary()
_TOKENS = itertools.count(1)


@dataclass
class _Link:
    """One tensor slot of the module (``module._parameters[key]`` or ``module._buffers[key]``) that is shared."""

    slot: dict  # the submodule's _parameters or _buffers
    key: str
    name: str  # the module's own name for it (tied aliases each have an entry)
    state_name: str  # the store's name (`ParamStore.weights`)
    requires_grad: bool | None  # parameters: the flag the trainer was built with; buffers: None


class ModuleLinks:
    """The module's tensors that are views of the store's, and what each must still be at every step."""

    def __init__(self, model: torch.nn.Module, links: list[_Link], device: torch.device):
        self._model, self._device = weakref.ref(model), device
        self._links = links
        self._expected: list[int] = []
        self._dtypes: list[torch.dtype] = []  # the store's dtype of each (float32, or an integer buffer's own)
        self._checks: list[tuple] = []
        self.token = next(_TOKENS)
        _OWNER[model] = self.token

    @property
    def names(self) -> list[str]:
        return [link.name for link in self._links]

    def refresh(self, weights: dict[str, torch.Tensor]) -> None:
        """Record where each shared tensor must point (after construction, and after the storage moved)."""
        self._expected = [weights[link.state_name].data_ptr() for link in self._links]
        self._dtypes = [weights[link.state_name].dtype for link in self._links]
        self._checks = [
            (link.slot, link.key, expected, link.requires_grad)
            for link, expected in zip(self._links, self._expected, strict=True)
        ]

    def check(self) -> None:
        """Raise, naming the tensors and the cause, if the module no longer shows what the trainer trains."""
        for slot, key, expected, requires_grad in self._checks:  # every step: kept to the bare comparisons
            tensor = slot.get(key)
            if (
                tensor is None
                or tensor.data_ptr() != expected
                or (requires_grad is not None and tensor.requires_grad is not requires_grad)
            ):
                raise self._error()

    def _error(self) -> Exception:
        """The first cause that applies, with every tensor it applies to."""
        model = self._model()
        if model is not None and _OWNER.get(model) != self.token:
            return ValueError(
                f"another ORTTrainer was built over this module after this one: the module's parameters "
                f"({_listed(self.names)}) are now views of the other trainer's buffers, and this trainer would train "
                "weights the module no longer shows. Train with the newest trainer, or build the second one with "
                "options={'utils': {'share_module_parameters': False}} to keep both"
            )
        wrong_dtype, moved, replaced, flags = [], [], [], []
        for link, expected, dtype in zip(self._links, self._expected, self._dtypes, strict=True):
            tensor = link.slot.get(link.key)
            if tensor is None:
                replaced.append(f"{link.name} (removed)")
            elif tensor.dtype != dtype:
                wrong_dtype.append(f"{link.name} ({tensor.dtype})")
            elif tensor.device != self._device:
                moved.append(f"{link.name} ({tensor.device})")
            elif tensor.data_ptr() != expected:
                replaced.append(link.name)
            elif link.requires_grad is not None and tensor.requires_grad != link.requires_grad:
                flags.append(f"{link.name} (now {tensor.requires_grad})")
        if wrong_dtype:
            return TypeError(
                f"the module's tensors {_listed(wrong_dtype)} were converted (model.half(), .double(), .to(dtype)) "
                "after the ORTTrainer was built; the trainer trains their float32 values in its own buffers, which "
                "the module showed until then (utils.share_module_parameters). Convert the module before building "
                "the trainer (trainable parameters must be float32; mixed_precision.enabled runs the graph in "
                "float16), or copy the trained weights out with trainer.state_dict(pytorch_format=True)"
            )
        if moved:
            return ValueError(
                f"the module's tensors {_listed(moved)} were moved to another device after the ORTTrainer was built "
                "(the trainer's buffers stay where options.device.id put them, and the module showed them until then: "
                "utils.share_module_parameters); build the trainer with the device you want (options.device.id)"
            )
        if replaced:
            return ValueError(
                f"the module's tensors {_listed(replaced)} are no longer a view of this trainer's buffer "
                "(`p.data = ...`, a parameter or buffer assigned anew, or load_state_dict(assign=True) after the "
                "ORTTrainer was built): the trainer would train values the module no longer shows. Change weights "
                "in place (with torch.no_grad(): p.copy_(value)) or through trainer.load_state_dict(...)"
            )
        return ValueError(
            f"requires_grad of {_listed(flags)} changed after the ORTTrainer was built; the trained parameters are "
            "fixed at construction (the gradient graph and the optimizer's layout are made for them). Set "
            "requires_grad before building the trainer, or freeze with options={'utils': {'frozen_weights': [...]}} "
            "in a new trainer (trainer.state_dict() carries the weights and moments over)"
        )


def _listed(names: list[str]) -> str:
    shown = sorted(names)
    return ", ".join(shown[:8]) + (f" and {len(shown) - 8} more" if len(shown) > 8 else "")


def link_module(model: torch.nn.Module, aliases: dict[str, str], weights: dict[str, torch.Tensor]) -> ModuleLinks:
    """The `ModuleLinks` of a module whose float state `share_module_state` just made views of ``weights``."""
    links = []
    for prefix, sub in model.named_modules(remove_duplicate=False):
        for slot, is_param in ((sub._parameters, True), (sub._buffers, False)):
            for key, tensor in slot.items():
                if tensor is None:
                    continue
                raw = f"{prefix}.{key}" if prefix else key
                state_name = aliases.get(canonical_name(model, raw))
                target = weights.get(state_name) if state_name is not None else None
                if target is None or tensor.data_ptr() != target.data_ptr():
                    continue  # not shared (another dtype or device than the store's)
                links.append(_Link(slot, key, raw, state_name, bool(tensor.requires_grad) if is_param else None))
    device = next(iter(weights.values())).device
    result = ModuleLinks(model, links, device)
    result.refresh(weights)
    return result


class BindingGuard:
    """Per step: follow the store's tensors when their storage moved, then check the module's links."""

    def __init__(self, tensors: Callable[[], list[torch.Tensor]], weights: Callable[[], dict[str, torch.Tensor]]):
        self._tensors = tensors  # the store's bound tensors: padded params, padded grads, frozen state
        self._weights = weights  # the store's float state by name (`ParamStore.weights`)
        self._pointers = [t.data_ptr() for t in tensors()]
        self.links: ModuleLinks | None = None  # set where the module shares the store's tensors

    def check(self, session: StepSession | None) -> None:
        """Before a step: rebind ``session`` (None before the build) if the storage moved; check the module."""
        pointers = [t.data_ptr() for t in self._tensors()]
        if pointers != self._pointers:
            if self.links is not None:
                self.links.refresh(self._weights())
            if session is not None:
                session.rebind_state()
                _log.info("the trainer's buffers moved in memory (share_memory, a multiprocessing queue): rebound")
            self._pointers = pointers
        if self.links is not None:
            self.links.check()
