"""Kill it anytime, run it again, it continues: resume from the latest checkpoint, bit for bit.

    python samples/resume_lm.py                 # train; Ctrl-C or kill -9 it whenever you like, then run it again
    python samples/resume_lm.py --demo          # the staged crash below: under a minute on 2 CPU cores
    python samples/resume_lm.py --demo --steps 20 --save-every 5 --kill-at 13 --out /tmp/resume   # what the tests run

A training run of the character LM of samples/train_lm.py that checkpoints through a CheckpointManager:
every SAVE_EVERY steps it saves asynchronously (the loop waits only for a copy of the state; the file is
written, checksummed, fsynced and published in the background), keeps the last two checkpoints and the one
with the lowest loss, and stores the loss history in the checkpoint's user_dict. Started again on the same
folder, the run restores the newest complete checkpoint (a save that was killed half-way is skipped; a
damaged file is skipped with a warning) and trains on; a run that had finished has nothing left to train. Delete
OUT_DIR/checkpoints (or pass another --out) to start over; --demo starts its runs over itself.

--demo stages a crash. The parent starts a run (this file, in a child process) and kills it with SIGKILL when
it reports step KILL_AT, as a preempted machine or the OOM killer would: no handler runs, nothing is flushed,
and the kill lands wherever the run is, a background save included. A second child on the same folder
resumes; a third trains STEPS steps without interruption, for reference. The parent draws both loss curves
into OUT_DIR/resume.png and prints the largest difference between them: 0.0, because everything a step
depends on is either in the checkpoint (weights, Adam moments and counters, the LR schedule's position, the
run's random seed that the dropout masks come from) or a pure function of the step number (the batch).
"""

import argparse
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import matplotlib.pyplot as plt
import torch
from model import CharTransformer, get_batch, lm_loss, load_corpus
from tqdm import tqdm

from ort_trainer import ORTTrainer, checkpoint, optim

plt.switch_backend("Agg")  # no display needed (CI machines have none): we only write a PNG

# -----------------------------------------------------------------------------
# settings: the model and optimizer of samples/train_lm.py; fewer steps, since three runs share the time
SEED = 1337
DATA = Path(__file__).resolve().parent / "data" / "corpus.txt"
OUT_DIR = "out/resume"  # git-ignored
CONTEXT = 64
BATCH = 16
D_MODEL = 64
LAYERS = 2
HEADS = 4
DROPOUT = 0.1  # kept: the trainer draws step n's masks from the checkpointed seed and n (docs/reproducibility.md)
STEPS = 200
LR = 1e-2
WARMUP = 0.05
WEIGHT_DECAY = 0.01
BETA2 = 0.99
SAVE_EVERY = 50  # a real job would save every so many minutes; here a few checkpoints are enough to choose from
KILL_AT = 130  # --demo: the steps after the last complete checkpoint are lost with the process and redone

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--steps", type=int, default=STEPS, help=f"optimizer steps (default {STEPS})")
parser.add_argument("--save-every", type=int, default=SAVE_EVERY, help=f"steps between checkpoints ({SAVE_EVERY})")
parser.add_argument("--out", default=OUT_DIR, help=f"folder for checkpoints (and resume.png) (default {OUT_DIR}/)")
parser.add_argument("--demo", action="store_true", help="stage a crash: kill a run, resume it, compare")
parser.add_argument("--kill-at", type=int, default=KILL_AT, help=f"--demo: the step at which the run dies ({KILL_AT})")
parser.add_argument("--no-progress", action="store_true", help="no progress bar (--demo's runs: it relays their lines)")
args = parser.parse_args()
STEPS, SAVE_EVERY, KILL_AT, OUT_DIR = args.steps, args.save_every, args.kill_at, Path(args.out)
if args.demo and not 0 < KILL_AT < STEPS:
    parser.error(f"need 0 < --kill-at < --steps, got {KILL_AT}, {STEPS}")

