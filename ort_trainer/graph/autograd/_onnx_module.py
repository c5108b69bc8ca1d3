"""`OnnxModule`: a user-given ``onnx.ModelProto`` (its loss inside) as a torch module, so the autograd engine
trains it like any module: traced under ``torch.autograd.grad``, exported, run in a stock ONNX Runtime session.

Its float initializers are the module's parameters under their ONNX names (``m.fc1.weight`` is the parameter
``weight`` of the submodule ``m.fc1``), so the trainer's state, state dicts and checkpoints carry the ONNX names,
as with the onnxblock engine, and a checkpoint moves between the engines. The parameters are the trainer's own
tensors (views of its flat buffers), not copies. ``forward(**inputs)`` takes the graph's inputs by name (the
``model_desc`` inputs) and returns every graph output by name; the trainer picks the ``model_desc`` outputs.

Each node runs as torch ops (`_onnx_ops.TORCH_OPS`) when it computes on the inputs or the parameters; a node
whose inputs are all known when the graph is traced (constants, integer initializers, shapes: the traced graph is
made for the inputs' shapes) is computed by ONNX's own reference implementation (``onnx.reference``), so shape
arithmetic of any standard op folds into the traced graph. `onnx_model_problems` names every node that has
neither route (an op without a torch translation, another domain's op, control flow), for a refusal at
construction.

Not one package was found to do this: ``onnx2torch`` 1.5.15 (the registry's converter) copies weights into its own
``nn.Linear``/``nn.Conv`` modules (transposed, renamed), has no ``SoftmaxCrossEntropyLoss`` nor training-mode
BatchNorm, and its ``torchvision`` requirement did not import beside torch 2.13+cpu (docs/engines.md).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

import onnx
import torch
from onnx import numpy_helper
from onnx.reference import ReferenceEvaluator

from ._onnx_node import OnnxNode, as_tensor
from ._onnx_ops import TORCH_OPS

__all__ = ["OnnxModule", "onnx_model_problems"]

_DEFAULT_DOMAINS = ("", "ai.onnx")
_SHAPE_OPS = ("Shape", "Size")  # known at trace time whatever their input: the traced graph has fixed shapes
_RANDOM_OPS = frozenset(
    {"Bernoulli", "Multinomial", "RandomNormal", "RandomNormalLike", "RandomUniform", "RandomUniformLike", "Dropout"}
)
_ENGINE_HINT = "train this model with options={'utils': {'engine': 'onnxblock'}} (needs onnxruntime-training)"


def onnx_model_problems(model: onnx.ModelProto, state: Collection[str]) -> list[str]:
    """What keeps the autograd engine from running ``model`` (every offender, sorted); empty when nothing does.

    ``state``: the float initializers the trainer holds (parameters and frozen weights)."""
    by_op: dict[str, list[str]] = {}
    for node, static in _classified(model, state):
        op = node.op_type if node.domain in _DEFAULT_DOMAINS else f"{node.domain}.{node.op_type}"
        subgraph = any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in node.attribute)
        if subgraph or node.domain not in _DEFAULT_DOMAINS or (not static and node.op_type not in TORCH_OPS):
            by_op.setdefault(op, []).append(node.name or "<unnamed>")
    problems = [
        f"{op} (node{'s' if len(names) > 1 else ''} {', '.join(map(repr, names))})"
        for op, names in sorted(by_op.items())
    ]
    if problems:
        problems = [f"ONNX ops without a torch route: {'; '.join(problems)}"]
    problems += _undefined_values(model)
    problems += _path_problems([name for name in _float_initializers(model) if name in state])
    return problems


class OnnxModule(torch.nn.Module):
    """``model`` as a torch module over ``state`` (ONNX initializer name -> the trainer's tensor)."""

    def __init__(self, model: onnx.ModelProto, state: Mapping[str, torch.Tensor], trainable: Collection[str]):
        super().__init__()
        problems = onnx_model_problems(model, state)
        if problems:
            raise ValueError(f"the autograd engine cannot train this ONNX model: {'; '.join(problems)}; {_ENGINE_HINT}")
        opset = _default_opset(model)
        kept = set(state)
        held = {i.name for i in model.graph.initializer}
        self._onnx_inputs = [i.name for i in model.graph.input if i.name not in held]
        self._onnx_outputs = [o.name for o in model.graph.output]
        self._onnx_state = [name for name in _float_initializers(model) if name in kept]
        self._onnx_constants = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer if i.name not in kept}
        self._onnx_nodes = []  # (OnnxNode, its NodeProto when it is computed at trace time, else None)
        for index, (proto, static) in enumerate(_classified(model, kept)):
            computed = static and proto.op_type not in _SHAPE_OPS  # a shape is read off the (fake) tensor
            self._onnx_nodes.append((OnnxNode.from_proto(proto, opset, index), proto if computed else None))
        self._onnx_opset = opset
        for name in self._onnx_state:
            *path, leaf = name.split(".")
            holder = self
            for part in path:
                if not hasattr(holder, part):
                    holder.add_module(part, torch.nn.Module())
                holder = getattr(holder, part)
            holder.register_parameter(leaf, torch.nn.Parameter(state[name], requires_grad=name in trainable))

    def forward(self, **inputs: torch.Tensor) -> dict[str, torch.Tensor]:
        missing = [name for name in self._onnx_inputs if name not in inputs]
        if missing:
            raise ValueError(
                f"the ONNX model's graph inputs {missing} were not given (model_desc inputs: {sorted(inputs)}); "
                "every graph input must be a model_desc input"
            )
        values: dict[str, object] = dict(self._onnx_constants)
        for name in self._onnx_state:  # read through the module: functional_call swaps these for the trainer's
            tensor: object = self
            for part in name.split("."):
                tensor = getattr(tensor, part)
            values[name] = tensor
        values.update(inputs)
        for node, proto in self._onnx_nodes:
            args = [values[name] if name else None for name in node.inputs]
            if proto is not None:
                feeds = {name: value for name, value in zip(node.inputs, args, strict=True) if name}
                results = ReferenceEvaluator(proto, opsets={"": self._onnx_opset}).run(None, feeds)
            else:
                node.training = self.training
                results = TORCH_OPS[node.op_type](node, args)
            for name, value in zip(node.outputs, results, strict=False):
                if name:
                    values[name] = value
        return {name: as_tensor(values[name], list(inputs.values())) for name in self._onnx_outputs}


