"""The autograd engine's ``convolution_backward`` (`graph.autograd._decompositions`): equal to PyTorch's kernel for
grouped, strided, dilated and padded 1-d and 2-d convolutions, and written without the batch size in an attribute
(a graph with a symbolic batch exports: tests/zoo/test_zoo.py at varying shapes)."""

from __future__ import annotations

import pytest
import torch

from ort_trainer.graph.autograd._decompositions import training_decompositions

CASES = [  # (batch, in, out, spatial input, kernel, stride, padding, dilation, groups)
    (3, 4, 6, (9, 8), (3, 3), (1, 1), (1, 1), (1, 1), 1),
    (2, 4, 6, (11, 10), (3, 2), (2, 3), (0, 1), (2, 1), 2),
    (5, 6, 6, (16,), (5,), (2,), (2,), (1,), 6),
    (1, 3, 8, (12, 12), (4, 4), (4, 4), (0, 0), (1, 1), 1),
    (2, 16, 16, (20,), (4,), (1,), (2,), (1,), 4),
]


@pytest.mark.parametrize("case", CASES, ids=[str(i) for i in range(len(CASES))])
def test_the_decomposed_backward_equals_pytorch(case):
    batch, cin, cout, size, kernel, stride, padding, dilation, groups = case
    g = torch.Generator().manual_seed(0)
    x = torch.randn(batch, cin, *size, generator=g, dtype=torch.float64)
    w = torch.randn(cout, cin // groups, *kernel, generator=g, dtype=torch.float64)
    out = torch.ops.aten.convolution.default(x, w, None, list(stride), list(padding), list(dilation), False,
                                             [0] * len(size), groups)  # fmt: skip
    grad = torch.randn(out.shape, generator=g, dtype=torch.float64)
    args = (grad, x, w, [cout], list(stride), list(padding), list(dilation), False, [0] * len(size), groups)
    expected = torch.ops.aten.convolution_backward.default(*args, [True, True, True])
    got = training_decompositions()[torch.ops.aten.convolution_backward.default](*args, [True, True, True])
    for name, a, b in zip(("input", "weight", "bias"), got, expected, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10, msg=name)
