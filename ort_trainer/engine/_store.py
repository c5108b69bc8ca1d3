"""`ParamStore`: the trainer's state, complete from construction on (before any graph exists).

Which parameters are trained, and in which order, is known from the module alone: its parameters
(``named_parameters``, canonical names, tied weights once), minus ``requires_grad=False`` ones and
``options.utils.frozen_weights``, laid out group by group (`optim.FlatLayout`). So the flat parameter
and gradient buffers, the optimizer with its (zero) moments, the ZeRO partition and the frozen state
(frozen weights, float buffers) are all created with the trainer. `state_dict()` and
`load_state_dict()` see the same state before and after the first step, and the engine that
`_build` makes later binds these very buffers (a parameter the graph does not use stays in the
layout and is never updated, like a torch parameter whose ``grad`` stays ``None``).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import onnx
import torch
from onnx import numpy_helper

from ort_trainer.graph import KeyMatcher, canonical_name
from ort_trainer.optim import FlatLayout, FlatOptimizer

from ._bindings import BindingGuard, link_module
from ._distributed import DistributedContext, ShardedOptimizer, ZeroPartition

__all__ = ["ModelState", "ParamStore", "build_store", "model_state", "share_module_state"]

_EXTRA_STATE_SUFFIX = torch.nn.modules.module._EXTRA_STATE_KEY_SUFFIX  # "_extra_state"


@dataclass
class ModelState:
    """What the module holds, under canonical names (captured once, before export can touch it)."""

    parameters: list[str]  # canonical names of distinct parameters, in named_parameters order
    requires_grad: dict[str, bool]
    aliases: dict[str, str]  # every canonical FQN of float state (tied aliases too) -> the name it is stored under
    initial: dict[str, torch.Tensor]  # {canonical FQN: detached copy} of every tensor in state_dict()
    extra_state: dict[str, Any]  # {canonical FQN ending in _extra_state: deep copy of get_extra_state()}
    float_state: list[str] = field(default_factory=list)  # distinct float tensors (params + buffers), in order
    order: list[str] = field(default_factory=list)  # canonical state_dict() keys, in the module's order
    # the module's other buffers (integer, bool, and float ones outside the state dict: non-persistent): every
    # canonical FQN -> the name it is held under (tied aliases too), and the distinct ones (detached, the module's)
    buffer_aliases: dict[str, str] = field(default_factory=dict)
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)


def model_state(model: torch.nn.Module | onnx.ModelProto) -> ModelState:
    """Canonical names and initial values of a torch module's (or an ONNX model's) state."""
    if isinstance(model, onnx.ModelProto):
        return _onnx_state(model)
    owner: dict[int, str] = {}
    parameters, requires_grad, aliases = [], {}, {}
    for raw, tensor in model.named_parameters(remove_duplicate=False):
        name = canonical_name(model, raw)
        first = owner.setdefault(id(tensor), name)
        aliases[name] = first
        if first == name:
            parameters.append(name)
            requires_grad[name] = bool(tensor.requires_grad)
    initial, extra, float_state, order = {}, {}, list(parameters), []
    for raw, value in model.state_dict(keep_vars=True).items():
        name = canonical_name(model, raw)
        order.append(name)
        if name.rsplit(".", 1)[-1] == _EXTRA_STATE_SUFFIX:
            extra[name] = copy.deepcopy(value)
            continue
        initial[name] = value.detach() if value.is_floating_point() else value.detach().clone()  # see _shapes_only
        if value.is_floating_point() and name not in aliases:
            first = owner.setdefault(id(value), name)
            aliases[name] = first
            if first == name:
                float_state.append(name)
    buffer_aliases, buffers = _other_buffers(model, aliases)
    return ModelState(parameters, requires_grad, aliases, initial, extra, float_state, order, buffer_aliases, buffers)


def _other_buffers(
    model: torch.nn.Module, aliases: Mapping[str, str]
) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
    """The buffers that are not float state (``aliases``): integer and bool ones (a step counter,
    ``num_batches_tracked``, position ids) and non-persistent float ones (a temperature, rotary ``inv_freq``).

    They are state all the same: the user may write them between steps and the forward may write them, and the
    graph must read what they hold at each step (`ParamStore.buffers`), not what they held when it was built."""
    owner: dict[int, str] = {}
    buffer_aliases, buffers = {}, {}
    for raw, tensor in model.named_buffers(remove_duplicate=False):
        name = canonical_name(model, raw)
        if tensor is None or name in aliases:
            continue
        first = owner.setdefault(id(tensor), name)
        buffer_aliases[name] = first
        if first == name:
            buffers[name] = tensor.detach()
    return buffer_aliases, buffers


def _onnx_state(model: onnx.ModelProto) -> ModelState:
    from ort_trainer.graph import onnx_model_parameters

    names = onnx_model_parameters(model)
    wanted = set(names)
    initial = {
        i.name: torch.from_numpy(numpy_helper.to_array(i).copy()) for i in model.graph.initializer if i.name in wanted
    }
    # BatchNorm's running mean and variance are state the forward writes, not weights (torch's buffers): frozen
    statistics = {name for node in model.graph.node if node.op_type == "BatchNormalization" for name in node.input[3:5]}
    requires_grad = {name: name not in statistics for name in names}
    return ModelState(names, requires_grad, {n: n for n in names}, initial, {}, list(names), list(names))


@dataclass
class ParamStore:
    """Flat trainable buffers, frozen state and the optimizer; shared with the engine once it is built."""

    state: ModelState
    layout: FlatLayout
    padded_params: torch.Tensor  # ZeRO pads to D*32 (what is all-gathered); else == params
    padded_grads: torch.Tensor
    params: torch.Tensor  # flat fp32 master weights (trainable only)
    grads: torch.Tensor
    param_views: dict[str, torch.Tensor]
    grad_views: dict[str, torch.Tensor]
    frozen: dict[str, torch.Tensor]  # non-trainable float state (frozen weights, buffers), canonical names
    # the module's other buffers (`ModelState.buffers`) on the trainer's device, in their own dtypes: graph inputs
    # bound once like the frozen state, so a write between steps (through the module, whose buffers are views of
    # these with share_module_parameters) is read by the next step; a write by the forward comes back into them
    buffers: dict[str, torch.Tensor]
    optimizer: FlatOptimizer | ShardedOptimizer | None  # set right after allocation (build_store)
    dist: DistributedContext | None = None
    zero: ZeroPartition | None = None
    extra_state: dict[str, Any] = field(default_factory=dict)
    batches_tracked: int = 0  # BatchNorm forward passes in training mode (torch's num_batches_tracked)
    loads_since_check: int = 0  # loads since the ranks last agreed (see _state.rank_agreement)
    diverged: bool = False  # the ranks were found to hold different states; cleared by a load on this rank
    diverged_reason: str = ""  # what the check found (kept until the ranks agree again)
    guard: BindingGuard | None = None  # set by build_store: bindings followed, shared module checked (`_bindings`)

    @property
    def weights(self) -> dict[str, torch.Tensor]:
        """Every float state tensor by its name: trainable views, then frozen state."""
        return {**self.param_views, **self.frozen}

    def count_batch(self) -> None:
        """One BatchNorm forward in training mode by an engine whose graph does not count it (onnxblock): every
        ``num_batches_tracked`` buffer advances, as torch's BatchNorm advances it (a kernel each, no host wait)."""
        self.batches_tracked += 1
        for name, tensor in self.buffers.items():
            if name.rsplit(".", 1)[-1] == "num_batches_tracked":
                tensor.add_(1)

    @property
    def persistent_buffers(self) -> dict[str, torch.Tensor]:
        """The other buffers (`buffers`) that the module's ``state_dict()`` holds, by the store's name: what the
        trainer's own state dict and its checkpoints carry (``model/buffers``). Non-persistent ones (a temperature,
        rotary ``inv_freq``) are not state to save, as in torch."""
        aliases = self.state.buffer_aliases
        names = dict.fromkeys(aliases[fqn] for fqn in self.state.order if fqn in aliases)
        return {name: self.buffers[name] for name in names if name in self.buffers}

    @property
    def module_tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor the module's parameters and buffers can be views of: the float state, then the other
        buffers (`share_module_state`)."""
        return {**self.weights, **self.buffers}

    @property
    def frozen_parameters(self) -> list[str]:
        """Parameters that are not trained (requires_grad=False or options.utils.frozen_weights)."""
        return [n for n in self.state.parameters if n in self.frozen]


# Elements (of float32) between parameter starts in a GPU's flat buffers: 256 bytes, what cuDNN and vectorised
# kernels expect of a tensor (torch's allocator hands out 512-byte aligned blocks). Packed back to back, a
# convolution weight after an odd-sized bias fails in cuDNN (CUDNN_STATUS_BAD_PARAM_MISALIGNED_POINTER, seen on an
# H100 with onnxruntime-gpu 1.31). ZeRO keeps its packed layout: its shards are cut from the flat buffer.
_GPU_ALIGN = 64


def _alignment(device: torch.device, sharded: bool) -> int:
    """Elements between parameter starts in the flat buffers: `_GPU_ALIGN` on a GPU, packed on the CPU."""
    return _GPU_ALIGN if device.type != "cpu" and not sharded else 1


def build_store(
    model: torch.nn.Module | onnx.ModelProto,
    optim_config: Any,
    frozen_weights: Sequence[str],
    device: torch.device,
    dist: DistributedContext | None,
    zero_stage: int,
    share_with: torch.nn.Module | None = None,
) -> ParamStore:
    """Everything `state_dict()` needs, from the module alone; rank 0's values on every rank.

    ``share_with`` (``options.utils.share_module_parameters``): that module's float state becomes views
    of the store's buffers (`share_module_state`) right after the weights are copied in, before the
    gradients and the optimizer state are written: the module's own copy is gone before they take
    memory, so construction peaks at 4x the weights (weights, gradients, two moments), as PyTorch does.
    """
    state = model_state(model)
    frozen_names = _frozen_parameters(state, frozen_weights)
    trainable = [n for n in state.parameters if state.requires_grad[n] and n not in frozen_names]
    if not trainable:
        raise ValueError(_nothing_to_train(state, frozen_weights))
    not_fp32 = sorted(f"{n} ({state.initial[n].dtype})" for n in trainable if state.initial[n].dtype != torch.float32)
    if not_fp32:
        raise TypeError(f"trainable parameters must be float32, got: {not_fp32}")
    optim_config.check_param_names(trainable)
    order = {name: i for i, name in enumerate(trainable)}
    trainable.sort(key=lambda n: (optim_config.group_index(n), order[n]))
    # on a GPU each parameter starts on a 256-byte boundary, as a tensor of its own would (see `_GPU_ALIGN`)
    align = _alignment(device, sharded=dist is not None and zero_stage > 0)
    layout = FlatLayout([(name, tuple(state.initial[name].shape)) for name in trainable], align=align)
    zero = ZeroPartition(layout, dist.world_size, dist.rank) if dist is not None and zero_stage > 0 else None
    store = _allocate(state, layout, zero, device, dist)
    _shapes_only(state, store)
    store.guard = BindingGuard(
        lambda: [store.padded_params, store.padded_grads, *store.frozen.values(), *store.buffers.values()],
        lambda: store.module_tensors,
    )
    if share_with is not None:
        share_module_state(share_with, store)
        store.guard.links = link_module(share_with, {**state.aliases, **state.buffer_aliases}, store.module_tensors)
    store.padded_grads.zero_()  # its pages are touched only now (torch.empty in _allocate)
    if zero is not None:
        store.optimizer = ShardedOptimizer(optim_config, zero, store.padded_params, store.padded_grads)
    else:
        store.optimizer = FlatOptimizer(optim_config, layout, store.params, store.grads)
    return store


def _allocate(state: ModelState, layout: FlatLayout, zero, device: torch.device, dist) -> ParamStore:
    """Flat buffers with the initial values, frozen state, rank 0's values on every rank (no optimizer yet)."""
    allocated = zero.padded if zero is not None else layout.numel
    # written once: each slot by its initial value, the alignment gaps and the ZeRO padding by zeros (filling the
    # whole buffer with zeros first wrote every weight twice: 0.24 s at GPT-2 124M)
    padded_params = torch.empty(allocated, dtype=torch.float32, device=device)
    padded_grads = torch.empty(allocated, dtype=torch.float32, device=device)  # zeroed by build_store
    params, grads = padded_params[: layout.numel], padded_grads[: layout.numel]
    param_views, grad_views = layout.views(params), layout.views(grads)
    written = 0
    for slot in layout.slots:
        padded_params[written : slot.offset].zero_()
        param_views[slot.name].copy_(state.initial[slot.name])
        written = slot.offset + slot.numel
    padded_params[written:].zero_()
    frozen = {
        name: state.initial[name].detach().to(device=device, dtype=torch.float32).clone()
        for name in state.float_state
        if name not in param_views
    }
    buffers = {name: tensor.to(device=device).clone() for name, tensor in state.buffers.items()}
    state.buffers = {}  # the store's copies are the values from here on (the module's may become views of them)
    if dist is not None:  # every rank starts from rank 0's weights
        dist.broadcast_(params)
        for tensor in frozen.values():
            dist.broadcast_(tensor)
    return ParamStore(
        state=state,
        layout=layout,
        padded_params=padded_params,
        padded_grads=padded_grads,
        params=params,
        grads=grads,
        param_views=param_views,
        grad_views=grad_views,
        frozen=frozen,
        buffers=buffers,
        optimizer=None,
        dist=dist,
        zero=zero,
        extra_state=copy.deepcopy(state.extra_state),
    )