# =============================================================================
# --demo (the parent process): crash, resume, reference, compare
if args.demo:
    started = time.perf_counter()

    def run_child(name, out, kill_at=0):
        """Run one training process on folder `out`; SIGKILL it when it reports step `kill_at` (0: never).
        The child does not wait for the kill: it trains on, so the kill lands wherever it is. Returns the exit code."""
        command = [sys.executable, __file__, "--steps", str(STEPS), "--save-every", str(SAVE_EVERY), "--out", str(out),
                   "--no-progress"]  # a child's bar would share the terminal with the lines relayed here
        child = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
        try:
            for line in child.stdout:
                print(f"[{name}] {line}", end="", flush=True)
                if kill_at and line.strip() == f"step {kill_at}":
                    child.kill()  # SIGKILL on POSIX
            return child.wait()
        finally:
            if child.poll() is None:
                child.kill()
                child.wait()

    run_dir, reference_dir = OUT_DIR / "run", OUT_DIR / "reference"
    for folder in (run_dir, reference_dir):  # checkpoints from an earlier demo would be resumed
        shutil.rmtree(folder, ignore_errors=True)
    code = run_child("crash run", run_dir, kill_at=KILL_AT)
    if code != -signal.SIGKILL:
        sys.exit(f"the first run should have died of SIGKILL (exit code {-signal.SIGKILL}), got {code}")
    survivors = [c.step for c in checkpoint.CheckpointManager(run_dir / "checkpoints").checkpoints()]
    print(f"first run killed after step {KILL_AT}; complete checkpoints of steps {survivors}")
    for name, folder in (("resumed run", run_dir), ("reference run", reference_dir)):
        code = run_child(name, folder)
        if code != 0:
            sys.exit(f"the {name} failed with exit code {code}")

    # The final checkpoints hold everything to compare: the loss history (user_dict) and the weights.
    # Reading them needs no trainer: checkpoint.load reads any subtree of the HDF5 file.
    final_run = checkpoint.CheckpointManager(run_dir / "checkpoints").latest().path
    final_reference = checkpoint.CheckpointManager(reference_dir / "checkpoints").latest().path
    resumed = checkpoint.decode_user_dict(checkpoint.load(final_run, key="user_dict"))
    reference = checkpoint.decode_user_dict(checkpoint.load(final_reference, key="user_dict"))
    resumed_from = resumed["resumed_from"]
    loss_diff = max(abs(a - b) for a, b in zip(resumed["losses"], reference["losses"], strict=True))
    weights_a = checkpoint.load(final_run, key="model/full_precision")
    weights_b = checkpoint.load(final_reference, key="model/full_precision")
    weight_diff = max(float((weights_a[name] - weights_b[name]).abs().max()) for name in weights_b)

    png = OUT_DIR / "resume.png"
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=110)
    steps = range(1, STEPS + 1)
    ax.plot(steps, reference["losses"], color="lightgrey", linewidth=5, label="uninterrupted run")
    ax.plot(steps[:resumed_from], resumed["losses"][:resumed_from], color="tab:blue", linewidth=1,
            label=f"first run (history from the step-{resumed_from} checkpoint)")
    ax.plot(steps[resumed_from:], resumed["losses"][resumed_from:], color="tab:orange", linewidth=1,
            label=f"resumed run, steps {resumed_from + 1}-{STEPS}")
    ax.axvspan(resumed_from, KILL_AT, color="tab:red", alpha=0.12,
               label=f"trained, then lost to SIGKILL after step {KILL_AT} (redone)")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("train loss (nats / character)")
    ax.set_title(f"Resumed from a checkpoint: max |loss difference| = {loss_diff:g}")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png)
    plt.close(fig)

    print(f"max abs difference, resumed vs uninterrupted: losses {loss_diff!r}, final weights {weight_diff!r}")
    print(f"summary: steps={STEPS} killed_at={KILL_AT} resumed_from={resumed_from} loss_diff={loss_diff!r} "
          f"weight_diff={weight_diff!r} seconds={time.perf_counter() - started:.1f} png={png}")
    sys.exit(0)

