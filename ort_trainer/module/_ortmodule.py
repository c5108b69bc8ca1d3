"""`ORTModule`: an ``nn.Module`` whose forward and backward run in ONNX Runtime, in the user's own training loop.

``ORTModule(module)`` captures ``module``'s forward with Dynamo as **one** graph (``fullgraph=True``) and
compiles it with the ``"ort_trainer"`` backend (`ort_backend`: AOTAutograd's forward/backward split, each
graph exported to ONNX and run in ONNX Runtime). The parameters stay the user's: gradients arrive in their
``param.grad`` through torch's autograd, so any ``torch.optim`` optimizer, LR scheduler, ``clip_grad_norm_``,
gradient accumulation, ``zero_grad`` and ``DistributedDataParallel`` work unchanged.

Dynamo's guards pick the graph: ``train()``/``eval()`` and ``torch.no_grad()`` (forward-only inference graph) get
their own graphs, and so does each set of forward hooks and pre-hooks on the module and its submodules (a hook
registered or removed after the first call gives a graph with or without it, as in eager PyTorch). Shapes are
Dynamo's: the first call's are static; a dim whose size then changes (or one marked with
``torch._dynamo.mark_dynamic``) becomes symbolic, and that one graph, exported with symbolic dims, runs every
later size (a size of 1, or one that breaks what the code assumed of a size, gets a graph of its own; exports are
kept in the on-disk graph cache). What cannot be one graph (a graph break: Python control flow on tensor values,
``.item()``...) or cannot be exported raises `TraceError` at the first call naming the line or op and the way out;
the module never runs in eager PyTorch behind the user's back (no ``suppress_errors``, no fall-back when Dynamo's
recompile limit is hit).
``state_dict()`` / ``load_state_dict()`` use the wrapped module's own keys.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import re
from collections.abc import Iterator, Mapping
from typing import Any, NoReturn

import torch
from torch._dynamo import exc as dynamo_exc
from torch.utils import _pytree as pytree

from ort_trainer.graph.autograd import TraceError

from ._backend import ort_backend

__all__ = ["ORTModule"]

_PREFIX = "module."
_WAY_OUT = (
    "Compute it with tensor ops (torch.where, masking) instead of Python control flow on tensor values, or use "
    "torch.compile(module, backend='ort_trainer'), which runs the code around a graph break in eager PyTorch "
    "and each captured piece in ONNX Runtime (docs/ortmodule.md)"
)


class ORTModule(torch.nn.Module):
    """``module`` with its forward and backward in ONNX Runtime; otherwise the module itself.

    ``max_graphs``: how many graphs (train/eval x grad/no-grad x static or symbolic shapes x sets of hooks) this
    instance may compile before a call raises instead of compiling another; exports are cached on disk.
    ``dynamic``: ``torch.compile``'s: None (Dynamo's automatic dynamic shapes: the first call's sizes are static, a
    dim becomes symbolic once its size changes, so lengths that vary and then an epoch's smaller last batch give
    three graphs), True (every input dim symbolic from the first call: one graph for every batch and length; a size
    of 1 still gets its own) or False (one graph per shape).
    An input tensor with a size-0 dim (a sequence of length 0) is refused with a ValueError naming it: ONNX Runtime
    does not compute on empty tensors as PyTorch does.
    """

    def __init__(self, module: torch.nn.Module, *, max_graphs: int = 64, dynamic: bool | None = None):
        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"ORTModule wraps a torch.nn.Module, got {type(module).__name__}")
        if isinstance(module, ORTModule):
            raise TypeError("the module is already an ORTModule; wrap the plain module once")
        if int(max_graphs) < 1:
            raise ValueError(f"max_graphs must be >= 1, got {max_graphs}")
        if dynamic not in (None, True, False):
            raise TypeError(f"dynamic must be None, True or False (torch.compile's), got {dynamic!r}")
        super().__init__()
        self.module = module
        self._max_graphs = int(max_graphs)
        # not a submodule: the compiled wrapper holds `module` too, and must not add its keys to ours. Dynamo keeps
        # compiled graphs (and counts them against the limit) per code object, which every instance of a class
        # shares: `isolate_recompiles` gives this instance its own count, so `max_graphs` is this instance's
        compiled = torch.compile(
            module,
            backend=ort_backend,
            fullgraph=True,
            dynamic=dynamic,
            recompile_limit=self._max_graphs,
            isolate_recompiles=True,
        )
        object.__setattr__(self, "_compiled", compiled)
        self._register_load_state_dict_pre_hook(_add_prefix, with_module=True)
        self.register_load_state_dict_post_hook(_strip_incompatible)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The wrapped module's forward, run in ONNX Runtime (compiled on the first call of each signature)."""
        self._refuse_empty(args, kwargs)
        config = {
            "optimize_ddp": False,  # DDP(ORTModule(m)): one forward and one backward graph, not one per bucket
            # Dynamo skips its guards on empty hook dicts by default: a forward hook or pre-hook registered on a
            # submodule after the first call would be silently ignored. Guarded, a hook added (or removed) later
            # makes Dynamo compile the graph again with (without) it, as eager PyTorch runs it
            "skip_nnmodule_hook_guards": False,
            "suppress_errors": False,  # never eager behind the user's back
            "fail_on_recompile_limit_hit": True,
            # log calls in a forward (transformers' warning_once) are no graph break: dropped while tracing
            "ignore_logging_functions": _logging_functions() | torch._dynamo.config.ignore_logging_functions,
        }
        try:
            with torch._dynamo.config.patch(**config), _no_fast_path():
                return self._compiled(*args, **kwargs)
        except TraceError:
            raise
        except dynamo_exc.BackendCompilerFailed as error:
            inner = error.inner_exception
            if isinstance(inner, TraceError):  # its own class: an UnsupportedDtypeError is a TypeError too
                raise type(inner)(str(inner)) from inner
            raise TraceError(
                f"ORTModule could not compile {self._what()}: {type(inner).__name__}: {_first_line(inner)}{_at(inner)}"
            ) from error
        except (dynamo_exc.Unsupported, dynamo_exc.UserError) as error:
            raise TraceError(
                f"ORTModule could not capture {self._what()} as one graph{_at(error)}: {_first_line(error)}. {_WAY_OUT}"
            ) from error
        except dynamo_exc.FailOnRecompileLimitHit as error:
            raise TraceError(
                f"ORTModule compiled {self._max_graphs} graphs for {self._what()} (one per train/eval mode, grad mode, "
                "set of static or symbolic input sizes and set of module hooks) and refuses to compile more: mark the "
                "dims that change with torch._dynamo.mark_dynamic, or raise ORTModule(module, max_graphs=...)"
            ) from error

    # ---------------------------------------------------------------- the module's own state dict
    def state_dict(self, *args: Any, destination: Any = None, prefix: str = "", keep_vars: bool = False) -> Any:
        """The wrapped module's ``state_dict``: the same keys (also under DDP, which calls this with a prefix)."""
        if args:  # torch's deprecated positional form: (destination, prefix, keep_vars)
            destination, prefix, keep_vars = (*args, *(destination, prefix, keep_vars)[len(args) :])
        return self.module.state_dict(destination=destination, prefix=prefix, keep_vars=keep_vars)

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False) -> Any:
        """The wrapped module's ``load_state_dict``: its own keys, its own checks."""
        return self.module.load_state_dict(state_dict, strict=strict, assign=assign)

    def _what(self) -> str:
        return f"{type(self.module).__name__}.forward"

    def _refuse_empty(self, args: tuple, kwargs: dict[str, Any]) -> None:
        """A ValueError naming the first input tensor with a size-0 dim (a sequence of length 0, an empty batch).

        ONNX Runtime does not compute on empty tensors as PyTorch does (a mean over no elements is 0 there, NaN in
        PyTorch; the backward of some views fails): such a call would return other numbers than eager, or a raw
        ONNX Runtime error, so it is refused before Dynamo sees it."""
        for position, value in (*enumerate(args), *kwargs.items()):
            if isinstance(value, torch.Tensor):
                if value.numel() == 0:
                    self._raise_empty(position, "", value)
            elif isinstance(value, list | tuple | dict):
                for path, leaf in pytree.tree_flatten_with_path(value)[0]:
                    if isinstance(leaf, torch.Tensor) and leaf.numel() == 0:
                        self._raise_empty(position, pytree.keystr(path), leaf)

    def _raise_empty(self, position: int | str, path: str, tensor: torch.Tensor) -> NoReturn:
        name = position if isinstance(position, str) else _parameter_name(self.module.forward, position)
        dim = list(tensor.shape).index(0)
        raise ValueError(
            f"{self._what()} input `{name}{path}` has shape {tuple(tensor.shape)} (size 0 in dim {dim}): ORTModule "
            "refuses empty tensors, which ONNX Runtime does not compute on as PyTorch does (a mean over no elements "
            "is 0 there and NaN in PyTorch). Skip empty batches and sequences of length 0 before the call"
        )