def _shapes_only(state: ModelState, store: ParamStore) -> None:
    """Keep only the dtype and shape (a meta tensor) of the float state that the store now holds.

    ``ModelState.initial`` referenced the module's own float tensors until `_allocate` copied them
    into the flat buffers and the frozen state; keeping them (or a clone) would hold a second copy of
    the weights for the whole run. The values are the store's from here on; the state's dtype is what
    `state_dict()` converts back to.
    """
    held = store.weights
    for name, tensor in state.initial.items():
        if tensor.is_floating_point() and state.aliases.get(name) in held:
            state.initial[name] = torch.empty(tensor.shape, dtype=tensor.dtype, device="meta")


def share_module_state(model: torch.nn.Module, store: ParamStore) -> list[str]:
    """Make the module's float parameters and its buffers views of the store's tensors; returns their names.

    ``options.utils.share_module_parameters``: the weights are then held once (the module's own
    storage is released unless the caller holds it elsewhere), and the module shows the trainer's
    current values, as a module trained by a torch optimizer would. Tensors whose dtype or device
    differ from the store's (a float16 buffer, a trainer on another device) keep their own storage.
    """
    held = store.module_tensors
    aliases = {**store.state.aliases, **store.state.buffer_aliases}
    shared = []
    named = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
    with torch.no_grad():
        for raw, tensor in named:
            if tensor is None:
                continue
            name = aliases.get(canonical_name(model, raw))
            target = held.get(name)
            if target is None or _kind(target) != _kind(tensor):
                continue
            if tensor.data_ptr() != target.data_ptr():  # a tied alias is the same tensor: set once
                tensor.data = target
                shared.append(name)
    return shared


