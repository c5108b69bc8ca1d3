"""Forward hooks and pre-hooks registered or removed after `ORTModule`'s first call run as in eager PyTorch.

The graph is captured at the first call, hooks included; a hook added or removed later must give another graph
(never the first one, which silently ignores the change). Each test compares the wrapped module's output and
``param.grad`` with a deep copy of the module run in eager PyTorch with the same hooks.
"""

from __future__ import annotations

import copy

import pytest
import torch

from ort_trainer import ORTModule


class _Two(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.first = torch.nn.Linear(6, 5)
        self.second = torch.nn.Linear(5, 3)

    def forward(self, x):
        return self.second(torch.tanh(self.first(x)))


def _forward_hook(module, args, output):
    return output * 2.0 + 1.0


def _pre_hook(module, args):
    return (args[0] * 0.5 - 1.0,)


_HOOKS = {
    "forward-hook-on-the-module": ("", "register_forward_hook", _forward_hook),
    "pre-hook-on-the-module": ("", "register_forward_pre_hook", _pre_hook),
    "forward-hook-on-a-submodule": ("first", "register_forward_hook", _forward_hook),
    "pre-hook-on-a-submodule": ("first", "register_forward_pre_hook", _pre_hook),
}


def _register(module: torch.nn.Module, case: str) -> torch.utils.hooks.RemovableHandle:
    where, method, hook = _HOOKS[case]
    return getattr(module.get_submodule(where), method)(hook)


def _assert_step_equal(wrapped: ORTModule, reference: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """One forward and backward of each; outputs and gradients equal. Returns the eager output."""
    for module in (wrapped, reference):
        module.zero_grad(set_to_none=True)
    out = wrapped(x)
    expected = reference(x)
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=1e-5)
    out.square().sum().backward()
    expected.square().sum().backward()
    for (name, p), (_, q) in zip(wrapped.module.named_parameters(), reference.named_parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-6, rtol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
    return expected.detach()


@pytest.mark.parametrize("case", list(_HOOKS))
def test_a_hook_registered_after_the_first_call_runs_and_stops_when_removed(case):
    torch.manual_seed(0)
    model = _Two()
    reference = copy.deepcopy(model)
    wrapped = ORTModule(model)
    x = torch.randn(4, 6)
    plain = _assert_step_equal(wrapped, reference, x)
    handles = [_register(model, case), _register(reference, case)]
    hooked = _assert_step_equal(wrapped, reference, x)
    assert not torch.allclose(hooked, plain)  # the hook changes the output: the comparison above means something
    for handle in handles:
        handle.remove()
    torch.testing.assert_close(_assert_step_equal(wrapped, reference, x), plain)


@pytest.mark.parametrize("case", list(_HOOKS))
def test_a_hook_present_at_the_first_call_and_removed_later_no_longer_runs(case):
    torch.manual_seed(0)
    model = _Two()
    reference = copy.deepcopy(model)
    handles = [_register(model, case), _register(reference, case)]
    wrapped = ORTModule(model)
    x = torch.randn(4, 6)
    hooked = _assert_step_equal(wrapped, reference, x)
    for handle in handles:
        handle.remove()
    plain = _assert_step_equal(wrapped, reference, x)
    assert not torch.allclose(hooked, plain)
