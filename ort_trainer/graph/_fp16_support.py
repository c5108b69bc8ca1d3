"""Which ops an execution provider really runs in float16 (or bfloat16): asked of ONNX Runtime, never hard-coded.

Two sources, best first:

1. The kernel registry, when the onnxruntime build exposes it
   (``onnxruntime.capi._pybind_state.get_all_opkernel_def``, only in builds with
   ``onnxruntime_PYBIND_EXPORT_OPSCHEMA``): an op is supported when the provider registers a kernel
   for that domain/op/opset whose type constraints include ``tensor(float16)``.
2. Otherwise (the stock onnxruntime-training 1.19.2 wheel exposes neither that nor
   ``get_all_operator_schema``): a probe. For each op we build a one-node model from the op's ONNX
   schema, with every float-capable type parameter bound to float16, and create a session on the
   providers with all graph optimizations off, saving the resolved graph. Session creation alone
   proves nothing: ORT's ``InsertCastTransformer`` silently wraps a CPU node that has only a float32
   kernel in ``Cast`` nodes named ``InsertedPrecisionFreeCast_*`` (and ops defined as ONNX functions,
   Softmax for one, are inlined into their float32 body). So the op counts as supported only if the
   session is created, the node is still there, and no ``InsertedPrecisionFreeCast`` node was added.
   For a non-CPU provider list, ``session.disable_cpu_ep_fallback=1`` additionally makes a node that
   would fall back to the CPU EP fail the probe.

The same questions for bfloat16 (``elem_type=TensorProto.BFLOAT16``: the autograd engine's bf16 autocast) bind
the type parameters to ``tensor(bfloat16)`` instead. Results are cached in-process per (providers, element type,
domain, op, opset). An op that cannot be probed (no ONNX
schema, e.g. ``com.microsoft`` ops without a kernel registry; inputs that are not plain tensors) is
reported unsupported: a wrong "no" only costs speed, a wrong "yes" would make the graph fail or run
through hidden casts. ``fp16_support_reasons`` says why each answer was given.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable, Sequence

import onnx
import onnxruntime as ort
from onnx import TensorProto, helper

from ort_trainer.runtime import quiet_native_info_logs

__all__ = [
    "OpKey",
    "fp16_support_reasons",
    "fp16_type_params",
    "model_op_types",
    "probe_model",
    "provider_fp16_support",
    "provider_low_precision_support",
    "schema_for",
]

OpKey = tuple[str, str, int]  # (domain, op_type, opset)

_FP16 = "tensor(float16)"
_TYPE_STRS = {TensorProto.FLOAT16: _FP16, TensorProto.BFLOAT16: "tensor(bfloat16)"}
_OPTIONAL = onnx.defs.OpSchema.FormalParameterOption.Optional
# Not kernels: ORT turns these into initializers / graph structure before partitioning.
_ALWAYS_SUPPORTED = {("", "Constant")}
# Type preference for type parameters that cannot be float16 in the probe.
_FALLBACK_TYPES = ("tensor(int64)", "tensor(float)", "tensor(bool)", "tensor(int32)")
# Required attributes whose generic default (0, [], 1.0, "") would not make a valid node.
_PROBE_ATTRIBUTES: dict[str, dict] = {
    "Cast": {"to": TensorProto.FLOAT16},
    "Concat": {"axis": 0},
    "ConcatFromSequence": {"axis": 0},
    "EyeLike": {"dtype": TensorProto.FLOAT16},
    "RandomNormal": {"shape": [2], "dtype": TensorProto.FLOAT16},
    "RandomUniform": {"shape": [2], "dtype": TensorProto.FLOAT16},
    "RandomNormalLike": {"dtype": TensorProto.FLOAT16},
    "RandomUniformLike": {"dtype": TensorProto.FLOAT16},
    "Bernoulli": {"dtype": TensorProto.FLOAT16},
    "AveragePool": {"kernel_shape": [1, 1]},
    "MaxPool": {"kernel_shape": [1, 1]},
    "LpPool": {"kernel_shape": [1, 1]},
    "MaxRoiPool": {"pooled_shape": [1, 1]},
    "Einsum": {"equation": "ij,jk->ik"},
    "RNN": {"hidden_size": 1},
    "GRU": {"hidden_size": 1},
    "LSTM": {"hidden_size": 1},
    "Scan": None,  # subgraph ops: not probed
    "Loop": None,
    "If": None,
}

_cache: dict[tuple, tuple[bool, str]] = {}


def provider_fp16_support(providers: Sequence, op_types: Iterable[OpKey]) -> dict[tuple[str, str], bool]:
    """``{(domain, op_type): True}`` for every op the first provider runs with float16 kernels.

    ``providers`` is an ORT providers list (names or ``(name, options)`` pairs), as passed to
    ``InferenceSession``; ``op_types`` holds ``(domain, op_type, opset)`` triples (see
    `model_op_types`). ``"ai.onnx"`` is read as the default domain ``""``.
    """
    return provider_low_precision_support(providers, op_types, TensorProto.FLOAT16)


def provider_low_precision_support(
    providers: Sequence, op_types: Iterable[OpKey], elem_type: int
) -> dict[tuple[str, str], bool]:
    """`provider_fp16_support` for ``elem_type`` (``TensorProto.FLOAT16`` or ``TensorProto.BFLOAT16``)."""
    key = _providers_key(providers)
    return {(_domain(d), op): _lookup(key, providers, _domain(d), op, int(v), elem_type)[0] for d, op, v in op_types}


def fp16_support_reasons(
    providers: Sequence, op_types: Iterable[OpKey], elem_type: int = TensorProto.FLOAT16
) -> dict[tuple[str, str], str]:
    """Why each op was judged (un)supported: for logs and for debugging a surprising answer."""
    key = _providers_key(providers)
    return {(_domain(d), op): _lookup(key, providers, _domain(d), op, int(v), elem_type)[1] for d, op, v in op_types}


def model_op_types(model: onnx.ModelProto) -> set[OpKey]:
    """The ``(domain, op_type, opset)`` triples used by the main graph of ``model``."""
    opsets = {_domain(o.domain): o.version for o in model.opset_import}
    return {(_domain(n.domain), n.op_type, opsets.get(_domain(n.domain), 1)) for n in model.graph.node}


def schema_for(domain: str, op_type: str, opset: int) -> onnx.defs.OpSchema | None:
    """The ONNX schema of an op at an opset, or None when onnx does not know it (contrib ops)."""
    try:
        return onnx.defs.get_schema(op_type, opset, _domain(domain))
    except onnx.defs.SchemaError:
        return None


def _domain(domain: str) -> str:
    return "" if domain in ("", "ai.onnx") else domain


def _providers_key(providers: Sequence) -> tuple:
    key = []
    for entry in providers:
        if isinstance(entry, str):
            key.append((entry, ()))
        else:
            name, options = entry
            key.append((name, tuple(sorted((str(k), str(v)) for k, v in dict(options).items()))))
    return tuple(key)


def _provider_name(providers: Sequence) -> str:
    first = providers[0]
    return first if isinstance(first, str) else first[0]


def _lookup(
    key: tuple, providers: Sequence, domain: str, op_type: str, opset: int, elem_type: int = TensorProto.FLOAT16
) -> tuple[bool, str]:
    if elem_type not in _TYPE_STRS:
        raise ValueError(f"elem_type must be TensorProto.FLOAT16 or TensorProto.BFLOAT16, got {elem_type}")
    cache_key = (key, elem_type, domain, op_type, opset)
    if cache_key not in _cache:
        _cache[cache_key] = _decide(providers, domain, op_type, opset, elem_type)
    return _cache[cache_key]


def _decide(providers: Sequence, domain: str, op_type: str, opset: int, elem_type: int) -> tuple[bool, str]:
    if (domain, op_type) in _ALWAYS_SUPPORTED:
        return True, "not a kernel: constant data / graph plumbing"
    registry = _kernel_registry()
    if registry is not None:
        return _from_registry(registry, _provider_name(providers), domain, op_type, opset, elem_type)
    return _probe(providers, domain, op_type, opset, elem_type)


def _kernel_registry():
    """ORT's kernel definitions if this build exposes them, else None (the stock 1.19.2 wheel)."""
    from onnxruntime.capi import _pybind_state

    getter = getattr(_pybind_state, "get_all_opkernel_def", None)
    if getter is None:
        return None
    try:
        return list(getter())
    except Exception:  # noqa: BLE001 - a broken registry query must not break training; probe instead
        return None


