"""The exported training graph, made cheaper for ONNX Runtime to hold and run.

PyTorch's decompositions write a gradient that lands on a few rows of a large tensor as a scatter into a
tensor of zeros: ``embedding_dense_backward`` becomes ``ScatterND(Expand(0, [vocab, d]), ids, grads,
reduction="add")``, and ``nll_loss_backward`` a ``ScatterElements`` into zeros the size of the logits.
These passes (and the ORT settings here) are measured on HF GPT-2 124M (batch 2 x 128, 1 thread):

* ORT's ``ConstantFolding`` turns every such ``Expand`` of constants into an initializer that the session
  holds for its whole life: 200 MiB of zeros ([50257, 768], [256, 50257], [1024, 768]). The dynamo
  exporter's own optimizer has already folded every constant under its size limit, so ORT's pass finds
  nothing else to fold in these graphs (the optimized GPT-2 graphs differ by those 5 nodes only):
  `DISABLED_ORT_OPTIMIZERS` leaves it out of every session of this engine.
* A tied weight (GPT-2's ``wte`` is also its LM head) gets ``Add(head_grad, ScatterND(zeros, ...))``: a
  [vocab, d] block of zeros written, copied into the scatter's output and read again by the ``Add``, with
  two such blocks alive at the top of the backward, where the activations peak. `fold_zero_scatter_adds`
  scatters into the head's gradient instead: ``ScatterND(head_grad, ids, grads, reduction="add")``.
  The sum is the same (an embedding row's terms added to the head's, in another order: within an ulp).
* The loss's gradient is a one-hot scatter into zeros, scaled, summed per row and subtracted from:
  `fold_one_hot_loss_gradients` writes it as one scatter-add into ``-exp(log_softmax) * u``, bit-equal, without
  three [tokens, vocab] tensors.
* The exporter's optimizer runs without its pattern rewriter (`_to_onnx`); `collapse_layout_chains` does what
  its rules did to these graphs.
"""

from __future__ import annotations

import math

import onnx
from onnx import numpy_helper

__all__ = [
    "DISABLED_ORT_OPTIMIZERS",
    "collapse_layout_chains",
    "drop_unread_initializers",
    "fold_one_hot_loss_gradients",
    "fold_zero_scatter_adds",
]

DISABLED_ORT_OPTIMIZERS = ("ConstantFolding",)  # InferenceSession(..., disabled_optimizers=...)


def fold_zero_scatter_adds(model: onnx.ModelProto) -> int:
    """``Add(x, ScatterND(zeros, i, u, reduction="add"))`` -> ``ScatterND(x, i, u, reduction="add")`` where ``x``
    has the zeros' shape and dtype, in place; returns how many were rewritten.

    ``zeros`` is ``Expand`` of a zero scalar to a constant shape, or (under the exporter's folding size limit)
    an all-zeros initializer. An ``Expand`` nothing reads any more is removed (an initializer, by
    `drop_unread_initializers`)."""
    graph = model.graph
    producers = {out: node for node in graph.node for out in node.output}
    readers: dict[str, int] = {}
    for node in graph.node:
        for name in node.input:
            readers[name] = readers.get(name, 0) + 1
    for out in graph.output:
        readers[out.name] = readers.get(out.name, 0) + 1
    constants = {init.name: init for init in graph.initializer}
    shapes = _static_shapes(model)
    dropped: set[int] = set()
    count = 0
    for add in graph.node:
        if add.op_type != "Add" or add.domain not in ("", "ai.onnx") or len(add.input) != 2:
            continue
        for scattered, other in ((add.input[1], add.input[0]), (add.input[0], add.input[1])):
            scatter = producers.get(scattered)
            if not _is_scatter_add(scatter) or readers.get(scattered) != 1:
                continue
            zeros = scatter.input[0]
            if shapes.get(other) is None or shapes.get(other) != _zeros_shape(zeros, producers, constants):
                continue
            scatter.input[0] = other
            scatter.output[0] = add.output[0]
            dropped.add(id(add))
            readers[zeros] -= 1
            if readers[zeros] == 0 and zeros in producers:
                dropped.add(id(producers[zeros]))
            count += 1
            break
    if dropped:
        kept = [node for node in graph.node if id(node) not in dropped]
        del graph.node[:]
        graph.node.extend(kept)
    return count


