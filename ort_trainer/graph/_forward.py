"""How ``model_desc`` inputs reach ``forward()``, and how its results become the graph's outputs.

The legacy ORTTrainer documented that ``model_desc`` input names are the names of ``forward``'s
parameters and bound them by name; we do the same (`bind_forward_inputs`). With a ``loss_fn`` the last
``model_desc`` input is the label, the others go to the model. Positions are used only where names
cannot be matched: ``forward(*args)`` (or positional-only parameters), and a model that takes a single
input (there is no order to mix up: ``nn.Sequential.forward(input)``). A ``forward`` that returns a dict
(e.g. a Hugging Face ``ModelOutput``) has its outputs picked by the ``model_desc`` output names.

The export traces a deep copy of the user's module, so the module is never touched. A module that cannot
be deep-copied (it holds a lock, a file, a generator...) is traced itself, with a warning, and its
train/eval modes and buffers (BatchNorm statistics) are put back afterwards (`module_for_export`).
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch

from ort_trainer.config.model_desc import ModelDescription

__all__ = [
    "ForwardBinding",
    "ModelWithLoss",
    "OutputContractError",
    "OutputContractTypeError",
    "bind_forward_inputs",
    "eval_outputs",
    "model_input_names",
    "module_for_export",
]

_P = inspect.Parameter
_NAMED = (_P.POSITIONAL_OR_KEYWORD, _P.KEYWORD_ONLY)
_LEADING = (_P.POSITIONAL_ONLY, _P.POSITIONAL_OR_KEYWORD, _P.VAR_POSITIONAL)


@dataclass(frozen=True)
class ForwardBinding:
    """How the model's inputs are passed: as the keywords ``keywords``, or positionally when it is None."""

    where: str  # "Model.forward", for messages
    keywords: tuple[str, ...] | None

    def call(self, model: torch.nn.Module, inputs: Sequence[torch.Tensor]):
        if self.keywords is None:
            return model(*inputs)
        return model(**dict(zip(self.keywords, inputs, strict=True)))


def model_input_names(desc: ModelDescription, loss_fn: Callable | None) -> list[str]:
    """The ``model_desc`` inputs that go to ``forward`` (with a ``loss_fn``, the last one is the label)."""
    names = desc.input_names
    return names[:-1] if loss_fn is not None else names


def bind_forward_inputs(model: torch.nn.Module, names: Sequence[str]) -> ForwardBinding:
    """Match ``names`` to the parameters of ``model.forward``; ValueError naming what does not match."""
    where = f"{type(model).__name__}.forward"
    try:
        params = list(inspect.signature(model.forward).parameters.values())
    except (TypeError, ValueError):  # no signature to read (a C extension): positions are all there is
        return ForwardBinding(where, None)
    kinds = {p.kind for p in params}
    named = [p.name for p in params if p.kind in _NAMED]
    unmatched = [n for n in names if n not in named]
    by_position = unmatched and _P.VAR_POSITIONAL in kinds and _P.VAR_KEYWORD not in kinds
    if by_position or _P.POSITIONAL_ONLY in kinds:  # names cannot reach *args or positional-only parameters
        return _positional(where, params, names)
    if unmatched and len(names) == 1 and params and params[0].kind in _LEADING:
        return _single_input(where, params)  # one input has no order to mix up: e.g. nn.Sequential's `input`
    if unmatched and _P.VAR_KEYWORD not in kinds:
        listed = ", ".join(repr(n) for n in unmatched)
        raise ValueError(
            f"model_desc input{'s' if len(unmatched) > 1 else ''} {listed} "
            f"match{'' if len(unmatched) > 1 else 'es'} no parameter of {where}({_signature_text(params)}). "
            "Inputs are passed to forward() by name, as the legacy ORTTrainer did: name each model_desc input "
            "after the forward() parameter it feeds (with loss_fn, the last input is the label)"
        )
    _check_required(where, params, names)
    return ForwardBinding(where, tuple(names))


def _single_input(where: str, params: list[inspect.Parameter]) -> ForwardBinding:
    missing = [p.name for p in params[1:] if p.kind in _NAMED and p.default is p.empty]
    if missing:
        raise ValueError(f"{where}() parameters {missing} have no default and no model_desc input")
    return ForwardBinding(where, None)


def _positional(where: str, params: list[inspect.Parameter], names: Sequence[str]) -> ForwardBinding:
    """Positional binding, allowed only where it gives every named parameter the input of its name."""
    leading = [p for p in params if p.kind in (_P.POSITIONAL_ONLY, _P.POSITIONAL_OR_KEYWORD)]
    if _P.VAR_POSITIONAL not in {p.kind for p in params} and len(names) > len(leading):
        raise ValueError(
            f"{where}({_signature_text(params)}) takes {len(leading)} positional inputs, "
            f"but model_desc gives it {len(names)}: {list(names)}"
        )
    clashes = [
        f"{name!r} would reach parameter {p.name!r}"
        for name, p in zip(names, leading, strict=False)
        if p.kind == _P.POSITIONAL_OR_KEYWORD and name != p.name
    ]
    if clashes:
        raise ValueError(
            f"{where}({_signature_text(params)}) takes positional inputs, and model_desc's order does not "
            f"match its parameter names: {'; '.join(clashes)}. Order the model_desc inputs like forward()'s "
            "parameters"
        )
    missing = [p.name for p in leading[len(names) :] if p.default is p.empty]
    missing += [p.name for p in params if p.kind == _P.KEYWORD_ONLY and p.default is p.empty]
    if missing:
        raise ValueError(f"{where}() parameters {missing} have no default and no model_desc input")
    return ForwardBinding(where, None)


