"""``nn.Embedding`` attributes that change the backward but not the forward: torch's gradient, or a clear refusal.

The TorchScript exporter writes ``aten::embedding`` as a plain ``Gather`` and drops ``padding_idx`` (with a
warning that the export silences), so ONNX Runtime trained the padding row, which torch never gives a
gradient *from that lookup*. Each attribute, in the onnxblock engine:

* ``padding_idx=p``: while our export runs, the symbolic writes
  ``Where(ids == p, no_gradient_copy(weight[p]), Gather(weight, ids))`` (`_no_gradient`): the same values,
  and the lookup's gradient at the padding positions is dropped (``Where``'s gradient), as in torch's
  ``embedding_backward``. Other uses of the weight (a tied LM head) still reach row ``p``; zeroing that row
  of the gradient buffer after the run would drop their share too.
* ``sparse=True``: the gradient is dense here; its values are torch's (``weight.grad.to_dense()``).
* ``max_norm``: torch renormalises the looked-up rows of the weight *in place* during forward, a write to
  the parameter that the graph cannot make: refused (`check_embedding_modules`).
* ``scale_grad_by_freq``: the gradient of each row divided by its count in the batch: refused (the module
  before anything is traced; a ``torch.nn.functional.embedding`` call while it is).
"""

from __future__ import annotations

import onnx
import torch
from torch.onnx import symbolic_helper as sh

from .._module_checks import refuse_max_norm
from ._no_gradient import active, no_gradient_copy

__all__ = ["check_embedding_modules", "embedding_symbolic"]


def check_embedding_modules(model: torch.nn.Module) -> None:
    """Refuse the ``nn.Embedding`` attributes whose torch backward (or in-place forward) the graph cannot give."""
    refuse_max_norm(model)
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Embedding):
            continue
        where = f"{name or 'the model'} ({type(module).__name__})"
        if module.scale_grad_by_freq:
            raise ValueError(
                f"{where} has scale_grad_by_freq=True: torch divides each row's gradient by how often the row "
                "occurs in the batch, which ORTTrainer's graph does not do; build the embedding with "
                "scale_grad_by_freq=False"
            )


def embedding_symbolic(torch_symbolic):
    """The ``aten::embedding`` symbolic registered by `_symbolics`: ours during our export, else ``torch_symbolic``."""

    @sh.parse_args("v", "v", "i", "b", "v")
    def embedding(g, weight, indices, padding_idx, scale_grad_by_freq, sparse):
        if not active():
            if torch_symbolic is not None:
                return torch_symbolic(g, weight, indices, padding_idx, scale_grad_by_freq, sparse)
            return g.op("Gather", weight, indices)
        if scale_grad_by_freq:
            raise ValueError(
                "torch.nn.functional.embedding(..., scale_grad_by_freq=True): torch divides each row's gradient "
                "by how often the row occurs in the batch, which ORTTrainer's graph does not do; call it with "
                "scale_grad_by_freq=False"
            )
        looked_up = g.op("Gather", weight, indices)
        if padding_idx < 0:
            return looked_up
        index = g.op("Constant", value_t=torch.tensor(padding_idx, dtype=torch.int64))
        row = no_gradient_copy(g, g.op("Gather", weight, index))
        ids = g.op("Cast", indices, to_i=onnx.TensorProto.INT64)
        padding = g.op("Unsqueeze", g.op("Equal", ids, index), g.op("Constant", value_t=torch.tensor([-1])))
        return g.op("Where", padding, row, looked_up)

    return embedding
