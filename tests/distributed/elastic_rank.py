"""What the two elastic-restart workers share (``elastic_worker``: ORTTrainer; ``elastic_ortmodule_worker``: a
custom loop): their arguments, the line each incarnation logs, and the one-time SIGKILL after step k."""

from __future__ import annotations

import argparse
import faulthandler
import os
import signal


def parse_args() -> argparse.Namespace:
    """``--dir`` ``--out`` ``--steps`` ``--save-every`` ``--kill-step`` ``--kill-node``; stacks on SIGUSR1."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", required=True, help="the CheckpointManager's directory")
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--save-every", type=int, default=2)
    parser.add_argument("--kill-step", type=int, default=0)
    parser.add_argument("--kill-node", default="B")
    args = parser.parse_args()
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the harness asks for stacks before a timeout kill
    return args


def log_start(args: argparse.Namespace, rank: int, start: int) -> None:
    """One line per incarnation in ``--out/events.rank<r>``: the restored step, the restart count, the node."""
    with open(os.path.join(args.out, f"events.rank{rank}"), "a") as f:
        restart, node = os.environ.get("TORCHELASTIC_RESTART_COUNT"), os.environ.get("ELASTIC_NODE")
        f.write(f"start restored={start} restart={restart} node={node} pid={os.getpid()}\n")


def kill_once_after(args: argparse.Namespace, step: int) -> None:
    """SIGKILL this rank after ``--kill-step`` on ``--kill-node``, in the first incarnation only (a marker file)."""
    marker = os.path.join(args.out, "killed")
    if step == args.kill_step and os.environ.get("ELASTIC_NODE") == args.kill_node and not os.path.exists(marker):
        open(marker, "w").close()
        os.kill(os.getpid(), signal.SIGKILL)
