"""The exporter symbolics ort_trainer registers give torch's values in ONNX Runtime.

aten::diff, aten::histc, boolean aten::cumsum, aten::group_norm (without InstanceNormalization) and
aten::ctc_loss (unrolled over the frames);
the zoo (tests/zoo) trains the models that need them.
"""

from __future__ import annotations

import io

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from ort_trainer.graph.onnxblock._symbolics import register_symbolics


def _run_exported(module: torch.nn.Module, *inputs: torch.Tensor, opset: int = 17) -> list[np.ndarray]:
    register_symbolics()
    buffer = io.BytesIO()
    torch.onnx.export(module, inputs, buffer, opset_version=opset, dynamo=False)
    model = onnx.load_from_string(buffer.getvalue())
    assert not {n.op_type for n in model.graph.node} & {"InstanceNormalization", "ATen"}
    session = ort.InferenceSession(buffer.getvalue(), providers=["CPUExecutionProvider"])
    names = [i.name for i in session.get_inputs()]
    return session.run(None, {n: t.numpy() for n, t in zip(names, inputs, strict=True)})


class Ops(torch.nn.Module):
    def forward(self, positions, values):
        return (
            torch.diff(positions, prepend=positions[:, :1] - 1, dim=-1),
            torch.diff(values, n=2, dim=0),
            torch.diff(positions > 3, dim=1),  # bool: xor
            (positions != 1).cumsum(-1),
            torch.histc(values, bins=5, min=-1, max=1),  # the top edge counts in the last bin, outside: not
            torch.histc(values, bins=4),  # min == max: the data's range
            torch.histc(torch.full((3,), 2.0), bins=3),  # an empty range widened by 1 each way
        )


@pytest.mark.parametrize("opset", [13, 17, 18])
def test_diff_histc_and_boolean_cumsum_equal_torch(opset):
    positions = torch.tensor([[0, 1, 2, 0, 1, 5], [3, 4, 5, 6, 7, 8]])
    values = torch.tensor([[-2.0, -1.0, -0.3, 0.0], [0.2, 0.99, 1.0, 1.5], [0.5, 0.5, -0.5, 3.0]])
    expected = Ops()(positions, values)
    got = _run_exported(Ops(), positions, values, opset=opset)
    for want, have in zip(expected, got, strict=True):
        assert want.dtype == torch.from_numpy(have).dtype
        assert torch.equal(torch.from_numpy(have), want), (want, have)


@pytest.mark.parametrize("shape", [(2, 6, 5), (2, 6, 3, 4), (3, 6)])
def test_group_norm_equals_torch(shape):
    torch.manual_seed(0)
    norm = torch.nn.GroupNorm(3, 6)
    torch.nn.init.normal_(norm.weight)
    torch.nn.init.normal_(norm.bias)
    x = torch.randn(*shape) * 3 + 1
    got = _run_exported(norm, x)[0]
    torch.testing.assert_close(torch.from_numpy(got), norm(x).detach(), atol=1e-5, rtol=1e-5)


class CTC(torch.nn.Module):
    def __init__(self, reduction: str, zero_infinity: bool):
        super().__init__()
        self.reduction, self.zero_infinity = reduction, zero_infinity

    def forward(self, log_probs, targets, input_lengths, target_lengths):
        return torch.nn.functional.ctc_loss(
            log_probs, targets, input_lengths, target_lengths, blank=0, reduction=self.reduction,
            zero_infinity=self.zero_infinity,
        )  # fmt: skip


@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
@pytest.mark.parametrize("concatenated", [True, False])
def test_ctc_loss_equals_torch(reduction, concatenated):
    g = torch.Generator().manual_seed(0)
    log_probs = torch.randn(12, 4, 6, generator=g).log_softmax(-1)
    target_lengths = torch.tensor([3, 5, 0, 2])
    input_lengths = torch.tensor([12, 10, 7, 11])
    padded = torch.randint(1, 6, (4, 5), generator=g)
    padded[1, 1] = padded[1, 2]  # a repeated label needs a blank between: no skip there
    targets = torch.cat([padded[i, :n] for i, n in enumerate(target_lengths)]) if concatenated else padded
    module = CTC(reduction, zero_infinity=False)
    got = _run_exported(module, log_probs, targets, input_lengths, target_lengths)[0]
    torch.testing.assert_close(torch.from_numpy(got), module(log_probs, targets, input_lengths, target_lengths))


def test_ctc_zero_infinity_zeroes_impossible_alignments():
    log_probs = torch.randn(3, 2, 5, generator=torch.Generator().manual_seed(1)).log_softmax(-1)
    targets, input_lengths, target_lengths = (
        torch.tensor([[1, 1, 1], [2, 3, 0]]),
        torch.tensor([3, 3]),
        torch.tensor([3, 2]),
    )
    module = CTC("none", zero_infinity=True)  # three equal labels need 5 frames: impossible in 3
    got = torch.from_numpy(_run_exported(module, log_probs, targets, input_lengths, target_lengths)[0])
    expected = module(log_probs, targets, input_lengths, target_lengths)
    assert got[0] == 0 == expected[0]
    torch.testing.assert_close(got, expected)