def _is_scatter_add(node: onnx.NodeProto | None) -> bool:
    if node is None or node.op_type != "ScatterND" or node.domain not in ("", "ai.onnx"):
        return False
    return next((a.s for a in node.attribute if a.name == "reduction"), b"none") == b"add"


def _zeros_shape(
    name: str, producers: dict, constants: dict, shapes: dict | None = None
) -> tuple[tuple[int | str, ...], int] | None:
    """(shape, element type) of ``name`` where it is a tensor of zeros, else None: a constant, or a zero scalar
    expanded to a constant shape or (with ``shapes``, `_known_shapes`) to ``Shape(x)``, the shape of ``x``."""
    if name in constants:
        init = constants[name]
        return None if numpy_helper.to_array(init).any() else (tuple(init.dims), init.data_type)
    expand = producers.get(name)
    if expand is None or expand.op_type != "Expand" or expand.domain not in ("", "ai.onnx"):
        return None
    fill = constants.get(expand.input[0])
    target = _int_values(constants.get(expand.input[1]))
    if target is None and shapes is not None:
        of = _whole_shape_of(producers.get(expand.input[1]))
        target = list(shapes[of][0]) if of in shapes else None
    if fill is None or target is None or len(fill.dims) > len(target):  # a fill of higher rank broadcasts further
        return None
    value = numpy_helper.to_array(fill)
    if value.size != 1 or value.any():
        return None
    return tuple(target), fill.data_type


def _whole_shape_of(node: onnx.NodeProto | None) -> str | None:
    """``x`` where ``node`` is ``Shape(x)`` of every dim (no start or end), else None."""
    if node is None or node.op_type != "Shape" or node.domain not in ("", "ai.onnx"):
        return None
    attrs = {a.name: a.i for a in node.attribute}
    return node.input[0] if attrs.get("start", 0) == 0 and "end" not in attrs else None


def _int_values(tensor: onnx.TensorProto | None) -> list[int] | None:
    if tensor is None or tensor.data_type not in (onnx.TensorProto.INT64, onnx.TensorProto.INT32):
        return None
    return [int(v) for v in numpy_helper.to_array(tensor).reshape(-1)]


def _known_shapes(model: onnx.ModelProto) -> dict[str, tuple[tuple[int | str, ...], int]]:
    """(shape, element type) of every value whose every dim the exporter annotated, a symbolic dim as its
    expression (the exporter writes one expression for one size: ``s35*(s38 - 1)``), and of each
    ``ConstantOfShape(Shape(x))``: ``x``'s shape. What the rewrites of a symbolic graph compare shapes with."""
    found = _annotated_shapes(model)
    graph = model.graph
    producers = {out: node for node in graph.node for out in node.output}
    for node in graph.node:
        if node.op_type == "ConstantOfShape" and node.domain in ("", "ai.onnx"):
            of = _whole_shape_of(producers.get(node.input[0]))
            value = next((a.t for a in node.attribute if a.name == "value"), None)
            if of in found and value is not None:
                found[node.output[0]] = (found[of][0], value.data_type)
    return found


def _static_shapes(model: onnx.ModelProto) -> dict[str, tuple[tuple[int, ...], int]]:
    """(static shape, element type) of every value the exporter annotated with a fully known shape."""
    return {
        name: (dims, elem)
        for name, (dims, elem) in _annotated_shapes(model).items()
        if all(isinstance(d, int) for d in dims)
    }


def _annotated_shapes(model: onnx.ModelProto) -> dict[str, tuple[tuple[int | str, ...], int]]:
    """(shape, element type) of every value whose every dim the exporter annotated: a size, or a symbolic dim's
    expression."""
    found = {}
    for info in (*model.graph.value_info, *model.graph.output, *model.graph.input):
        tensor = info.type.tensor_type
        if not tensor.HasField("shape"):
            continue
        dims = tensor.shape.dim
        if all(d.HasField("dim_value") or d.HasField("dim_param") for d in dims):
            found[info.name] = (
                tuple(d.dim_value if d.HasField("dim_value") else d.dim_param for d in dims),
                tensor.elem_type,
            )
    return found


