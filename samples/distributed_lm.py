"""Train the character LM on 2 processes with ZeRO stage 1, then turn the per-rank checkpoint into one model.

    torchrun --nproc_per_node 2 samples/distributed_lm.py              # the full demo: under a minute on 2 CPU cores
    torchrun --standalone --nproc_per_node 2 samples/distributed_lm.py # the same, on a free port (29500 taken?)
    torchrun --nproc_per_node 2 --master_addr 127.0.0.1 --master_port 29517 \\
        samples/distributed_lm.py --steps 20 --out /tmp/dist           # a quick smoke run (what the tests do)

torchrun starts one process per rank and gives each RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT; the
trainer reads them and creates the gloo process group itself. Every rank draws the same global batch and
trains on its own slice of it; gradients are averaged over the ranks, so the run is the single-process run
on the global batch. With ZeRO stage 1 each rank keeps the Adam moments of only its 1/WORLD_SIZE of the
parameters. Every SAVE_EVERY steps and at the end a CheckpointManager saves in the background: every rank
writes its part (OUT_DIR/checkpoints/ckpt-<step>.rank<r>-of-<W>.<id>.ortcp) and rank 0 publishes the
manifest (ckpt-<step>.ortcp.manifest.json) once every rank's file is durable; the last two sets are kept.
Every run starts fresh: rank 0 first deletes OUT_DIR/checkpoints, the sets an earlier run left there.
Rank 0 then aggregates the newest set into one ordinary checkpoint with the checkpoint CLI, loads its
weights into the plain PyTorch module and generates some text. Multi-machine runs: see "Distributed
training" in README.md.
"""

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from model import CharTransformer, generate, get_batch, lm_loss, load_corpus
from tqdm import tqdm

from ort_trainer import ORTTrainer, checkpoint, optim

# -----------------------------------------------------------------------------
# settings: the model and optimizer of samples/train_lm.py
SEED = 1337
DATA = Path(__file__).resolve().parent / "data" / "corpus.txt"
OUT_DIR = "out/distributed"  # git-ignored
CONTEXT = 64
BATCH = 16  # the global batch: each of the WORLD_SIZE ranks trains on BATCH / WORLD_SIZE rows of it
D_MODEL = 64
LAYERS = 2
HEADS = 4
DROPOUT = 0.1
STEPS = 1000  # a rank computes only BATCH / WORLD_SIZE rows a step: cheap steps, so more of them than train_lm.py
LR = 1e-2
WARMUP = 0.05
WEIGHT_DECAY = 0.01
BETA2 = 0.99
ZERO_STAGE = 1  # 2 would also shard the gradients: each chunk is reduced to its owner only (less traffic)
SAVE_EVERY = 250
GENERATE_CHARS = 100
PROMPT = "This License "
TEMPERATURE = 0.8  # sampling: < 1 favours likely characters; 0 would be greedy (and repeat itself)
TOP_K = 10  # sample among the 10 most likely next characters only

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--steps", type=int, default=STEPS, help=f"optimizer steps (default {STEPS})")
parser.add_argument("--out", default=OUT_DIR, help=f"folder for the checkpoints (default {OUT_DIR}/)")
args = parser.parse_args()
STEPS, OUT_DIR = args.steps, Path(args.out)

if "RANK" not in os.environ:
    sys.exit(f"launch this sample with torchrun, e.g.: torchrun --nproc_per_node 2 {sys.argv[0]}")
RANK, WORLD_SIZE = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
if BATCH % WORLD_SIZE:
    sys.exit(f"the global batch of {BATCH} rows does not split evenly over {WORLD_SIZE} ranks")
torch.manual_seed(SEED)  # equal on every rank anyway: the trainer broadcasts rank 0's initial weights
started = time.perf_counter()

# -----------------------------------------------------------------------------
# data: the same split as train_lm.py (the last 10% of the corpus is never trained on)
chars, data = load_corpus(DATA)
train_data = data[: int(len(data) * 0.9)]


# -----------------------------------------------------------------------------
# trainer: the only distributed setting is the ZeRO stage; world_rank / world_size default to torchrun's
# RANK / WORLD_SIZE, and constructing the trainer joins the process group (gloo on CPU).
model = CharTransformer(len(chars), CONTEXT, D_MODEL, HEADS, LAYERS, DROPOUT)
model_desc = {
    "inputs": [("tokens", ["batch", "seq"]), ("label", ["batch", "seq"])],
    "outputs": [("loss", [], True)],
}
no_decay = [name for name, p in model.named_parameters() if p.dim() < 2]
optim_config = optim.AdamConfig(
    params=[{"params": no_decay, "lambda_coef": 0.0}], lr=LR, beta=BETA2, lambda_coef=WEIGHT_DECAY, max_norm_clip=1.0
)
scheduler = optim.lr_scheduler.CosineWarmupLRScheduler(total_steps=STEPS, cycles=0.5, warmup=WARMUP)
trainer = ORTTrainer(
    model, model_desc, optim_config, loss_fn=lm_loss,
    options={
        "lr_scheduler": scheduler,
        "utils": {"grad_norm_clip": True},
        "distributed": {"deepspeed_zero_optimization": {"stage": ZERO_STAGE}},
    },
)
if RANK == 0:
    print(f"{WORLD_SIZE} ranks, ZeRO stage {ZERO_STAGE}, {sum(p.numel() for p in model.parameters()):,} parameters")