def _check_required(where: str, params: list[inspect.Parameter], names: Sequence[str]) -> None:
    missing = [p.name for p in params if p.kind in _NAMED and p.default is p.empty and p.name not in names]
    if missing:
        listed = ", ".join(repr(n) for n in missing)
        raise ValueError(
            f"{where}() parameter{'s' if len(missing) > 1 else ''} {listed} "
            f"{'have' if len(missing) > 1 else 'has'} no default and no model_desc input of that name "
            f"(the model's model_desc inputs: {list(names)})"
        )


def _signature_text(params: list[inspect.Parameter]) -> str:
    prefix = {_P.VAR_POSITIONAL: "*", _P.VAR_KEYWORD: "**"}
    return ", ".join(prefix.get(p.kind, "") + p.name for p in params)


# ---------------------------------------------------------------------------------------------- outputs
class ModelWithLoss(torch.nn.Module):
    """Returns the model's outputs in ``model_desc`` order, with the loss at its declared place."""

    def __init__(self, model: torch.nn.Module, loss_fn: Callable | None, desc: ModelDescription):
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn
        self._binding = bind_forward_inputs(model, model_input_names(desc, loss_fn))
        self._output_names = desc.output_names
        self._loss_index = desc.loss_index

    def forward(self, *inputs):
        if self.loss_fn is None:
            result = self._binding.call(self.model, inputs)
            if isinstance(result, Mapping):
                result = tuple(_pick(result, self._output_names, self._binding.where))
            if self._loss_index is not None:
                loss = result if isinstance(result, torch.Tensor) else result[self._loss_index]
                _check_loss(loss, f"the loss output {self._output_names[self._loss_index]!r} of {self._binding.where}")
            return result
        preds = self._binding.call(self.model, inputs[:-1])
        loss = self.loss_fn(preds, inputs[-1])
        _check_loss(loss, "loss_fn")
        names = [n for i, n in enumerate(self._output_names) if i != self._loss_index]
        if isinstance(preds, Mapping):
            others = _pick(preds, names, self._binding.where)
        else:
            others = list(preds) if isinstance(preds, tuple | list) else [preds]
        others = others[: len(names)]
        return tuple(others[: self._loss_index] + [loss] + others[self._loss_index :])


class OutputContractError(ValueError):
    """forward() or loss_fn returned something model_desc cannot use (raised while tracing; passed through)."""


class OutputContractTypeError(TypeError):
    """forward() or loss_fn returned a value of the wrong type (raised while tracing; passed through)."""


def _pick(result: Mapping, names: Sequence[str], where: str) -> list:
    missing = [n for n in names if n not in result]
    if missing:
        raise OutputContractError(
            f"{where}() returned a dict without the key(s) {missing} that model_desc['outputs'] names; "
            f"it has {list(result)}"
        )
    return [result[n] for n in names]


def _check_loss(loss, what: str) -> None:
    if not isinstance(loss, torch.Tensor):
        raise OutputContractTypeError(f"{what} must return the loss as a torch.Tensor, got {type(loss).__name__}")
    if loss.numel() != 1:
        raise OutputContractError(
            f"{what} returned a loss of shape {[int(d) for d in loss.shape]}; the loss must be a scalar (one element): "
            "reduce it, e.g. with reduction='mean' or .mean()"
        )


# ---------------------------------------------------------------------------------------------- copies
@contextlib.contextmanager
def module_for_export(model: torch.nn.Module, *, warn: bool = True) -> Iterator[torch.nn.Module]:
    """A deep copy of ``model`` to trace; or ``model`` itself (warned) when it cannot be copied.

    The tracing forward switches modes and, in training mode, moves BatchNorm statistics: when the
    original is used, its modes and buffers are restored on the way out, so the user's module is left
    as it was.
    """
    try:
        copied = copy.deepcopy(model)
    except Exception as error:  # noqa: BLE001 - any failure to copy (locks, files, C handles) means: use the original
        if warn:
            _warn_not_copyable(model, error)
    else:
        yield copied
        return
    modes = [(module, module.training) for module in model.modules()]
    buffers = [(buffer, buffer.detach().clone()) for buffer in model.buffers()]
    try:
        yield model
    finally:
        with torch.no_grad():
            for buffer, saved in buffers:
                buffer.copy_(saved)
        for module, mode in modes:
            module.training = mode


def _warn_not_copyable(model: torch.nn.Module, error: Exception) -> None:
    warnings.warn(
        f"{type(model).__name__} cannot be deep-copied ({type(error).__name__}: {error}); exporting the "
        "original module instead. Its train/eval modes and buffers (e.g. BatchNorm statistics) are "
        "restored after the export.",
        UserWarning,
        stacklevel=5,
    )


def eval_outputs(
    model: torch.nn.Module, loss_fn: Callable | None, desc: ModelDescription, inputs: Sequence[torch.Tensor]
) -> tuple[torch.Tensor, ...]:
    """PyTorch's eval-mode outputs of the model (+ loss) in ``model_desc`` order; ``model`` is left as it was."""
    with module_for_export(model, warn=False) as module:  # the export has warned already
        wrapper = ModelWithLoss(module, loss_fn, desc).eval()
        with torch.no_grad():
            outputs = wrapper(*inputs)
    return tuple(outputs) if isinstance(outputs, tuple | list) else (outputs,)