def collapse_layout_chains(model: onnx.ModelProto) -> int:
    """``Transpose(Transpose(x))`` -> one ``Transpose`` of ``x`` (none where the permutations cancel),
    ``Reshape(Reshape(x, a), b)`` -> ``Reshape(x, b)``, and a ``Reshape`` to the shape ``x`` has or a ``Slice`` of
    whole dims -> ``x``, in place; returns how many nodes were bypassed.

    The decomposed backward transposes back what the forward transposed, and views what it viewed. These are
    the rules of onnxscript's rewriter that change our graphs (the others find nothing in them); its
    pattern matcher takes 15-19 s over GPT-2 124M's training graph, this single walk well under one.
    A no-op ``Reshape`` left in place hides a ``Transpose`` + ``MatMul`` from ONNX Runtime's
    ``MatmulTransposeFusion`` (measured: the [vocab, d] gradient of GPT-2's head then gets its own transpose).
    Repeated until nothing changes: a chain collapsed may leave a no-op.
    """
    total = 0
    while count := _collapse_once(model):
        total += count
    return total


def _collapse_once(model: onnx.ModelProto) -> int:
    graph = model.graph
    producers = {out: node for node in graph.node for out in node.output}
    constants = {init.name: init for init in graph.initializer}
    outputs = {out.name for out in graph.output}
    shapes = _static_shapes(model)
    renamed: dict[str, str] = {}  # a bypassed no-op's output -> its input
    count = 0
    for node in graph.node:
        for i, name in enumerate(node.input):
            if name in renamed:
                node.input[i] = renamed[name]
        if node.domain not in ("", "ai.onnx") or not node.input:
            continue
        inner = producers.get(node.input[0])
        if _is_no_op(node, shapes, constants):
            if node.output[0] not in outputs:
                renamed[node.output[0]] = node.input[0]
            else:  # a graph output keeps its name: an Identity, which ONNX Runtime runs as an alias
                node.CopyFrom(onnx.helper.make_node("Identity", [node.input[0]], [node.output[0]], name=node.name))
            count += 1
            continue
        if inner is None or inner.op_type != node.op_type or inner.domain not in ("", "ai.onnx"):
            continue
        if node.op_type == "Transpose":
            outer, first = _perm(node), _perm(inner)
            if outer is None or first is None:
                continue
            composed = [first[axis] for axis in outer]
            node.input[0] = inner.input[0]
            del node.attribute[:]
            node.attribute.append(onnx.helper.make_attribute("perm", composed))
            if _is_identity(composed) and node.output[0] not in outputs:
                renamed[node.output[0]] = node.input[0]
            count += 1
        elif node.op_type == "Reshape":
            allow_zero = next((a.i for a in node.attribute if a.name == "allowzero"), 0)
            if len(node.input) < 2 or not _sets_every_dim(node.input[1], constants, producers, allow_zero):
                continue
            node.input[0] = inner.input[0]
            count += 1
    if count:
        _drop_unread(graph, ("Transpose", "Reshape", "Slice"))
    return count


def _sets_every_dim(target: str, constants: dict, producers: dict, allow_zero: int) -> bool:
    """Whether a ``Reshape`` to ``target`` sets every dim itself (no 0 that copies a dim of its input), so that
    the reshape it reads can be skipped: a constant shape without 0, or, in a graph with symbolic dims, a
    ``Concat`` of such constants and sizes computed at run time (``Shape`` pieces: a batch's sizes, never 0)."""
    shape = _int_values(constants.get(target))
    if shape is not None:
        return allow_zero or 0 not in shape
    concat = producers.get(target)
    if concat is None or concat.op_type != "Concat" or concat.domain not in ("", "ai.onnx"):
        return False
    for piece in concat.input:
        values = _int_values(constants.get(piece))
        if values is not None and 0 in values and not allow_zero:
            return False
    return True