def _from_registry(
    registry, provider: str, domain: str, op_type: str, opset: int, elem_type: int = TensorProto.FLOAT16
) -> tuple[bool, str]:
    """A kernel of ``provider`` covering ``opset`` whose float16-computing type parameters allow ``elem_type``."""
    schema = schema_for(domain, op_type, opset)
    wanted, low = None, _TYPE_STRS[elem_type]
    if schema is not None:
        outputs = [p.type_str for p in schema.outputs if p.option != _OPTIONAL]
        wanted = fp16_type_params(schema, [p.type_str for p in schema.inputs], outputs, type_str=low)
    for kernel in registry:
        if kernel.provider != provider or kernel.op_name != op_type or _domain(kernel.domain) != domain:
            continue
        start, end = kernel.version_range
        constraints = dict(kernel.type_constraints)
        relevant = [constraints[p] for p in wanted if p in constraints] if wanted else list(constraints.values())
        if start <= opset <= end and relevant and all(low in types for types in relevant):
            return True, f"kernel registry: {provider} registers a {low[7:-1]} kernel (opset {start}-{end})"
    return False, f"kernel registry: no {low[7:-1]} kernel for opset {opset} on {provider}"


def _probe(
    providers: Sequence, domain: str, op_type: str, opset: int, elem_type: int = TensorProto.FLOAT16
) -> tuple[bool, str]:
    schema = schema_for(domain, op_type, opset)
    if schema is None:
        return False, "no ONNX schema to build a probe from and no kernel registry in this onnxruntime build"
    try:
        model = probe_model(schema, domain, opset, elem_type)
    except Exception as error:  # noqa: BLE001 - a schema we cannot instantiate: answer "no", say why
        return False, f"not probed: {error}"
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.log_severity_level = 4  # the probe's failures are answers, not errors to print
    if _provider_name(providers) != "CPUExecutionProvider":
        # Only the provider under test, and no silent fallback of the node to the CPU EP.
        options.add_session_config_entry("session.disable_cpu_ep_fallback", "1")
        providers = list(providers[:1])
    with tempfile.TemporaryDirectory() as folder:
        options.optimized_model_filepath = os.path.join(folder, "resolved.onnx")
        try:
            with quiet_native_info_logs():
                ort.InferenceSession(model.SerializeToString(), options, list(providers))
        except Exception as error:  # noqa: BLE001 - any refusal means "not runnable in low precision here"
            return False, f"session creation failed: {str(error).splitlines()[0][:300]}"
        resolved = onnx.load(options.optimized_model_filepath)
    ops = [n.op_type for n in resolved.graph.node]
    kind = _TYPE_STRS[elem_type][7:-1]
    if any(n.name.startswith("InsertedPrecisionFreeCast") for n in resolved.graph.node):
        return False, f"no {kind} kernel: ORT inserted float32 casts around the node"
    if op_type not in ops:
        return False, f"node replaced by {ops} (function body / rewrite), not run as a {kind} kernel"
    return True, f"probe: {kind} node ran as is"


