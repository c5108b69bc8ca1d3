"""Train a tiny character-level transformer language model on ONNX Runtime with ORTTrainer.

    python samples/train_lm.py                      # the full demo (500 steps), what `make demo` runs
    python samples/train_lm.py --steps 30 --out /tmp/lm   # a quick smoke run (what the tests do)

The corpus is samples/data/corpus.txt (GNU license texts, see samples/data/README.md). The script
exports the PyTorch model to ONNX, trains it with Adam + a cosine LR schedule in ONNX Runtime, checks
the held-out loss every EVAL_EVERY steps, draws the loss curves to OUT_DIR/loss.png and finally hands
the trained weights back to the plain PyTorch module to generate some text.

Every run starts fresh: it first deletes OUT_DIR/checkpoints, the checkpoints an earlier run of this script left
there (a demo run again should show the demo again, not resume; samples/resume_lm.py and custom_loop.py resume).
"""

import argparse
import math
import shutil
import time
from pathlib import Path

import matplotlib.pyplot as plt
import torch
from model import CharTransformer, generate, get_batch, lm_loss, load_corpus
from tqdm import tqdm

from ort_trainer import ORTTrainer, checkpoint, optim

plt.switch_backend("Agg")  # no display needed (CI machines have none): we only write a PNG

# -----------------------------------------------------------------------------
# settings: tuned so the demo finishes in about a minute on 2 CPU cores
SEED = 1337
DATA = Path(__file__).resolve().parent / "data" / "corpus.txt"
OUT_DIR = "out"  # git-ignored
EVAL_FRACTION = 0.1  # the tail of the corpus is held out; never trained on
CONTEXT = 64  # characters the model sees at once
BATCH = 16  # on 2 cores, more small steps beat fewer big ones within a one-minute budget
D_MODEL = 64
LAYERS = 2
HEADS = 4
DROPOUT = 0.1  # the exported training graph keeps Dropout; ORT's eval graph turns it off
STEPS = 500
LR = 1e-2  # tiny models tolerate a large Adam LR; in our runs 3e-3 ended ~0.3 nats higher
WARMUP = 0.05  # fraction of STEPS; a short warmup keeps the first Adam steps from blowing up
WEIGHT_DECAY = 0.01
BETA2 = 0.99  # Adam's second-moment decay; nanoGPT's choice for small models with few tokens per step
EVAL_EVERY = 50
CHECKPOINT_EVERY = 100  # into OUT_DIR/checkpoints/ by a CheckpointManager (asynchronous; last 2 + best kept)
EVAL_BATCHES = 4  # fixed held-out batches, so the eval curve moves only when the model does
GENERATE_CHARS = 200
PROMPT = "This License "
TEMPERATURE = 0.8  # sampling: < 1 favours likely characters; 0 would be greedy (and repeat itself)
TOP_K = 10  # sample among the 10 most likely next characters only

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--steps", type=int, default=STEPS, help=f"optimizer steps (default {STEPS})")
parser.add_argument("--eval-every", type=int, default=EVAL_EVERY, help=f"steps between evals (default {EVAL_EVERY})")
parser.add_argument("--checkpoint-every", type=int, default=CHECKPOINT_EVERY, help="steps between checkpoints")
parser.add_argument(
    "--out", default=OUT_DIR, help=f"folder for loss.png and checkpoints/, which a run replaces (default {OUT_DIR}/)"
)
args = parser.parse_args()
STEPS, EVAL_EVERY, OUT_DIR = args.steps, args.eval_every, Path(args.out)
CHECKPOINT_EVERY = args.checkpoint_every

torch.manual_seed(SEED)
started = time.perf_counter()

# -----------------------------------------------------------------------------
# data: a character vocabulary is tiny (81 symbols here) and needs no tokenizer
chars, data = load_corpus(DATA)
vocab = len(chars)
split = int(len(data) * (1 - EVAL_FRACTION))
train_data, eval_data = data[:split], data[split:]


train_rng = torch.Generator().manual_seed(SEED)
eval_batches = [
    get_batch(eval_data, CONTEXT, BATCH, torch.Generator().manual_seed(SEED + i)) for i in range(EVAL_BATCHES)
]


# -----------------------------------------------------------------------------
# model: a pre-norm transformer decoder (samples/model.py, shared with the other samples)
model = CharTransformer(vocab, CONTEXT, D_MODEL, HEADS, LAYERS, DROPOUT)
print(f"corpus: {len(data):,} chars, vocab {vocab}, {sum(p.numel() for p in model.parameters()):,} parameters")

# -----------------------------------------------------------------------------
# trainer. String dims are declared dynamic, but keep "seq" at CONTEXT: the TorchScript exporter bakes
# nn.MultiheadAttention's traced sequence length into its Reshape nodes (the batch dim stays dynamic),
# so a graph traced on 64-character windows fails on shorter ones. Every batch here is full-length.
model_desc = {
    "inputs": [("tokens", ["batch", "seq"]), ("label", ["batch", "seq"])],
    "outputs": [("loss", [], True)],
}
# nanoGPT's rule: weight decay for matrices and embeddings only; biases and LayerNorm gains (1-D) get none.
no_decay = [name for name, p in model.named_parameters() if p.dim() < 2]
optim_config = optim.AdamConfig(
    params=[{"params": no_decay, "lambda_coef": 0.0}], lr=LR, beta=BETA2, lambda_coef=WEIGHT_DECAY, max_norm_clip=1.0
)
scheduler = optim.lr_scheduler.CosineWarmupLRScheduler(total_steps=STEPS, cycles=0.5, warmup=WARMUP)
trainer = ORTTrainer(
    model, model_desc, optim_config, loss_fn=lm_loss,
    options={"lr_scheduler": scheduler, "utils": {"grad_norm_clip": True}},
)