def _is_no_op(node: onnx.NodeProto, shapes: dict, constants: dict) -> bool:
    """An identity ``Transpose``, a ``Slice`` of whole dims, or a ``Reshape`` to the static shape its input already
    has."""
    if node.op_type == "Transpose":
        return _is_identity(_perm(node))
    if node.op_type == "Slice":
        return _is_whole_slice(node, constants)
    if node.op_type != "Reshape" or len(node.input) < 2:
        return False
    given, target = shapes.get(node.input[0]), _int_values(constants.get(node.input[1]))
    if given is None or target is None or len(target) != len(given[0]):
        return False
    allow_zero = next((a.i for a in node.attribute if a.name == "allowzero"), 0)
    dims = list(given[0])
    resolved = [dims[i] if t == 0 and not allow_zero else t for i, t in enumerate(target)]
    if resolved.count(-1) == 1:  # -1 takes what the other dims leave of the element count
        known = math.prod(d for d in resolved if d != -1)
        resolved[resolved.index(-1)] = math.prod(dims) // known if known else -1
    return resolved == dims


def _is_whole_slice(node: onnx.NodeProto, constants: dict) -> bool:
    """A ``Slice`` from 0 to the end (an end of at least 2**62: what ``x[:, ...]`` exports) with step 1 on every
    axis it names: a copy of its input, where PyTorch's ``x[:, :-1]`` slices dim 0 as a view (the dim-0 slice of
    GPT-2 124M's logits, a [4, 128, 50257] copy, was the first of two before its loss)."""
    if len(node.input) < 3:
        return False
    starts, ends = _int_values(constants.get(node.input[1])), _int_values(constants.get(node.input[2]))
    steps = _int_values(constants.get(node.input[4])) if len(node.input) > 4 and node.input[4] else None
    if starts is None or ends is None or (len(node.input) > 4 and node.input[4] and steps is None):
        return False
    return all(v == 0 for v in starts) and all(v >= 2**62 for v in ends) and all(v == 1 for v in steps or [1])


def _perm(node: onnx.NodeProto) -> list[int] | None:
    perm = next((list(a.ints) for a in node.attribute if a.name == "perm"), None)
    return perm  # None: the default reverses the axes, which needs the rank; left alone


def _is_identity(perm: list[int] | None) -> bool:
    return perm is not None and perm == list(range(len(perm)))


def _drop_unread(graph: onnx.GraphProto, op_types: tuple[str, ...]) -> None:
    """Remove nodes of ``op_types`` whose outputs nothing reads (repeatedly: a chain goes as a whole)."""
    while True:
        read = {name for node in graph.node for name in node.input} | {out.name for out in graph.output}
        kept = [n for n in graph.node if n.op_type not in op_types or any(out in read for out in n.output)]
        if len(kept) == len(graph.node):
            return
        del graph.node[:]
        graph.node.extend(kept)


def fold_one_hot_loss_gradients(model: onnx.ModelProto) -> int:
    """The decomposed ``nll_loss`` + ``log_softmax`` backward without its [tokens, classes] one-hot, in place.

    PyTorch's decompositions write the gradient of ``cross_entropy`` with respect to the logits as::

        one_hot = ScatterElements(zeros, target, v, axis=-1)      # v: -1 per row
        g = one_hot * w                                            # w: [tokens, 1], the mean's scale (0 if ignored)
        grad = g - E * ReduceSum(g, axis=-1, keepdims)             # E = exp(log_softmax)

    Each row of ``g`` holds one non-zero, ``u = v * w``, so its sum is ``u`` exactly, and ``grad`` is
    ``-(E * u)`` with ``u`` added at the target: ``ScatterElements(E * -u, target, u, reduction="add")``. The
    values are the same bits (``a - b`` is ``-b + a`` in IEEE arithmetic); the zeros, the one-hot, ``g`` and the
    row sum (three [tokens, classes] tensors at the top of the backward: 150 MiB at GPT-2 124M, batch 2 x 128)
    are not made. Returns how many were rewritten.
    """
    graph = model.graph
    producers = {out: node for node in graph.node for out in node.output}
    readers: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        for name in node.input:
            readers.setdefault(name, []).append(node)
    outputs = {out.name for out in graph.output}
    constants = {init.name: init for init in graph.initializer}
    shapes = _known_shapes(model)  # a symbolic graph's [tokens, classes] has symbolic dims
    dropped: set[int] = set()
    added: list[tuple[onnx.NodeProto, list[onnx.NodeProto]]] = []  # (insert before this node, new nodes)
    count = 0
    for sub in graph.node:
        match = _one_hot_gradient(sub, producers, readers, outputs, constants, shapes)
        if match is None:
            continue
        scatter, g, row_sum, product, w = match
        target, v = scatter.input[1], scatter.input[2]
        u, minus_u = f"{sub.output[0]}__row_value", f"{sub.output[0]}__minus_row_value"
        exp_side = product.input[0] if product.input[1] == row_sum.output[0] else product.input[1]
        added.append(
            (
                product,
                [
                    onnx.helper.make_node("Mul", [v, w], [u], name=f"{sub.name}/row_value"),
                    onnx.helper.make_node("Neg", [u], [minus_u], name=f"{sub.name}/minus_row_value"),
                ],
            )
        )
        product.input[:] = [exp_side, minus_u]
        axis = next(a.i for a in scatter.attribute if a.name == "axis")
        replacement = onnx.helper.make_node(
            "ScatterElements", [product.output[0], target, u], [sub.output[0]], name=sub.name, axis=axis,
            reduction="add",
        )  # fmt: skip
        sub.CopyFrom(replacement)
        for node in (scatter, g, row_sum):
            dropped.add(id(node))
        zeros = producers.get(scatter.input[0])
        if zeros is not None and len(readers.get(scatter.input[0], [])) == 1:
            dropped.add(id(zeros))
        count += 1
    if count:
        before = {id(anchor): nodes for anchor, nodes in added}
        kept = []
        for node in graph.node:
            kept.extend(before.get(id(node), []))
            if id(node) not in dropped:
                kept.append(node)
        del graph.node[:]
        graph.node.extend(kept)
    return count