def probe_model(
    schema: onnx.defs.OpSchema, domain: str, opset: int, elem_type: int = TensorProto.FLOAT16
) -> onnx.ModelProto:
    """A one-node model of ``schema`` with every float16-capable type parameter bound to ``elem_type``."""
    attributes = _PROBE_ATTRIBUTES.get(schema.name, {})
    if attributes is None:
        raise ValueError("ops with subgraphs are not probed")
    if elem_type != TensorProto.FLOAT16:  # the attributes that name a dtype name float16
        attributes = {k: elem_type if v == TensorProto.FLOAT16 else v for k, v in attributes.items()}
    low = _TYPE_STRS[elem_type]
    outputs_params = [p for p in schema.outputs if p.option != _OPTIONAL]
    half = fp16_type_params(
        schema,
        [p.type_str for p in schema.inputs],
        [p.type_str for p in outputs_params],
        inputs_too=schema.name in ("Cast", "CastLike"),
        type_str=low,
    )
    if not half:
        raise ValueError(f"the schema allows no {low[7:-1]} tensor")
    types = {}
    for constraint in schema.type_constraints:
        allowed = list(constraint.allowed_type_strs)
        fallback = next((t for t in _FALLBACK_TYPES if t in allowed), allowed[0])
        types[constraint.type_param_str] = low if constraint.type_param_str in half else fallback
    inputs = _probe_values(schema.inputs, types, "x")
    outputs = _probe_values(outputs_params, types, "y")
    node_attributes = {name: _probe_attribute(name, attr) for name, attr in schema.attributes.items() if attr.required}
    node_attributes.update(attributes)
    if schema.name == "ConstantOfShape":
        node_attributes["value"] = helper.make_tensor("value", elem_type, [1], [0.0])
    node = helper.make_node(schema.name, [v.name for v in inputs], [v.name for v in outputs], domain=domain)
    node.attribute.extend(helper.make_attribute(k, v) for k, v in node_attributes.items())
    graph = helper.make_graph([node], "fp16_probe", inputs, outputs)
    imports = [helper.make_opsetid(domain, opset)]
    if domain:
        imports.append(helper.make_opsetid("", 17))
    return helper.make_model(graph, opset_imports=imports)