# -----------------------------------------------------------------------------
# checkpoints: every rank calls the manager alike. Saves are asynchronous: the loop waits only for a copy of the
# state, the files are written in the background, and the manifest is agreed over a process group of its own.
# An earlier run's sets go first (this run starts at step 1, and the manager refuses a step below the newest one
# it holds): rank 0 deletes them while the others wait at the barrier, before any rank opens the folder.
if RANK == 0 and (OUT_DIR / "checkpoints").exists():
    shutil.rmtree(OUT_DIR / "checkpoints")
    print(f"removed the checkpoints of an earlier run in {OUT_DIR / 'checkpoints'}")
dist.barrier()
manager = checkpoint.CheckpointManager(OUT_DIR / "checkpoints", keep_last=2, async_save=True)

# -----------------------------------------------------------------------------
# training loop: each rank trains on its slice of the global batch
generator = torch.Generator().manual_seed(SEED)  # seeded alike on every rank: all draw the same global batch
losses = []
progress = tqdm(range(1, STEPS + 1), desc="train", unit="step", disable=RANK != 0)
for step in progress:
    tokens, label = (t.chunk(WORLD_SIZE)[RANK] for t in get_batch(train_data, CONTEXT, BATCH, generator))
    loss = trainer.train_step(tokens, label).detach().clone()
    # Each rank's loss is on its slice only; the mean over ranks is the global batch's loss (equal slices).
    # One extra all-reduce of a scalar, for the log only.
    dist.all_reduce(loss)
    losses.append(loss.item() / WORLD_SIZE)
    progress.set_postfix(loss=f"{losses[-1]:.3f}")
    if step % SAVE_EVERY == 0 or step == STEPS:
        # the vocabulary travels with the weights: whoever decodes with them needs no corpus
        manager.save(trainer, step, user_dict={"losses": losses, "chars": "".join(chars)})
progress.close()
seconds = time.perf_counter() - started

# -----------------------------------------------------------------------------
# wait for the last save on every rank: its manifest is agreed over the process group, which must still exist
# (trainer.close() would wait for it too). The trainer created the process group, so trainer.close() destroys
# it; without it, ort_trainer destroys it at exit; had we called dist.init_process_group ourselves, we would
# call dist.destroy_process_group() here instead. Left to interpreter shutdown, gloo can abort the process.
manager.wait()
if RANK != 0:
    trainer.close()
    sys.exit(0)
manifest = Path(manager.latest().path)  # ckpt-<STEPS>.ortcp.manifest.json
print(f"saved {sorted(p.name for p in manifest.parent.glob(manifest.name.split('.')[0] + '.*'))}")

# -----------------------------------------------------------------------------
# rank 0 only: aggregate the per-rank files into one single-process checkpoint. The result loads into a
# trainer of any world size (load_checkpoint also takes the manifest directly and reshards on the fly), or,
# as here, into the plain PyTorch module. The CLI runs in its own process: any machine with the files can.
full = OUT_DIR / "lm-full.ortcp"
command = [sys.executable, "-m", "ort_trainer.checkpoint", "aggregate", str(manifest), "-o", str(full), "--overwrite"]
subprocess.run(command, check=True)
print(f"aggregated {manifest.name} -> {full.name}")

weights = checkpoint.load(full, key="model/full_precision")  # {torch name: tensor}: the legacy layout's weights
model.load_state_dict(weights, strict=True)  # strict: every parameter of the module is in the file, nothing else
live = trainer.state_dict(pytorch_format=True)  # ZeRO shards the optimizer only: every rank holds full weights
same = all(torch.equal(weights[name], live[name]) for name in live)
print(f"aggregated weights equal rank 0's trained weights: {same}")
trainer.close()

# Sampling with temperature and top-k (greedy decoding would repeat one word), seeded: the same text every run.
model.eval()
sampler = torch.Generator().manual_seed(SEED)
ids = generate(model, [chars.index(c) for c in PROMPT], GENERATE_CHARS, CONTEXT, TEMPERATURE, TOP_K, sampler)
generated = "".join(chars[i] for i in ids)
RULE = "-" * 60
print(f"generated:\n{RULE}\n{generated}\n{RULE}")  # once, as it reads
print(
    f"summary: world_size={WORLD_SIZE} zero_stage={ZERO_STAGE} steps={STEPS} first_loss={losses[0]:.4f} "
    f"last_loss={losses[-1]:.4f} train_seconds={seconds:.1f} aggregated={full}"
)
