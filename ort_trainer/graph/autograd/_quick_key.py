"""`quick_fingerprint`: a graph cache pre-key read off the module in milliseconds, without tracing it.

A trace of GPT-2 124M takes about 3 s on one core, as long as a training step, so a resumed job whose
graph is in the cache would still pay a step for the trace that computes the cache key. The pre-key
is what can be read from the module itself: its tree (names, classes, plain attributes, hooks), its
parameters' and buffers' names, shapes and dtypes, the values of the constant buffers that a trace
bakes in, the functions kept in attributes, the source files and package versions of its classes and of
the loss, the inputs' shapes and dtypes, and torch's global dtype.

It only *finds* a candidate graph: the engine runs the first step on it while the real trace is made
beside it (ONNX Runtime releases the GIL while it runs), and keeps the step only if the trace's full
key (`TracedGraph.fingerprint`) names the same graph. An edit the pre-key cannot see (a monkeypatched
helper, a global flag, an attribute of an object a bound method reads) costs a rebuild, never a stale graph.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import os
import sys
import types
from collections.abc import Callable, Mapping, Sequence
from importlib import metadata

import torch

from ort_trainer.config.model_desc import ModelDescription
from ort_trainer.graph._names import outer_module

from ._symbolic import signature_shape

__all__ = ["quick_fingerprint"]

_PLAIN = (bool, int, float, str, type(None))
_FUNCTIONS = (types.FunctionType, types.MethodType, types.BuiltinFunctionType, types.BuiltinMethodType)


def quick_fingerprint(
    model: torch.nn.Module,
    loss_fn: Callable | None,
    desc: ModelDescription,
    trainable: Mapping[str, torch.Tensor],
    frozen: Mapping[str, torch.Tensor],
    inputs: Sequence[torch.Tensor],
    *,
    training: bool,
    dynamic: Mapping[str, Mapping[int, str]] | None = None,
) -> str:
    """sha256 of what can be read off ``model`` (+ ``loss_fn``) and the inputs without tracing them. ``dynamic``:
    the symbolic input dims (`trace_graph`'s), which count by name, not by size."""
    digest = hashlib.sha256(b"quick-v1")
    root = outer_module(model)
    digest.update(repr((training, torch.get_default_dtype(), desc.input_names, desc.output_names)).encode())
    digest.update(repr([(n, _tensor_spec(t)) for n, t in trainable.items()]).encode())
    digest.update(repr([(n, _tensor_spec(t)) for n, t in frozen.items()]).encode())
    axes = dynamic or {}
    specs = [_tensor_spec(t, axes.get(n)) for n, t in zip(desc.input_names, inputs, strict=True)]
    digest.update(repr(specs).encode())
    known = set(trainable) | set(frozen)
    for name, module in root.named_modules(remove_duplicate=False):
        digest.update(_module_text(name, module).encode())
    for name, buffer in root.named_buffers():
        if name not in known:  # a constant input of the graph (position ids, a causal mask): its value counts
            digest.update(name.encode())
            digest.update(buffer.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    config = getattr(root, "config", None)
    if hasattr(config, "to_json_string"):  # a Hugging Face model's whole configuration
        digest.update(config.to_json_string(use_diff=False).encode())
    classes = {cls for m in root.modules() for cls in type(m).__mro__}
    for text in sorted(_code_text(cls) for cls in classes):  # sorted: a set's order differs between processes
        digest.update(text.encode())
    if loss_fn is not None:
        digest.update(_code_text(loss_fn if isinstance(loss_fn, type) else type(loss_fn)).encode())
        target = getattr(loss_fn, "__func__", loss_fn)
        digest.update(_code_text(target).encode())
        if isinstance(loss_fn, torch.nn.Module):
            for name, module in loss_fn.named_modules(remove_duplicate=False):
                digest.update(_module_text("loss." + name, module).encode())
    return digest.hexdigest()


def _tensor_spec(tensor: torch.Tensor, axes: Mapping[int, str] | None = None) -> tuple:
    return signature_shape(tensor.shape, axes), str(tensor.dtype), tensor.device.type, bool(tensor.requires_grad)


def _module_text(name: str, module: torch.nn.Module) -> str:
    """One submodule: its class, plain attributes (sizes, eps, flags, a private scale factor), the functions
    kept in attributes (an activation, a bound ``compute_loss``), hooks, own parameters and buffers."""
    plain = sorted((k, v) for k, v in vars(module).items() if _is_plain(v))
    functions = sorted((k, _function_text(v)) for k, v in vars(module).items() if _is_function(v))
    hooks = [
        [_qualname(hook) for hook in getattr(module, attribute).values()]
        for attribute in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
    ]
    own = [(n, tuple(p.shape), str(p.dtype)) for n, p in module.named_parameters(recurse=False)]
    own += [(n, tuple(b.shape), str(b.dtype)) for n, b in module.named_buffers(recurse=False)]
    return repr((name, _qualname(type(module)), plain, functions, hooks, own))


def _is_plain(value: object) -> bool:
    if isinstance(value, _PLAIN):
        return True
    return isinstance(value, tuple | list) and all(isinstance(v, _PLAIN) for v in value)


def _is_function(value: object) -> bool:
    return isinstance(value, _FUNCTIONS) or (callable(value) and not isinstance(value, type | torch.nn.Module))


def _function_text(function: object) -> str:
    """A function by where it is defined (a bound method: also its object's class, which may override what it
    calls); any other callable object by its class."""
    if not isinstance(function, _FUNCTIONS):
        return _qualname(type(function))
    bound_to = getattr(function, "__self__", None)
    target = getattr(function, "__func__", function)
    code = getattr(target, "__code__", None)
    line = code.co_firstlineno if code is not None else 0  # two lambdas of one file differ by their line
    owner = _qualname(bound_to if isinstance(bound_to, type) else type(bound_to)) if bound_to is not None else ""
    return repr((_code_text(target), line, owner))


def _qualname(obj: object) -> str:
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', type(obj).__qualname__)}"


def _code_text(obj: object) -> str:
    """Where ``obj`` (a class or function) is defined: its name, source file's digest and package version."""
    module_name = getattr(obj, "__module__", None) or ""
    try:
        path = inspect.getsourcefile(obj)  # type: ignore[arg-type]
    except (TypeError, OSError):  # a builtin: its package's version says it all
        path = None
    return repr((_qualname(obj), _file_digest(path) if path else "", _package_version(module_name)))


def _file_digest(path: str) -> str:
    try:
        stat = os.stat(path)
    except OSError:
        return ""
    return _file_digest_cached(path, stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=4096)
def _file_digest_cached(path: str, mtime_ns: int, size: int) -> str:
    try:
        with open(path, "rb") as handle:
            return hashlib.sha256(handle.read()).hexdigest()
    except OSError:
        return ""


@functools.lru_cache(maxsize=1024)
def _package_version(module_name: str) -> str:
    top = module_name.partition(".")[0]
    if not top or top in sys.builtin_module_names:
        return ""
    try:
        return metadata.version(top)
    except metadata.PackageNotFoundError:
        return ""
