"""The bare gloo script of the elastic tests: all_reduce steps under torchrun, one SIGKILL (no ort_trainer)."""

from __future__ import annotations

import argparse
import faulthandler
import os
import signal
import time

import torch
import torch.distributed as dist


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--kill-step", type=int, default=0)
    parser.add_argument("--kill-node", default="B")
    args = parser.parse_args()
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    with open(os.path.join(args.out, f"events.rank{rank}"), "a") as f:
        f.write(f"start restart={os.environ.get('TORCHELASTIC_RESTART_COUNT')} node={os.environ.get('ELASTIC_NODE')}\n")
    marker = os.path.join(args.out, "killed")
    for step in range(1, args.steps + 1):
        t = torch.ones(4)
        dist.all_reduce(t)
        time.sleep(0.05)
        if step == args.kill_step and os.environ.get("ELASTIC_NODE") == args.kill_node and not os.path.exists(marker):
            open(marker, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
