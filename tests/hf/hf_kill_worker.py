"""An ``ort_trainer.hf.Trainer`` run SIGKILLed at one phase of its save of ``checkpoint-4`` (tests/hf/test_resume.py).

``python -m tests.hf.hf_kill_worker OUTPUT_DIR PHASE`` (or a child that ``--serve`` forks, `serve`) trains the run
of the resume tests (6 updates, a save every 2, ``save_total_limit=1``) and kills itself with SIGKILL at PHASE of
the save at update 4, as a preempted job dies: no exception handler, no ``atexit``. HF's save writes the weights
(``save_model``), ours (``ort_trainer.ortcp``), the random state, ``trainer_state.json`` (last), then rotates old
folders out.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import transformers
import transformers.trainer

from ort_trainer.hf import Trainer
from tests.hf.common import TokenData, arguments, gpt2, pad_collate

OVERRIDES = dict(max_steps=6, save_strategy="steps", save_steps=2, gradient_accumulation_steps=2,
                 lr_scheduler_type="cosine", save_total_limit=1)  # fmt: skip
KILL_AT = 4

PHASES = (
    "before-weights",
    "half-weights",
    "before-ours",
    "inside-ours",
    "before-rng",
    "inside-rng",
    "before-state",
    "half-state",
    "before-rotation",
    "inside-rotation",
)


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _half(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


class Killed(Trainer):
    """Dies at ``phase`` of the save at update `KILL_AT`."""

    phase = ""

    def _saving(self) -> bool:
        return self.state.global_step == KILL_AT

    def save_model(self, output_dir=None, _internal_call=False):
        if self._saving() and _internal_call and self.phase == "before-weights":
            _die()
        super().save_model(output_dir, _internal_call=_internal_call)
        if self._saving() and _internal_call and self.phase == "half-weights":
            _half(Path(output_dir) / "model.safetensors")
            _die()

    def _save_optimizer_and_scheduler(self, output_dir):
        if self._saving() and self.phase == "before-ours":
            _die()
        with _dies_at_fsync(self._saving() and self.phase == "inside-ours"):
            super()._save_optimizer_and_scheduler(output_dir)

    def _save_rng_state(self, output_dir):
        if self._saving() and self.phase == "before-rng":
            _die()
        with _dies_at_fsync(self._saving() and self.phase == "inside-rng"):
            super()._save_rng_state(output_dir)


class _dies_at_fsync:  # noqa: N801 - a context manager used like a function
    """SIGKILL at the writer's first fsync: the temporary file is written, not yet published."""

    def __init__(self, armed: bool):
        self._armed, self._real = armed, os.fsync

    def __enter__(self):
        if self._armed:
            os.fsync = lambda fd: _die()

    def __exit__(self, *exc):
        os.fsync = self._real


def main(output_dir: str, phase: str) -> None:
    if phase not in PHASES:
        raise SystemExit(f"unknown phase {phase!r}; one of {PHASES}")
    Killed.phase = phase
    checkpoint_dir = Path(output_dir) / f"checkpoint-{KILL_AT}"
    real_save_to_json = transformers.TrainerState.save_to_json
    real_rotate = transformers.trainer.rotate_checkpoints

    def save_to_json(state, json_path):
        if Path(json_path).parent == checkpoint_dir and phase == "before-state":
            _die()
        real_save_to_json(state, json_path)
        if Path(json_path).parent == checkpoint_dir and phase == "half-state":
            _half(Path(json_path))
            _die()

    def rotate_checkpoints(*args, **kwargs):
        if checkpoint_dir.is_dir() and phase == "before-rotation":
            _die()
        if checkpoint_dir.is_dir() and phase == "inside-rotation":  # rmtree of checkpoint-2 got this far
            old = Path(output_dir) / "checkpoint-2"
            for name in ("trainer_state.json", "model.safetensors"):
                (old / name).unlink()
            _die()
        return real_rotate(*args, **kwargs)

    transformers.TrainerState.save_to_json = save_to_json
    transformers.trainer.rotate_checkpoints = rotate_checkpoints
    trainer = Killed(model=gpt2(), args=arguments(output_dir, **OVERRIDES), train_dataset=TokenData(24),
                     data_collator=pad_collate)  # fmt: skip
    trainer.train()
    print("finished without being killed", flush=True)


def serve() -> None:
    """A fork server for the phases (``--serve``): imports what a run needs once (torch, transformers, the engine's
    tracer), then for each line ``["OUTPUT_DIR", "PHASE", "LOG"]`` (JSON) on stdin forks a child that runs `main`
    with its stdout and stderr in LOG, and answers with the child's wait status (SIGKILLed: as a preempted job
    dies)."""
    import json
    import traceback

    import ort_trainer.graph.autograd  # noqa: F401 - the first trainer's imports (torch._dynamo, sympy): seconds

    print("ready", flush=True)
    for line in sys.stdin:
        output_dir, phase, log = json.loads(line)
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                os.dup2(fd, 1)
                os.dup2(fd, 2)
                main(output_dir, phase)
                code = 0
            except BaseException:  # noqa: BLE001 - reported in LOG, the test fails on the exit status
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        print(os.waitpid(pid, 0)[1], flush=True)


if __name__ == "__main__":
    if sys.argv[1:] == ["--serve"]:
        serve()
    else:
        main(sys.argv[1], sys.argv[2])
