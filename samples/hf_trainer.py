"""Train a small GPT-2 (built from a config) with the Hugging Face Trainer API on ONNX Runtime.

    python samples/hf_trainer.py                       # about a minute on 2 CPU cores
    python samples/hf_trainer.py --steps 20 --out /tmp/hf   # a quick smoke run (what the tests do)

The only change from a plain ``transformers.Trainer`` script is the import of ``Trainer`` from
``ort_trainer.hf``. The text is samples/data/corpus.txt (bundled, see samples/data/README.md), read as
bytes: a character-level model needs no tokenizer, so nothing is downloaded. The run logs, evaluates
and checkpoints as HF does (OUT/checkpoint-N folders), resumes with --resume, and saves the final model
with save_model(); the script then loads that folder with from_pretrained and evaluates it with
transformers.Trainer on PyTorch.
"""

import argparse
import math
from pathlib import Path

import torch
import transformers

from ort_trainer.hf import Trainer  # the one changed line: was `from transformers import Trainer`

DATA = Path(__file__).resolve().parent / "data" / "corpus.txt"
CONTEXT = 64  # bytes per training sequence
STEPS = 300
EVAL_FRACTION = 0.1  # the tail of the corpus is held out

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--steps", type=int, default=STEPS, help=f"optimizer steps (default {STEPS})")
parser.add_argument("--out", default="out/hf_trainer", help="output folder (checkpoints, final model)")
parser.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --out")
cli = parser.parse_args()
OUT = Path(cli.out)


class Chunks(torch.utils.data.Dataset):
    """Non-overlapping CONTEXT-byte pieces of a text; the model shifts the labels itself."""

    def __init__(self, data: bytes):
        self.tokens = torch.tensor(list(data), dtype=torch.int64)

    def __len__(self) -> int:
        return len(self.tokens) // CONTEXT

    def __getitem__(self, i: int) -> dict:
        ids = self.tokens[i * CONTEXT : (i + 1) * CONTEXT]
        # attention_mask: all ones here (no padding); optional (without one transformers looks for packed sequences)
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}


text = DATA.read_bytes()
split = int(len(text) * (1 - EVAL_FRACTION))
train_data, eval_data = Chunks(text[:split]), Chunks(text[split:][: 32 * CONTEXT])

config = transformers.GPT2Config(
    vocab_size=256, n_positions=CONTEXT, n_embd=64, n_layer=2, n_head=4, bos_token_id=0, eos_token_id=0,
    resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="eager",
)  # fmt: skip
torch.manual_seed(0)
model = transformers.GPT2LMHeadModel(config)

args = transformers.TrainingArguments(
    output_dir=str(OUT),
    max_steps=cli.steps,
    per_device_train_batch_size=16,
    per_device_eval_batch_size=16,
    learning_rate=3e-3,
    weight_decay=0.01,
    lr_scheduler_type="cosine",
    warmup_steps=0.05,  # < 1: a fraction of max_steps
    logging_steps=max(1, cli.steps // 10),
    eval_strategy="steps",
    eval_steps=max(1, cli.steps // 2),
    save_strategy="steps",
    save_steps=max(1, cli.steps // 2),
    save_total_limit=2,
    report_to="none",
    use_cpu=True,
    seed=0,
    disable_tqdm=True,
)
trainer = Trainer(model=model, args=args, train_dataset=train_data, eval_dataset=eval_data)
result = trainer.train(resume_from_checkpoint=True if cli.resume else None)
losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
eval_loss = trainer.evaluate()["eval_loss"]
trainer.save_model(OUT / "final")

# the saved folder is a normal HF model: transformers' own Trainer on PyTorch gets the same held-out loss
reloaded = transformers.GPT2LMHeadModel.from_pretrained(OUT / "final")
torch_loss = transformers.Trainer(model=reloaded, args=args, eval_dataset=eval_data).evaluate()["eval_loss"]
print(f"ONNX Runtime eval loss {eval_loss:.5f}, PyTorch (from_pretrained) {torch_loss:.5f}")
print(
    f"summary: steps={trainer.state.global_step} first_train_loss={losses[0]:.4f} last_train_loss={losses[-1]:.4f} "
    f"eval_loss={eval_loss:.4f} uniform={math.log(256):.4f} model={OUT / 'final'}"
)