def _one_hot_gradient(sub, producers, readers, outputs, constants, shapes):
    """(scatter, g, row_sum, product, w) where ``sub`` is ``g - E * ReduceSum(g)`` over a one-hot ``g``, else None."""
    if sub.op_type != "Sub" or sub.domain not in ("", "ai.onnx"):
        return None
    g, product = producers.get(sub.input[0]), producers.get(sub.input[1])
    if g is None or product is None or g.op_type != "Mul" or product.op_type != "Mul":
        return None
    scatter, w = None, None
    for first, second in ((g.input[0], g.input[1]), (g.input[1], g.input[0])):
        if getattr(producers.get(first), "op_type", None) == "ScatterElements":
            scatter, w = producers[first], second
    if scatter is None or len(readers.get(scatter.output[0], [])) != 1:
        return None
    attrs = {a.name: a for a in scatter.attribute}
    full = shapes.get(scatter.output[0])
    reduction = attrs["reduction"].s if "reduction" in attrs else b"none"
    if full is None or len(full[0]) != 2 or reduction != b"none":
        return None
    if "axis" not in attrs or attrs["axis"].i not in (1, -1):
        return None
    if _zeros_shape(scatter.input[0], producers, constants, shapes) != full:
        return None
    column = ((full[0][0], 1), full[1])
    if shapes.get(scatter.input[2]) != column or shapes.get(w) != column:  # one value per row, one scale per row
        return None
    g_readers = readers.get(g.output[0], [])
    if g.output[0] in outputs or sorted(n.op_type for n in g_readers) != ["ReduceSum", "Sub"]:
        return None
    row_sum = next(n for n in g_readers if n.op_type == "ReduceSum")
    axes = _int_values(constants.get(row_sum.input[1])) if len(row_sum.input) > 1 else None
    keepdims = next((a.i for a in row_sum.attribute if a.name == "keepdims"), 1)
    if axes not in ([1], [-1]) or not keepdims or row_sum.input[0] != g.output[0]:
        return None
    if row_sum.output[0] not in product.input or len(readers.get(row_sum.output[0], [])) != 1:
        return None
    if len(readers.get(product.output[0], [])) != 1 or product.output[0] in outputs:
        return None
    return scatter, g, row_sum, product, w


def drop_unread_initializers(model: onnx.ModelProto) -> int:
    """Remove the initializers no node reads any more (the passes above leave shapes of removed ``Expand``s)."""
    graph = model.graph
    read = {name for node in graph.node for name in node.input} | {out.name for out in graph.output}
    kept = [init for init in graph.initializer if init.name in read]
    dropped = len(graph.initializer) - len(kept)
    if dropped:
        del graph.initializer[:]
        graph.initializer.extend(kept)
    return dropped