# =============================================================================
# one training run: continue from the newest checkpoint in OUT_DIR/checkpoints if there is one
torch.manual_seed(SEED)

chars, data = load_corpus(DATA)
train_data = data[: int(len(data) * 0.9)]  # the same split as train_lm.py (the tail is never trained on)


def batch_of_step(step):
    """The batch of a step is a function of the step alone, so a resumed run needs no data-loader state.
    (With one generator for the whole run, its state would have to go into the checkpoint too.)"""
    return get_batch(train_data, CONTEXT, BATCH, torch.Generator().manual_seed(SEED * 100_000 + step))


# The model of samples/train_lm.py (samples/model.py)
model = CharTransformer(len(chars), CONTEXT, D_MODEL, HEADS, LAYERS, DROPOUT)
model_desc = {
    "inputs": [("tokens", ["batch", "seq"]), ("label", ["batch", "seq"])],
    "outputs": [("loss", [], True)],
}
no_decay = [name for name, p in model.named_parameters() if p.dim() < 2]
optim_config = optim.AdamConfig(
    params=[{"params": no_decay, "lambda_coef": 0.0}], lr=LR, beta=BETA2, lambda_coef=WEIGHT_DECAY, max_norm_clip=1.0
)
# The scheduler's position is in the checkpoint (lr_scheduler/...), so the resumed run continues the cosine
# where the first run left it instead of warming up again.
scheduler = optim.lr_scheduler.CosineWarmupLRScheduler(total_steps=STEPS, cycles=0.5, warmup=WARMUP)
# deterministic_compute asks ONNX Runtime for kernels whose results do not depend on thread scheduling.
# Without it this demo happened to resume exactly too on a 2-core machine, but nothing guarantees that.
trainer = ORTTrainer(
    model, model_desc, optim_config, loss_fn=lm_loss,
    options={"lr_scheduler": scheduler, "utils": {"grad_norm_clip": True}, "debug": {"deterministic_compute": True}},
)

# Two lines give a run that survives any kill: a manager over a folder, and restore() before the loop.
# async_save: the loop waits only while the state is copied; writing, checksums, fsync and publishing run in
# the background. keep_last=2 and the best loss are kept; older checkpoints are pruned once a newer is durable.
manager = checkpoint.CheckpointManager(
    OUT_DIR / "checkpoints", keep_last=2, keep_best=("loss", "min", 1), async_save=True
)
restored = manager.restore(trainer)  # the newest complete checkpoint; None on a fresh start
losses, resumed_from = [], 0
if restored is not None:
    # load_checkpoint verified every checksum before it touched the trainer. The loaded state waits for the
    # graphs, built at the first step, so trainer.train_step_info still says 0 here: restored.step is the step.
    losses, resumed_from = list(restored.user_dict["losses"]), restored.step
    print(f"resuming from {Path(restored.path).name} (step {resumed_from})", flush=True)
else:
    print("starting fresh", flush=True)
if resumed_from >= STEPS:
    print(f"the checkpoint is at step {resumed_from}, --steps is {STEPS}: nothing to train", flush=True)

progress = tqdm(range(resumed_from + 1, STEPS + 1), desc="train", unit="step", initial=resumed_from, total=STEPS,
                disable=args.no_progress)
for step in progress:
    loss = trainer.train_step(*batch_of_step(step)).item()
    losses.append(loss)
    progress.set_postfix(loss=f"{loss:.3f}")
    print(f"step {step}", flush=True)
    if step % SAVE_EVERY == 0 or step == STEPS:
        manager.save(trainer, step, metrics={"loss": loss},
                     user_dict={"losses": losses, "resumed_from": resumed_from})
progress.close()
manager.wait()  # the last save is published before we say so (exiting would wait for it too)
print(f"done: step {max(resumed_from, STEPS)}, last loss {losses[-1]:.4f}", flush=True)