def _float_initializers(model: onnx.ModelProto) -> list[str]:
    floats = {onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.DOUBLE, onnx.TensorProto.BFLOAT16}
    return [init.name for init in model.graph.initializer if init.data_type in floats]


def _default_opset(model: onnx.ModelProto) -> int:
    return next((o.version for o in model.opset_import if o.domain in _DEFAULT_DOMAINS), onnx.defs.onnx_opset_version())


def _classified(model: onnx.ModelProto, state: Collection[str]) -> list[tuple[onnx.NodeProto, bool]]:
    """Each node with whether it is known at trace time (its inputs are, or it reads only a shape)."""
    held = {i.name for i in model.graph.initializer}
    dynamic = {i.name for i in model.graph.input if i.name not in held} | set(state)
    classified = []
    for node in model.graph.node:
        static = node.op_type in _SHAPE_OPS or (
            node.op_type not in _RANDOM_OPS and not any(name in dynamic for name in node.input if name)
        )
        if not static:
            dynamic.update(node.output)
        classified.append((node, static))
    return classified


def _undefined_values(model: onnx.ModelProto) -> list[str]:
    """Node inputs that nothing defines before the node (the graph must be topologically sorted)."""
    known = {i.name for i in model.graph.input} | {i.name for i in model.graph.initializer}
    undefined = []
    for node in model.graph.node:
        undefined += [f"{name!r} (read by node {node.name!r})" for name in node.input if name and name not in known]
        known.update(node.output)
    undefined += [f"graph output {o.name!r}" for o in model.graph.output if o.name not in known]
    return [f"values not defined before they are read: {', '.join(undefined)}"] if undefined else []


def _path_problems(names: list[str]) -> list[str]:
    """Initializer names that cannot be torch parameter paths (``a.b.c``: submodules ``a``, ``a.b``)."""
    taken = set(dir(OnnxModule)) | set(vars(torch.nn.Module()))
    modules = {name.rsplit(".", 1)[0] for name in names if "." in name}
    modules |= {m.rsplit(".", i)[0] for m in list(modules) for i in range(1, m.count(".") + 1)}
    bad = sorted(
        name
        for name in names
        if "" in name.split(".") or name in modules or any(part in taken for part in name.split("."))
    )
    if not bad:
        return []
    return [
        f"initializer names that cannot be torch parameter names {bad} (an empty part between dots, a name that "
        "is also the prefix of another, or a part that is an attribute of torch.nn.Module): rename them"
    ]
