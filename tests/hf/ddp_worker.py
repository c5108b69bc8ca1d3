"""One rank of tests/hf/test_distributed.py: ort_trainer.hf.Trainer under torchrun-style environment variables.

argv: output folder. Rank 0 writes the logged losses (losses.json) and the final model (save_model)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tests.hf.common import OrtHFTrainer, arguments, gpt2, run

OVERRIDES = dict(per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=4, save_strategy="steps",
                 save_steps=2, lr_scheduler_type="linear", ddp_backend="gloo")  # fmt: skip
ZERO = {"distributed": {"deepspeed_zero_optimization": {"stage": 1}}}


def main(out: Path) -> None:
    trainer, losses, _ = run(OrtHFTrainer, gpt2(), arguments(out, **OVERRIDES), ort_options=ZERO)
    assert trainer.args.world_size == 2, trainer.args.world_size
    trainer.save_model(out / "final")
    if trainer.args.process_index == 0:
        (out / "losses.json").write_text(json.dumps(losses))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
