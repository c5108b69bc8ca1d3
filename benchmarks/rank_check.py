"""Cost of the per-step rank agreement check (`ort_trainer.engine._rank_check`).

Every ``train_step`` on W > 1 ranks runs one all-gather of 4 int64 per rank (launched before the
forward/backward, waited for after it), so that a ``load_state_dict`` / ``load_checkpoint`` run on only
some ranks raises on every rank instead of leaving them with different states. This measures it on 2
ranks (gloo, 127.0.0.1): interleaved rounds of ``train_step`` with the check and with it switched off
(the same trainer), medians; and the check alone, not overlapped.

    python benchmarks/rank_check.py                   # MLP 784-1024-10, batch 64/rank, 7 rounds x 20 steps
    python benchmarks/rank_check.py --rounds 3 --steps 10
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

REPO = Path(__file__).resolve().parents[1]


def _rank(rounds: int, steps: int) -> None:
    import torch
    import torch.distributed as dist

    import ort_trainer.engine._rank_check as state
    from ort_trainer import ORTTrainer, optim

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(784, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 10))
    desc = {"inputs": [("x", ["batch", 784]), ("label", ["batch"])], "outputs": [("loss", [], True)]}
    trainer = ORTTrainer(model, desc, optim.AdamConfig(lr=1e-3), loss_fn=torch.nn.functional.cross_entropy)
    x, y = torch.randn(64, 784), torch.randint(0, 10, (64,))
    original = state.start_rank_check
    off = lambda trainer: None  # noqa: E731  (no check launched: finish_rank_check(None) does nothing)
    times = {"with check": [], "without": []}
    for _ in range(3):
        trainer.train_step(x, y)
    for _ in range(rounds):
        for label, check in (("with check", original), ("without", off)):
            state.start_rank_check = check
            start = time.perf_counter()
            for _ in range(steps):
                trainer.train_step(x, y)
            times[label].append((time.perf_counter() - start) / steps * 1e3)
    state.start_rank_check = original
    start = time.perf_counter()
    for _ in range(200):
        state.check_ranks_agree(trainer.trainer_state)
    alone = (time.perf_counter() - start) / 200 * 1e3
    if rank == 0:
        with_check, without = statistics.median(times["with check"]), statistics.median(times["without"])
        print(f"2 ranks (gloo), MLP 784-1024-10, batch 64/rank; {rounds} rounds x {steps} steps, medians (min)")
        print("| contender | ms/step | x without |")
        print("|---|---|---|")
        for label, values in times.items():
            med = statistics.median(values)
            print(f"| train_step {label} | {med:.2f} ({min(values):.2f}) | {med / without:.3f} |")
        print(f"| the check alone | {alone:.3f} | |")
        print(f"overhead: {with_check - without:+.3f} ms/step")
    del world
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        _rank(args.rounds, args.steps)
        return
    from benchmarks._common import print_host_stamp  # here: worker processes must not import it

    print_host_stamp()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(2):
        env = {
            **os.environ,
            "RANK": str(rank),
            "WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": str(REPO),
        }
        cmd = [sys.executable, __file__, "--worker", "--rounds", str(args.rounds), "--steps", str(args.steps)]
        procs.append(subprocess.Popen(cmd, env=env))
    codes = [p.wait(timeout=1200) for p in procs]
    if any(codes):
        raise SystemExit(f"ranks failed: {codes}")


if __name__ == "__main__":
    main()
