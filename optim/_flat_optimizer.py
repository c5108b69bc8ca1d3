"""`FlatOptimizer`: the legacy ONNX Runtime update rules over one flat parameter buffer.

The trainer packs all trainable parameters into one contiguous buffer (`FlatLayout`) whose views
are bound to ONNX Runtime zero-copy, and the gradients into a second buffer of the same layout.
This class updates that parameter buffer strictly in place (its storage is never replaced), one
vectorised pass per parameter group, and keeps the optimizer state in flat buffers too. Its
`state_dict()` uses the legacy per-parameter key layout so checkpoints stay compatible.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Mapping
from numbers import Real
from typing import Any

import torch

from . import _updates
from . import state as _state
from ._updates import Buffers, Group, Run
from .config import _OptimizerConfig
from .layout import FlatLayout

__all__ = ["FlatOptimizer"]

_ADAM, _LAMB, _SGD = "AdamOptimizer", "LambOptimizer", "SGDOptimizer"

# CPU buffers up to this many elements are updated on one torch thread (see `_update_threads`).
SINGLE_THREAD_NUMEL = 1 << 23


class FlatOptimizer:
    """Runs the update rule of `config` over flat fp32 buffers, in place.

    Args:
        config: an `AdamConfig`, `LambConfig` or `SGDConfig`.
        layout: how the parameters are packed in `params` / `grads`.
        params: 1-D contiguous floating tensor of `layout.numel` elements; updated in place.
        grads: same layout; gradients averaged over accumulation steps but still multiplied by the
            loss scale. Read only (the optimizer unscales into its own scratch buffer).

    Counters follow the legacy backend: Adam keeps one `Update_Count` per parameter, LAMB one shared
    `Step`; both start at 1 and grow by 1 per `step()`.
    """

    def __init__(self, config: _OptimizerConfig, layout: FlatLayout, params: torch.Tensor, grads: torch.Tensor):
        if not isinstance(config, _OptimizerConfig):
            raise TypeError(f"config must be an AdamConfig, LambConfig or SGDConfig, got {type(config).__name__}")
        if not isinstance(layout, FlatLayout):
            raise TypeError(f"layout must be a FlatLayout, got {type(layout).__name__}")
        layout.check_buffer(params, "params")
        layout.check_buffer(grads, "grads")
        if not params.dtype.is_floating_point or grads.dtype != params.dtype or grads.device != params.device:
            raise ValueError(
                f"params and grads must be floating-point tensors of one dtype and device, got "
                f"{params.dtype}/{params.device} and {grads.dtype}/{grads.device}"
            )
        self.config, self.layout, self.kind = config, layout, config.name
        self._grads = grads
        self._buf = Buffers(params=params, g=torch.empty_like(params))
        if self.kind != _SGD:
            self._buf.m, self._buf.v = torch.zeros_like(params), torch.zeros_like(params)
        if self.kind == _LAMB:
            self._buf.m_alt, self._buf.v_alt = torch.empty_like(params), torch.empty_like(params)
        self._group_of = [config.group_index(slot.name) for slot in layout.slots]
        hps = [self._hyper_parameters(i) for i in set(self._group_of)]
        if self.kind == _LAMB or (self.kind == _ADAM and not all(map(_updates.uses_fused_adamw, hps))):
            self._buf.d = torch.empty_like(params)
        self._lamb_step = 1
        self._idle: frozenset[str] = frozenset()
        self._groups = self._plan([1] * len(layout))
        self._threads = 1 if params.device.type == "cpu" and layout.numel <= SINGLE_THREAD_NUMEL else None

    # ------------------------------------------------------------------ planning
    def _hyper_parameters(self, index: int) -> dict[str, Any]:
        source = self.config.params[index] if index < len(self.config.params) else self.config.defaults
        return {k: v for k, v in source.items() if k not in ("params", "lr")}

    def _plan(self, counts: list[int]) -> list[Group]:
        """Group the slots into runs: consecutive slots of one group with one Update_Count (and idleness)."""
        groups: dict[int, Group] = {}
        last: tuple[int, int, bool] | None = None
        for i, slot in enumerate(self.layout.slots):
            idle = slot.name in self._idle
            key = (self._group_of[i], counts[i], idle)
            if key[0] not in groups:
                groups[key[0]] = Group(hp=self._hyper_parameters(key[0]))
            group = groups[key[0]]
            if key == last:
                run = group.runs[-1]
                run.end, run.stop = slot.end, i + 1
            else:
                group.runs.append(Run(slot.offset, slot.end, i, i + 1, count=counts[i], idle=idle))
            last = key
            if self.kind == _LAMB and not idle:  # per-parameter views for the trust-ratio norms
                group.w_views.append(self._buf.params[slot.offset : slot.end])
                group.d_views.append(self._buf.d[slot.offset : slot.end])
        plan = [groups[k] for k in sorted(groups)]
        for run in (run for group in plan for run in group.runs):
            run.step_t = torch.full((1,), float(run.count), dtype=torch.float32, device=self._buf.params.device)
        return plan

    def set_idle(self, names) -> None:
        """Never update these parameters (the graph does not use them), like torch skips a ``None`` grad.

        Their moments stay as they are; their counters still advance with every step, so every
        parameter's ``Update_Count`` keeps equal to the number of updates + 1.
        """
        unknown = sorted(set(names) - set(self.layout.names))
        if unknown:
            raise KeyError(f"set_idle: not parameters of this optimizer: {unknown}")
        self._idle = frozenset(names)
        self._groups = self._plan(self._counts())

    def _counts(self) -> list[int]:
        counts = [1] * len(self.layout)
        for group in self._groups:
            for run in group.runs:
                counts[run.first : run.stop] = [run.count] * (run.stop - run.first)
        return counts

    # ---------------------------------------------------------------------- step
    def step(self, lr: float, *, loss_scale: float = 1.0, clip: bool = True, grad_norm: float | None = None) -> None:
        """One update of the parameters from the current gradients.

        Args:
            lr: learning rate of this step (>= 0).
            loss_scale: S, the factor the gradients are still multiplied by.
            clip: clip the gradients to global L2 norm `max_norm_clip` (Adam and LAMB).
            grad_norm: the global L2 norm of the (loss-scaled) gradients, when the caller already
                has it (e.g. over all ranks); computed from `grads` when None.

        Gradients are divided by s = N / max_norm_clip if clip and N > S * max_norm_clip, else by S.
        """
        lr, loss_scale = _positive_real("lr", lr, allow_zero=True), _positive_real("loss_scale", loss_scale)
        with _update_threads(self._threads):
            self._step(lr, loss_scale, clip, grad_norm)

    def _step(self, lr: float, loss_scale: float, clip: bool, grad_norm: float | None) -> None:
        if self.kind == _SGD:
            _updates.sgd(self._buf, self._unscaled({0: loss_scale}), lr)
            return
        if clip and grad_norm is None and _norm_stays_on_device(self._grads):
            divisors = self._device_divisors(loss_scale)
        else:
            if clip:
                grad_norm = float(torch.linalg.vector_norm(self._grads) if grad_norm is None else grad_norm)
            divisors = {}
            for i, group in enumerate(self._groups):
                limit = group.hp["max_norm_clip"]
                divisors[i] = grad_norm / limit if clip and grad_norm > loss_scale * limit else loss_scale
        g = self._unscaled(divisors)
        if self.kind == _ADAM:
            self._adam_step(g, lr)
        else:
            self._lamb_step_all(g, lr)

    def _device_divisors(self, loss_scale: float) -> dict[int, torch.Tensor]:
        """Each group's divisor max(N / max_norm_clip, S) as a 0-d tensor on the gradients' device.

        The same rule as the host path, without reading N back: on a GPU, ``float(norm)`` would make every
        update wait for the backward to finish (torch's ``clip_grad_norm_`` does not wait either).
        """
        norm = torch.linalg.vector_norm(self._grads)
        return {
            i: torch.clamp(norm / group.hp["max_norm_clip"], min=loss_scale) for i, group in enumerate(self._groups)
        }

    def _unscaled(self, divisors: dict[int, float | torch.Tensor]) -> torch.Tensor:
        """Gradients divided by each group's divisor (the grads buffer itself when all are 1)."""
        values = set(divisors.values())
        if all(isinstance(v, float) for v in values) and values == {1.0}:
            return self._grads
        if len(values) == 1:
            return torch.div(self._grads, values.pop(), out=self._buf.g)
        for i, group in enumerate(self._groups):
            for run in group.runs:
                s = slice(run.start, run.end)
                torch.div(self._grads[s], divisors[i], out=self._buf.g[s])
        return self._buf.g

    def _adam_step(self, g: torch.Tensor, lr: float) -> None:
        for group in self._groups:
            if _updates.uses_fused_adamw(group.hp):
                _updates.adam_fused(group, self._buf, g, lr)
            else:
                _updates.adam_generic(group, self._buf, g, lr)
            for run in group.runs:
                run.count += 1
                run.step_t.add_(1.0)

    def _lamb_step_all(self, g: torch.Tensor, lr: float) -> None:
        for group in self._groups:
            _updates.lamb(group, self._buf, g, lr, self._lamb_step)
        buf = self._buf
        buf.m, buf.m_alt, buf.v, buf.v_alt = buf.m_alt, buf.m, buf.v_alt, buf.v
        self._lamb_step += 1

    # --------------------------------------------------------------------- state
    def update_count(self) -> int | None:
        """The counter every parameter is at (Adam's ``Update_Count``, LAMB's ``Step``); None for SGD or no
        parameters. ValueError if Adam's per-parameter counters differ (only a direct load can do that)."""
        if self.kind == _SGD or not len(self.layout):
            return None
        if self.kind == _LAMB:
            return self._lamb_step
        counts = set(self._counts())
        if len(counts) > 1:
            raise ValueError(f"the parameters' Update_Counts differ: {sorted(counts)}")
        return counts.pop()

    def set_update_count(self, count: int) -> None:
        """Put every parameter's counter at ``count`` (>= 1): what the trainer derives from its step."""
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ValueError(f"update count must be an int >= 1, got {count!r}")
        if self.kind == _LAMB:
            self._lamb_step = count
        self._groups = self._plan([count] * len(self.layout))

    def moments(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The flat first and second moment buffers (live, in layout order); None for SGD."""
        return None if self.kind == _SGD else (self._buf.m, self._buf.v)

    def state_dict(self, *, copy: bool = True) -> dict[str, Any]:
        """The optimizer state in the legacy layout, as detached COPIES (editing them is harmless).

        ``copy=False`` returns views of the live moment buffers instead: for writers that stream the
        state to disk (no second copy of the moments in memory) and readers that fill it in place.

        Adam: ``{param: {"Moment_1", "Moment_2", "Update_Count"}}``; LAMB: ``{param: {"Moment_1",
        "Moment_2"}, "shared_optimizer_state": {"Step"}}``; SGD: ``{}``. Moments have the
        parameter's shape, dtype and device; counters are CPU int64 tensors of shape [1].
        """
        if self.kind == _SGD:
            return {}
        m, v = self.layout.views(self._buf.m), self.layout.views(self._buf.v)
        own = (lambda t: t.detach().clone()) if copy else (lambda t: t.detach())
        state: dict[str, Any] = {name: {"Moment_1": own(m[name]), "Moment_2": own(v[name])} for name in m}
        if self.kind == _ADAM:
            for name, count in zip(self.layout.names, self._counts(), strict=True):
                state[name][_state.UPDATE_COUNT] = torch.tensor([count], dtype=torch.int64)
        else:
            state[_state.SHARED] = {_state.STEP: torch.tensor([self._lamb_step], dtype=torch.int64)}
        return state

    def validate_state_dict(
        self, state: Mapping[str, Any], *, strict: bool = True, where: str = "state_dict[optimizer]"
    ) -> None:
        """Raise ValueError listing every missing / unexpected key and bad shape, dtype or value.

        With strict=False, missing and unexpected keys are allowed (what is present is still checked).
        """
        _state.raise_if_invalid(self.kind, self.layout, state, strict, where)

    def incompatible_keys(self, state: Mapping[str, Any], where: str = "optimizer") -> tuple[list[str], list[str]]:
        """(missing, unexpected) key paths of ``state`` (``where/name[/key]``), what strict=False tolerates."""
        return _state.key_differences(self.kind, self.layout, state, where)

    def load_state_dict(self, state: Mapping[str, Any], strict: bool = True) -> None:
        """Validate all of `state`, then copy it into the optimizer's buffers in place.

        A failed validation changes nothing. With strict=False, missing entries keep their values.
        """
        self.validate_state_dict(state, strict=strict)
        if self.kind == _SGD:
            return
        views = {key: self.layout.views(buf) for key, buf in (("Moment_1", self._buf.m), ("Moment_2", self._buf.v))}
        counts = self._counts()
        for i, name in enumerate(self.layout.names):
            entry = state.get(name, {})
            for key, target in views.items():
                if key in entry:
                    target[name].copy_(_state.as_tensor(entry[key]))
            if _state.UPDATE_COUNT in entry:
                counts[i] = _state.counter_value(entry[_state.UPDATE_COUNT])
        if self.kind == _LAMB and _state.STEP in state.get(_state.SHARED, {}):
            self._lamb_step = _state.counter_value(state[_state.SHARED][_state.STEP])
        self._groups = self._plan(counts)


@contextlib.contextmanager
def _update_threads(threads: int | None) -> Iterator[None]:
    """Run the update on at most ``threads`` torch (OpenMP) threads; None: torch's setting.

    The update sits between two ONNX Runtime runs. A multi-threaded OpenMP region leaves its workers
    spinning for a while after it ends (libgomp's default wait policy), on the cores ORT's intra-op
    threads are about to use; on a busy machine a worker that is not scheduled stalls the whole region.
    For small buffers one thread loses little (the update is memory-bound: 0.3 ms for 0.8M elements,
    6.6 ms for 5.2M, measured) and avoids both; large ones keep torch's threads.
    """
    previous = torch.get_num_threads()
    if threads is None or threads >= previous:
        yield
        return
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def _positive_real(name: str, value: Any, allow_zero: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    if value < 0 or (value == 0 and not allow_zero):
        raise ValueError(f"{name} must be {'>= 0' if allow_zero else '> 0'}, got {value!r}")
    return float(value)


def _norm_stays_on_device(grads: torch.Tensor) -> bool:
    """Clip with the norm as a device tensor (`FlatOptimizer._device_divisors`) rather than a host float."""
    return grads.device.type != "cpu"