# Checkpoints: the manager saves in the background (the loop waits only for a copy of the state) and keeps the
# last two checkpoints plus the one with the best eval loss; samples/resume_lm.py shows restoring from it.
# This run starts at step 1, so an earlier run's checkpoints go first: the manager refuses to save a step below
# the newest one it holds (restore() would pick the old, higher step).
if (OUT_DIR / "checkpoints").exists():
    shutil.rmtree(OUT_DIR / "checkpoints")
    print(f"removed the checkpoints of an earlier run in {OUT_DIR / 'checkpoints'}")
manager = checkpoint.CheckpointManager(
    OUT_DIR / "checkpoints", keep_last=2, keep_best=("eval_loss", "min", 1), async_save=True
)


def evaluate():
    return sum(trainer.eval_step(tokens, label).item() for tokens, label in eval_batches) / EVAL_BATCHES


# -----------------------------------------------------------------------------
# training loop. The first call exports the model and builds the ORT graphs (a few seconds).
eval_steps, eval_losses = [0], [evaluate()]
train_losses = []
progress = tqdm(range(1, STEPS + 1), desc="train", unit="step")
for step in progress:
    loss = trainer.train_step(*get_batch(train_data, CONTEXT, BATCH, train_rng)).item()  # loss before the update
    train_losses.append(loss)
    progress.set_postfix(loss=f"{loss:.3f}", lr=f"{scheduler.get_last_lr()[0]:.2e}", eval=f"{eval_losses[-1]:.3f}")
    if step % EVAL_EVERY == 0 or step == STEPS:
        eval_steps.append(step)
        eval_losses.append(evaluate())
    if step % CHECKPOINT_EVERY == 0 or step == STEPS:
        # weights, Adam moments, step counters and the LR schedule; user_dict holds what we need to plot
        manager.save(trainer, step, metrics={"eval_loss": eval_losses[-1]}, user_dict={"train_losses": train_losses})
progress.close()
manager.wait()  # the last checkpoint is published (and its error, if any, raised) before we go on
seconds = time.perf_counter() - started

# -----------------------------------------------------------------------------
# loss curves. Uniform guessing over the vocabulary costs ln(vocab) nats per character.
OUT_DIR.mkdir(parents=True, exist_ok=True)
png = OUT_DIR / "loss.png"
fig, ax = plt.subplots(figsize=(7, 4.5), dpi=110)
# train_step returns the loss from before its update, so step k's loss belongs to the weights after k - 1
# updates: plotting it at k - 1 lines it up with the eval points, which are taken after k updates.
ax.plot(range(len(train_losses)), train_losses, color="tab:blue", alpha=0.6, linewidth=1, label="train (batch)")
ax.plot(eval_steps, eval_losses, "o-", color="tab:orange", label=f"eval ({EVAL_BATCHES} held-out batches)")
ax.axhline(math.log(vocab), color="grey", linestyle=":", label=f"uniform guess, ln({vocab})")
ax.set_xlabel("optimizer step")
ax.set_ylabel("cross-entropy loss (nats / character)")
ax.set_title(f"Character LM on ONNX Runtime: {LAYERS} layers, d_model {D_MODEL}, context {CONTEXT}")
ax.grid(alpha=0.3)
ax.legend()
fig.tight_layout()
fig.savefig(png)
plt.close(fig)

# -----------------------------------------------------------------------------
# ORT -> PyTorch hand-off: the trained weights go back into the untouched torch module
model.load_state_dict(trainer.state_dict(pytorch_format=True))
model.eval()
with torch.no_grad():
    tokens, label = eval_batches[0]
    torch_loss = lm_loss(model(tokens), label).item()
print(f"held-out batch loss: ONNX Runtime {trainer.eval_step(tokens, label).item():.4f}, PyTorch {torch_loss:.4f}")

# Sampling with temperature and top-k (greedy decoding would repeat one word); seeded, so every run prints
# the same text.
RULE = "-" * 60
sampler = torch.Generator().manual_seed(SEED)
ids = generate(model, [chars.index(c) for c in PROMPT], GENERATE_CHARS, CONTEXT, TEMPERATURE, TOP_K, sampler)
generated = "".join(chars[i] for i in ids)
print(f"generated:\n{RULE}\n{generated}\n{RULE}")  # once, as it reads

print(
    f"summary: steps={STEPS} first_train_loss={train_losses[0]:.4f} last_train_loss={train_losses[-1]:.4f} "
    f"eval_loss={eval_losses[-1]:.4f} seconds={seconds:.1f} png={png} checkpoint={manager.latest().path}"
)
