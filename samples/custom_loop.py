"""Your own PyTorch training loop, with the forward and backward in ONNX Runtime: ORTModule.

    python samples/custom_loop.py                       # 500 steps; checkpoints in out/custom_loop/checkpoints
    python samples/custom_loop.py --steps 20 --out /tmp/loop   # a quick smoke run (what the tests do)
    python samples/custom_loop.py --kill-after 130      # killed with SIGKILL after step 130; run it again: it resumes

The loop is plain PyTorch: torch's AdamW, a warmup + cosine LR schedule (LambdaLR), gradient clipping
(clip_grad_norm_), train/eval switches and torch.no_grad() for the held-out loss. The one change is
`ORTModule(model)`: its forward and backward graphs run in ONNX Runtime, and the gradients land in the
model's own `param.grad`, where the optimizer and the clipping read them. At the end the trained weights
are the plain module's (ORTModule trains the module itself): it generates text in eager PyTorch.

Checkpoints: a CheckpointManager saves the loop's objects (the module, AdamW, the schedule, torch's generators and
the batch sampler's generator) every --checkpoint-every steps, asynchronously, into OUT/checkpoints (a folder of
this sample's own: out/custom_loop/checkpoints by default). Every run resumes: a run started again restores the
newest complete checkpoint and continues bit for bit as the run that never stopped; a run that had finished has
nothing left to train and generates its text again. Delete OUT/checkpoints (or pass another --out) to start over.
"""

import argparse
import math
import os
import signal
import time
from pathlib import Path

import torch
from model import CharTransformer, generate, get_batch, lm_loss, load_corpus

from ort_trainer import ORTModule
from ort_trainer.checkpoint import CheckpointManager
from ort_trainer.checkpoint.objects import RNGState

# -----------------------------------------------------------------------------
# settings (those of samples/train_lm.py)
SEED = 1337
DATA = Path(__file__).resolve().parent / "data" / "corpus.txt"
OUT_DIR = "out/custom_loop"  # git-ignored; this sample's own (the other samples' checkpoints are not its objects)
EVAL_FRACTION = 0.1
CONTEXT = 64
BATCH = 16
D_MODEL = 64
LAYERS = 2
HEADS = 4
DROPOUT = 0.1  # masks drawn from torch's generator as eager PyTorch draws them (docs/ortmodule.md)
STEPS = 500
LR = 1e-2
WARMUP = 0.05
WEIGHT_DECAY = 0.01
BETA2 = 0.99
CLIP = 1.0  # clip_grad_norm_ on the model's own gradients
EVAL_EVERY = 50
CHECKPOINT_EVERY = 50
EVAL_BATCHES = 4
GENERATE_CHARS = 200
PROMPT = "This License "

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--steps", type=int, default=STEPS, help=f"optimizer steps (default {STEPS})")
parser.add_argument("--eval-every", type=int, default=EVAL_EVERY, help=f"steps between evals (default {EVAL_EVERY})")
parser.add_argument("--checkpoint-every", type=int, default=CHECKPOINT_EVERY, help="steps between checkpoints")
parser.add_argument("--kill-after", type=int, default=None, help="SIGKILL this process after that step (a crash)")
parser.add_argument("--out", default=OUT_DIR, help=f"output folder (default {OUT_DIR}/)")
args = parser.parse_args()
out = Path(args.out)
out.mkdir(parents=True, exist_ok=True)

torch.manual_seed(SEED)
chars, data = load_corpus(DATA)
split = int(len(data) * (1 - EVAL_FRACTION))
train_data, eval_data = data[:split], data[split:]
g = torch.Generator().manual_seed(SEED)
eval_batches = [get_batch(eval_data, CONTEXT, BATCH, g) for _ in range(EVAL_BATCHES)]

model = CharTransformer(len(chars), CONTEXT, D_MODEL, HEADS, LAYERS, DROPOUT)
ort_model = ORTModule(model)  # the only line that differs from an eager PyTorch loop
optimizer = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, BETA2), weight_decay=WEIGHT_DECAY)
warmup = max(1, int(WARMUP * args.steps))


def lr_factor(step):
    """Linear warmup, then a cosine decay to 0 at the last step."""
    if step < warmup:
        return (step + 1) / warmup
    return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, args.steps - warmup)))


scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)


def evaluate():
    ort_model.eval()
    with torch.no_grad():  # the forward graph only
        loss = sum(lm_loss(ort_model(tokens), label).item() for tokens, label in eval_batches) / len(eval_batches)
    ort_model.train()
    return loss


class BatchSampler:
    """The training batches' generator as a Stateful object: a resumed run draws the batches it would have drawn."""

    def __init__(self, generator):
        self.generator = generator

    def state_dict(self):
        return {"state": self.generator.get_state()}

    def load_state_dict(self, state):
        self.generator.set_state(state["state"])


# the loop's state: ORTModule's state_dict is the module's own; RNGState holds torch's generators (Dropout masks)
state = {
    "model": ort_model,
    "optimizer": optimizer,
    "scheduler": scheduler,
    "rng": RNGState(),
    "batches": BatchSampler(g),
}
manager = CheckpointManager(out / "checkpoints", keep_last=2, async_save=True)
restored = manager.restore(state)  # None on a fresh start
start_step = restored.step if restored else 0
if restored:
    print(f"resumed from {restored.path} (step {start_step})", flush=True)
if start_step >= args.steps:
    print(f"the checkpoint is at step {start_step}, --steps is {args.steps}: nothing to train", flush=True)

first_eval = eval_loss = evaluate()
print(f"step {start_step:4d}  eval loss {first_eval:.3f}", flush=True)
start = time.perf_counter()
for step in range(start_step, args.steps):
    tokens, label = get_batch(train_data, CONTEXT, BATCH, g)
    optimizer.zero_grad(set_to_none=True)
    loss = lm_loss(ort_model(tokens), label)
    loss.backward()  # the backward graph, in ONNX Runtime; gradients in model's param.grad
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
    optimizer.step()
    scheduler.step()
    if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
        eval_loss = evaluate()
        print(
            f"step {step + 1:4d}  train loss {loss.item():.3f}  eval loss {eval_loss:.3f}  grad norm {norm:.2f}  "
            f"lr {scheduler.get_last_lr()[0]:.2e}",
            flush=True,
        )
    if (step + 1) % args.checkpoint_every == 0 or step + 1 == args.steps:
        manager.save(state, step + 1, metrics={"loss": loss.item()})  # asynchronous: the loop goes on
    if args.kill_after is not None and step + 1 == args.kill_after:
        os.kill(os.getpid(), signal.SIGKILL)  # a crash, wherever the background save is
manager.wait()
seconds = time.perf_counter() - start

model.eval()  # the trained module is the user's own: eager PyTorch generates with it
prompt = [chars.index(c) for c in PROMPT]
ids = generate(model, prompt, GENERATE_CHARS, CONTEXT, generator=torch.Generator().manual_seed(0))
text = "".join(chars[i] for i in ids)
print(text)
weights = sum(p.detach().double().sum().item() for p in model.parameters())  # equal runs give equal bits
print(
    f"summary: steps={max(start_step, args.steps)} first_eval={first_eval:.4f} last_eval={eval_loss:.4f} "
    f"weights={weights!r} seconds={seconds:.1f}"
)
