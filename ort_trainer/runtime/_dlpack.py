"""Torch tensors as ONNX Runtime ``OrtValue``s and back, zero-copy (DLPack), on every runtime we support.

Every step binds its inputs this way, so the call must be cheap and must not break when ONNX Runtime ships.
Two routes, chosen once by the installed runtime's version (`DLPACK_ROUTE`):

* ``"public"`` (onnxruntime >= 1.32): the public ``onnxruntime.OrtValue.from_dlpack``, given torch's DLPack
  capsule (~2 us; handing it the tensor costs ~8 us, torch's ``__dlpack__``). 1.32 reads DLPack's bool code
  itself and dropped the private two-argument call below (``from_dlpack(): incompatible function arguments``).
* ``"legacy"`` (onnxruntime-training 1.19.2, stock 1.20-1.31, GPU builds of those): the private
  ``OrtValue.from_dlpack(capsule, is_bool_tensor)``. Those runtimes refuse DLPack's bool code ("Unsupported code
  6", the public call included), so a bool tensor goes over as its uint8 view, flagged as bool.

CI runs both routes: ``make test`` and ``make test-onnxblock`` the legacy one (1.31.1, 1.19.2), ``make
test-latest`` the public one (the newest release the declared range admits); tests/engine/test_dlpack.py checks
that the route matches the runtime and that every dtype round-trips without a copy.
"""

from __future__ import annotations

import re

import onnxruntime as ort
import torch
from torch.utils.dlpack import from_dlpack, to_dlpack

__all__ = ["DLPACK_ROUTE", "PUBLIC_DLPACK_SINCE", "dlpack_route", "from_ortvalue", "to_ortvalue"]

PUBLIC_DLPACK_SINCE = (1, 32)  # the first onnxruntime whose OrtValue.from_dlpack takes one object and reads bool


def dlpack_route(version: str) -> str:
    """``"public"`` or ``"legacy"``: the route for an onnxruntime ``version`` string ("1.32.0", "1.33.0.dev...")."""
    found = re.match(r"(\d+)\.(\d+)", version)
    if found is None:
        raise ValueError(f"onnxruntime version {version!r} is not of the form MAJOR.MINOR[...]")
    return "public" if (int(found[1]), int(found[2])) >= PUBLIC_DLPACK_SINCE else "legacy"


DLPACK_ROUTE = dlpack_route(ort.__version__)

if DLPACK_ROUTE == "legacy":  # the private call, only where the installed runtime still has it (module docstring)
    from onnxruntime.capi import _pybind_state as _C

    def to_ortvalue(tensor: torch.Tensor) -> ort.OrtValue:
        """Zero-copy OrtValue over a contiguous torch tensor. The caller keeps ``tensor`` alive."""
        if tensor.dtype == torch.bool:
            return ort.OrtValue(_C.OrtValue.from_dlpack(to_dlpack(tensor.view(torch.uint8)), True))
        return ort.OrtValue(_C.OrtValue.from_dlpack(to_dlpack(tensor), False))

else:

    def to_ortvalue(tensor: torch.Tensor) -> ort.OrtValue:
        """Zero-copy OrtValue over a contiguous torch tensor. The caller keeps ``tensor`` alive."""
        return ort.OrtValue.from_dlpack(to_dlpack(tensor))


def from_ortvalue(value) -> torch.Tensor:
    """A tensor ONNX Runtime allocated (an ``IOBinding``'s output), as a torch tensor, zero-copy: its memory goes
    back to ORT's allocator when torch frees the tensor. Runtimes before 1.32 give a bool output as uint8 (the
    caller views it back: it knows the dtype it asked for)."""
    return from_dlpack(value.to_dlpack())