def fp16_type_params(
    schema: onnx.defs.OpSchema,
    input_params: Sequence[str],
    output_params: Sequence[str],
    *,
    inputs_too: bool = False,
    type_str: str = _FP16,
) -> set:
    """The type parameters a node of ``schema`` computes in when it runs in float16.

    The (float16-capable) parameter typing the first output; for a node whose first output cannot be
    float16 (a sink: Shape, ArgMax, Cast to int, IsNaN...), those typing an input. Parameters typing
    only side inputs/outputs keep their type: Dropout's ``ratio`` (rounding 0.1 would change the op),
    BatchNormalization's scale/bias/mean/var (float32 next to a float16 X, the cuDNN convention; ORT's
    BatchNormInternal rewrite also rejects float16 statistics), LayerNormalization's mean/inv-std.
    ``input_params``/``output_params`` are the type strings of the node's actual inputs/outputs;
    ``inputs_too`` adds the input parameters anyway (Cast: float -> float in float16 is half -> half).
    ``type_str``: the low-precision type asked about (``"tensor(bfloat16)"`` for bf16).
    """
    capable = {c.type_param_str for c in schema.type_constraints if type_str in c.allowed_type_strs}
    first = capable.intersection(output_params[:1])
    if inputs_too or not first:
        return first | capable.intersection(input_params)
    return first


def _probe_values(params, types: dict[str, str], prefix: str) -> list[onnx.ValueInfoProto]:
    values = []
    for index, param in enumerate(params):
        type_str = types.get(param.type_str, param.type_str)
        if not (type_str.startswith("tensor(") and type_str.endswith(")")):
            raise ValueError(f"{param.name} is {type_str}, not a plain tensor")
        try:
            elem = TensorProto.DataType.Value(type_str[7:-1].upper())
        except ValueError:
            raise ValueError(f"{param.name}: unknown element type {type_str}") from None
        count = 2 if param.option == onnx.defs.OpSchema.FormalParameterOption.Variadic and prefix == "x" else 1
        for k in range(count):
            values.append(helper.make_tensor_value_info(f"{prefix}{index}_{k}", elem, None))
    return values


def _probe_attribute(name: str, attr) -> object:
    kinds = onnx.defs.OpSchema.AttrType
    defaults = {
        kinds.INT: 1,
        kinds.FLOAT: 1.0,
        kinds.STRING: "",
        kinds.INTS: [1],
        kinds.FLOATS: [1.0],
        kinds.STRINGS: [""],
        kinds.TENSOR: helper.make_tensor(name, TensorProto.FLOAT16, [1], [0.0]),
    }
    if attr.type not in defaults:
        raise ValueError(f"cannot make a value for required attribute {name} ({attr.type})")
    return defaults[attr.type]