@contextlib.contextmanager
def _no_fast_path() -> Iterator[None]:
    """``nn.TransformerEncoderLayer`` / ``MultiheadAttention`` without their inference fast path (a fused kernel,
    ``_transformer_encoder_layer_fwd``, that has no ONNX translation): the same math as ordinary ops."""
    enabled = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        yield
    finally:
        torch.backends.mha.set_fastpath_enabled(enabled)


@functools.cache
def _logging_functions() -> frozenset:
    methods = ("debug", "info", "warning", "warn", "error", "warning_once", "info_once", "warning_advice")
    found = {getattr(logging.Logger, m) for m in methods if hasattr(logging.Logger, m)}
    return frozenset(found)


def _add_prefix(module: ORTModule, state_dict, prefix, local_metadata, strict, missing, unexpected, errors) -> None:
    """Loading through a parent (``DDP(ORTModule(m)).load_state_dict``): the keys are the module's own, under
    ``prefix``; torch's recursion looks for them under ``prefix + "module."``."""
    module._load_prefix = prefix
    inner = prefix + _PREFIX
    for key in [k for k in state_dict if k.startswith(prefix) and not k.startswith(inner)]:
        state_dict[inner + key[len(prefix) :]] = state_dict.pop(key)
    metadata = getattr(state_dict, "_metadata", None)
    if metadata is not None:
        for key in [k for k in metadata if k.startswith(prefix) and not k.startswith(inner)]:
            metadata[inner + key[len(prefix) :]] = metadata[key]
        if prefix[:-1] in metadata or prefix == "":
            metadata.setdefault(inner[:-1], metadata.get(prefix[:-1], {}))