def _kind(tensor: torch.Tensor) -> tuple:
    return tensor.dtype, tensor.device, tuple(tensor.shape)


def _nothing_to_train(state: ModelState, frozen_weights: Sequence[str]) -> str:
    """Why no parameter is left to train, in the words that fit this model."""
    if not state.parameters:
        buffers = [n for n in state.float_state if n not in state.requires_grad]
        held = f" (its float state is buffers only: {buffers})" if buffers else ""
        return (
            f"the model has no parameters{held}: there is nothing to train. ORTTrainer needs at least one "
            "floating-point torch.nn.Parameter with requires_grad=True"
        )
    if not frozen_weights:
        return (
            f"none of the model's parameters requires a gradient: {sorted(state.parameters)} all have "
            "requires_grad=False; set requires_grad=True on the parameters to train"
        )
    return (
        "the model has no trainable parameters left after applying options.utils.frozen_weights "
        f"{list(frozen_weights)} (and requires_grad=False) to its parameters {sorted(state.parameters)}"
    )


def _frozen_parameters(state: ModelState, frozen_weights: Sequence[str]) -> set[str]:
    """``options.utils.frozen_weights`` as canonical names (any alias of a tied weight, wrapper prefixes ok)."""
    matched, unknown = KeyMatcher(state.aliases).match(dict.fromkeys(frozen_weights), "options.utils.frozen_weights")
    names = {state.aliases[name] for name in matched.values()}
    not_params = sorted(
        n for n in frozen_weights if n in matched and state.aliases[matched[n]] not in state.requires_grad
    )
    missing = sorted(unknown) + not_params
    if missing:
        raise ValueError(
            f"options.utils.frozen_weights names {missing}, which are not parameters of the model; "
            f"known parameters: {state.parameters}"
        )
    return names


def graph_state_names(store: ParamStore, graph_names: Mapping[str, str]) -> tuple[list[str], list[str]]:
    """(trainable, frozen) names the exported graph uses, in layout order; checks every graph name is known."""
    used = set(graph_names.values())
    unknown = sorted(used - set(store.param_views) - set(store.frozen))
    if unknown:
        raise RuntimeError(f"the exported graph has state tensors the trainer does not know: {unknown}")
    trainable = [n for n in store.layout.names if n in used]
    frozen = [n for n in store.frozen if n in used]
    return trainable, frozen