def _strip_incompatible(module: ORTModule, incompatible) -> None:
    """Missing/unexpected keys reported as the module's own keys (without ``module.``)."""
    prefix = getattr(module, "_load_prefix", "")
    inner = prefix + _PREFIX
    for keys in (incompatible.missing_keys, incompatible.unexpected_keys):
        keys[:] = [prefix + k[len(inner) :] if k.startswith(inner) else k for k in keys]


def _parameter_name(forward: Any, position: int) -> str:
    """The name of ``forward``'s parameter at ``position`` (``args[i]`` past a ``*args``, or when unknown)."""
    try:
        parameters = list(inspect.signature(forward).parameters.values())
    except (TypeError, ValueError):  # a builtin or C forward without a signature
        return f"args[{position}]"
    for index, parameter in enumerate(parameters):
        if parameter.kind is inspect.Parameter.VAR_POSITIONAL:
            return f"{parameter.name}[{position - index}]"
        if index == position and parameter.kind is not inspect.Parameter.KEYWORD_ONLY:
            return parameter.name
    return f"args[{position}]"


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def _at(error: BaseException) -> str:
    """`` at file:line (code)``: the innermost frame of the user's code in a Dynamo error, if any."""
    stack = getattr(error, "real_stack", None)
    frames = [f for f in (stack or []) if "/torch/" not in f.filename]
    if frames:
        frame = frames[-1]
        return f" at {frame.filename}:{frame.lineno} ({(frame.line or '').strip()})"
    found = re.findall(r'File "([^"]+)", line (\d+)', str(error))
    found = [f for f in found if "/torch/" not in f[0]]
    return f" at {found[-1][0]}:{found[-1][1]}" if found else ""
