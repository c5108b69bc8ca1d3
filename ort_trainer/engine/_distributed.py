"""Data parallel and ZeRO on `torch.distributed`, over the trainer's flat buffers.

One process per rank (torchrun). Gradients are averaged with collectives over buckets of the flat
gradient buffer; ZeRO (reference §3.2) pads the flat buffer to a multiple of ``D * 32`` and gives rank
``r`` the contiguous range ``[r*C, (r+1)*C)``: it keeps optimizer state only for that range, updates
it, and the parameters are all-gathered. Stage 1 all-reduces gradients; stage 2 reduces each chunk
to its owner only (a reduce-scatter; done as per-owner reduces because gloo has no reduce_scatter).

Teardown: a default process group that ort_trainer created is destroyed when the last trainer using it
is closed (`DistributedContext.close`), or else at interpreter exit (an ``atexit`` hook), while Python is
still whole: left to interpreter finalization, gloo's worker threads abort the process
("terminate called without an active exception"). A group the user created is never destroyed by us.

Elastic restarts: under torchrun the group is created in a namespace of the agent's store that only the
ranks of this incarnation use (`_incarnation_store`): torch reuses that store across restarts with the
killed incarnation's keys still in it. ``init_process_group`` offers the same to a custom loop.
"""

from __future__ import annotations

import atexit
import datetime
import logging
import os
import sys
import time
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ort_trainer.checkpoint import PartitionInfo
from ort_trainer.optim import FlatLayout, FlatOptimizer

__all__ = ["DistributedContext", "ShardedOptimizer", "ZeroPartition", "init_process_group"]

logger = logging.getLogger("ort_trainer")

_ALIGNMENT_PER_RANK = 32  # legacy: the flat buffer is padded to a multiple of D * 32
_BUCKET_NUMEL = 8 * 1024 * 1024  # 32 MB of float32 per collective


class DistributedContext:
    """This process's place in the data-parallel group, with the collectives the trainer needs."""

    # the process group of the collectives: None, the default group (a Megatron view: its replicas' group)
    group: dist.ProcessGroup | None = None

    def __init__(self, rank: int, world_size: int, device: torch.device):
        self.rank, self.world_size, self.device = rank, world_size, device
        self._holds_group = _ensure_process_group(rank, world_size, device)
        if self._holds_group:
            _OwnedGroup.holders += 1

    def close(self) -> None:
        """Let go of the process group; the last holder of a group ort_trainer created destroys it. Idempotent."""
        if self._holds_group:
            self._holds_group = False
            _OwnedGroup.holders -= 1
            if _OwnedGroup.holders == 0:
                _OwnedGroup.destroy()

    def broadcast_(self, tensor: torch.Tensor, src: int = 0) -> None:
        for bucket in buckets(tensor):
            dist.broadcast(bucket, src)

    def all_reduce_(self, tensor: torch.Tensor) -> None:
        """Sum over ranks, in place, bucket by bucket (one collective per 32 MB)."""
        for bucket in buckets(tensor):
            dist.all_reduce(bucket, op=dist.ReduceOp.SUM)

    def reduce_to_owners_(self, tensor: torch.Tensor, chunk: int) -> None:
        """Sum chunk ``r`` of ``tensor`` onto rank ``r`` only (stage-2 reduce-scatter)."""
        for owner in range(self.world_size):
            for bucket in buckets(tensor[owner * chunk : (owner + 1) * chunk]):
                dist.reduce(bucket, dst=owner, op=dist.ReduceOp.SUM)

    def all_gather_chunks_(self, tensor: torch.Tensor, chunk: int) -> None:
        """Every rank gets every rank's chunk of ``tensor`` (ZeRO parameter all-gather), in place."""
        parts = [tensor[r * chunk : (r + 1) * chunk] for r in range(self.world_size)]
        dist.all_gather(parts, parts[self.rank].clone())

    def sum_scalar(self, value: float) -> float:
        t = torch.tensor([value], dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return float(t.item())

    def all_gather_objects(self, value) -> list:
        """``value`` from every rank, in rank order (small picklable values only: paths, flags)."""
        gathered = [None] * self.world_size
        dist.all_gather_object(gathered, value)
        return gathered

    def barrier(self) -> None:
        dist.barrier()

    def shared_run_id(self) -> str:
        """One id for all ranks of a save (chosen by rank 0), so files of different runs never mix."""
        box = [uuid.uuid4().hex if self.rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        return str(box[0])


def _ensure_process_group(rank: int, world_size: int, device: torch.device) -> bool:
    """Join the existing default group, or create it; True when it is (or was) ort_trainer's to tear down."""
    if dist.is_available() and dist.is_initialized():
        if dist.get_rank() != rank or dist.get_world_size() != world_size:
            raise ValueError(
                f"options.distributed says world_rank={rank}, world_size={world_size}, but the existing default "
                f"process group has rank {dist.get_rank()} of {dist.get_world_size()}"
            )
        return _OwnedGroup.owns_current()
    missing = [name for name in ("MASTER_ADDR", "MASTER_PORT") if name not in os.environ]
    if missing:
        raise RuntimeError(
            f"world_size={world_size} needs a process group: launch with torchrun, or set {missing} "
            "(and RANK/WORLD_SIZE), or call torch.distributed.init_process_group before creating the trainer"
        )
    _init_default_group("nccl" if device.type == "cuda" else "gloo", rank, world_size)
    _OwnedGroup.adopt(dist.group.WORLD)
    return True


def init_process_group(backend: str | None = None) -> None:
    """Create torch's default process group from torchrun's environment, so that elastic restarts work.

    For a custom loop (``DistributedDataParallel(ORTModule(m))``) in place of
    ``torch.distributed.init_process_group(backend)``: under torchrun (``TORCHELASTIC_USE_AGENT_STORE=True``)
    the ranks of each incarnation agree on a fresh namespace in the agent's store first (see
    :func:`_incarnation_store`), so a rank restarted after a crash or a preemption never reads what the
    killed incarnation left there. Elsewhere (``MASTER_ADDR``/``MASTER_PORT``/``RANK``/``WORLD_SIZE`` set by
    hand) it is torch's call. ``backend``: "gloo" or "nccl" (default: "nccl" when CUDA is available, else
    "gloo"). The group is yours: destroy it with ``torch.distributed.destroy_process_group()``. ORTTrainer
    creates its group this way by itself.
    """
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    if dist.is_initialized():
        raise RuntimeError("the default process group is already initialized (destroy it first to create another)")
    missing = [name for name in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE") if name not in os.environ]
    if missing:
        raise RuntimeError(f"init_process_group needs torchrun's environment: {missing} not set (launch with torchrun)")
    _init_default_group(backend, int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]))


def _init_default_group(backend: str, rank: int, world_size: int) -> None:
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        store = _incarnation_store(rank, world_size)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size)
    else:
        dist.init_process_group(backend, rank=rank, world_size=world_size)


# How long the ranks of one incarnation wait for each other to agree on a namespace (torchrun starts them
# together, after its rendezvous): as long as torchrun's own rendezvous join timeout.
_HANDSHAKE_TIMEOUT_S = 600.0
_HANDSHAKE_POLL_S = 0.02


def _incarnation_store(rank: int, world_size: int, timeout_s: float | None = None):
    """The torchrun agent's store, under a namespace that only this incarnation of the ranks uses.

    Under torchrun's c10d rendezvous the workers' store (``TORCHELASTIC_USE_AGENT_STORE=True``) is hosted
    by the agent of node rank 0 and outlives the workers: torch (2.5 on, pytorch#135712; 2.13 here)
    reuses it across restarts without a per-restart prefix, so after a rank is killed and the group
    restarted, a rank can read its peer's address left by the previous incarnation ("Gloo
    connectFullMesh failed ... Connection refused"), or wait on keys that will never change. Here rank 0
    picks a fresh token and hands it to every other rank by a handshake no leftover key can satisfy:
    rank r announces a fresh nonce, rank 0 answers ``nonce:token``, rank r confirms ``nonce:token``.
    The default group (and every group made from it) then lives under ``ort_trainer/<token>/``.
    """
    timeout_s = _HANDSHAKE_TIMEOUT_S if timeout_s is None else timeout_s
    base = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world_size,
        is_master=False,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    root = "ort_trainer/incarnation"
    deadline = time.monotonic() + timeout_s
    if rank == 0:
        token = uuid.uuid4().hex
        acked: dict[int, str] = {}
        pending = set(range(1, world_size))
        while pending:
            for peer in sorted(pending):
                nonce = _get_if_set(base, f"{root}/join/{peer}")
                if nonce is not None and acked.get(peer) != nonce:
                    base.set(f"{root}/ack/{peer}", f"{nonce}:{token}")
                    acked[peer] = nonce
                if peer in acked and _get_if_set(base, f"{root}/confirm/{peer}") == f"{acked[peer]}:{token}":
                    pending.discard(peer)
            if pending:
                _wait_or_raise(deadline, timeout_s, f"ranks {sorted(pending)} did not join")
    else:
        nonce = uuid.uuid4().hex
        base.set(f"{root}/join/{rank}", nonce)
        while True:
            answer = _get_if_set(base, f"{root}/ack/{rank}")
            if answer is not None and answer.startswith(f"{nonce}:"):
                token = answer.split(":", 1)[1]
                base.set(f"{root}/confirm/{rank}", answer)
                break
            _wait_or_raise(deadline, timeout_s, "rank 0 did not answer")
    logger.debug("rank %d of %d: process group namespace ort_trainer/%s", rank, world_size, token)
    return dist.PrefixStore(f"ort_trainer/{token}", base)


def _get_if_set(store, key: str) -> str | None:
    return store.get(key).decode() if store.check([key]) else None


def _wait_or_raise(deadline: float, timeout_s: float, what: str) -> None:
    if time.monotonic() > deadline:
        raise RuntimeError(
            f"torchrun's ranks did not meet within {timeout_s:g} s ({what}) at MASTER_ADDR="
            f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}: a rank did not start, or "
            "the agents disagree on the rendezvous"
        )
    time.sleep(_HANDSHAKE_POLL_S)


class _OwnedGroup:
    """The default process group ort_trainer created, its live holders, and the exit hook that destroys it."""

    group = None
    holders = 0
    _hooked = False

    @classmethod
    def adopt(cls, group) -> None:
        cls.group, cls.holders = group, 0
        if not cls._hooked:
            atexit.register(cls.destroy_at_exit)
            cls._hooked = True

    @classmethod
    def owns_current(cls) -> bool:
        return cls.group is not None and cls.group is dist.group.WORLD

    @classmethod
    def destroy(cls) -> None:
        """Destroy our group if it is still the default one (a user may have destroyed it already)."""
        if cls.owns_current() and dist.is_initialized():
            dist.destroy_process_group()
        cls.group, cls.holders = None, 0

    @classmethod
    def destroy_at_exit(cls) -> None:
        # After an uncaught exception a peer may still wait in a collective with us, and destroying can block
        # until gloo's timeout: exit as before then (torchtitan's rule: tear down only on a clean exit).
        if getattr(sys, "last_exc", None) is None and getattr(sys, "last_value", None) is None:
            cls.destroy()


def buckets(tensor: torch.Tensor) -> Iterator[torch.Tensor]:
    """Views of ``tensor`` (flattened) of at most 32 MB each: the pieces one collective sends at a time."""
    flat = tensor.view(-1)
    for start in range(0, flat.numel(), _BUCKET_NUMEL):
        yield flat[start : start + _BUCKET_NUMEL]


@dataclass(frozen=True)
class _Piece:
    name: str
    start: int  # offset of the piece within the flattened parameter
    numel: int
    shape: tuple[int, ...]  # the parameter's full shape

    @property
    def whole(self) -> bool:
        return self.start == 0 and self.numel == _prod(self.shape)


class ZeroPartition:
    """Which contiguous range of the (padded) flat buffer each data-parallel rank owns."""

    def __init__(self, layout: FlatLayout, world_size: int, rank: int):
        alignment = world_size * _ALIGNMENT_PER_RANK
        self.total = layout.numel
        self.padded = -(-self.total // alignment) * alignment
        self.chunk = self.padded // world_size
        self.rank, self.world_size = rank, world_size
        self.all_names = frozenset(layout.names)
        self.start = min(rank * self.chunk, self.total)
        self.end = min((rank + 1) * self.chunk, self.total)
        self.pieces = [p for p in (_piece(slot, self.start, self.end) for slot in layout.slots) if p is not None]
        self.straddling = {slot.name for slot in layout.slots if _crosses_boundary(slot, self.chunk)}

    def local_layout(self) -> FlatLayout:
        return FlatLayout([(p.name, p.shape if p.whole else (p.numel,)) for p in self.pieces])

    def partition_info(self) -> dict[str, dict]:
        """Legacy ``partition_info`` for this rank's straddling pieces, with our ``offset`` key."""
        return {
            p.name: PartitionInfo(original_dim=tuple(p.shape), megatron_row_partition=-1, offset=p.start).to_tree()
            for p in self.pieces
            if p.name in self.straddling
        }


def _piece(slot, start: int, end: int) -> _Piece | None:
    lo, hi = max(slot.offset, start), min(slot.offset + slot.numel, end)
    return _Piece(slot.name, lo - slot.offset, hi - lo, tuple(slot.shape)) if hi > lo else None


def _crosses_boundary(slot, chunk: int) -> bool:
    return slot.numel > 0 and slot.offset // chunk != (slot.offset + slot.numel - 1) // chunk


def _prod(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


class ShardedOptimizer:
    """`FlatOptimizer` over this rank's ZeRO range, speaking the per-rank legacy state layout.

    State entries of parameters wholly inside the range keep their shape; straddling parameters have
    1-D pieces. ``load_state_dict`` also accepts full (single-process) entries and slices them.
    """

    def __init__(self, config, partition: ZeroPartition, params: torch.Tensor, grads: torch.Tensor):
        self.partition = partition
        self.layout = partition.local_layout()
        self._inner = FlatOptimizer(
            config, self.layout, params[partition.start : partition.end], grads[partition.start : partition.end]
        )
        self.config = config

    def set_idle(self, names) -> None:
        """Parameters the graph does not use are never updated (see `FlatOptimizer.set_idle`)."""
        self._inner.set_idle([name for name in names if name in self.layout])

    def step(self, lr: float, *, loss_scale: float = 1.0, clip: bool = True, grad_norm: float | None = None) -> None:
        if self.layout.numel:
            self._inner.step(lr, loss_scale=loss_scale, clip=clip, grad_norm=grad_norm)

    def state_dict(self, *, copy: bool = True) -> dict:
        return self._inner.state_dict(copy=copy)

    def update_count(self) -> int | None:
        """This rank's counter, None when it owns no parameters (or SGD)."""
        return self._inner.update_count()

    def set_update_count(self, count: int) -> None:
        self._inner.set_update_count(count)

    def local_moments(self):
        """The moment buffers of this rank's range (None for SGD)."""
        return self._inner.moments()

    def validate_state_dict(self, state: Mapping, *, strict: bool = True, where: str = "state_dict[optimizer]"):
        self._inner.validate_state_dict(self._localize(state), strict=strict, where=where)

    def load_state_dict(self, state: Mapping, strict: bool = True) -> None:
        self._inner.load_state_dict(self._localize(state), strict=strict)

    def incompatible_keys(self, state: Mapping, where: str = "optimizer") -> tuple[list[str], list[str]]:
        """(missing, unexpected) for this rank's range (entries other ranks own are not missing here)."""
        return self._inner.incompatible_keys(self._localize(state), where)

    def _localize(self, state: Mapping) -> dict:
        """Slice full-shaped moments down to this rank's pieces; drop the entries other ranks own."""
        pieces = {p.name: p for p in self.partition.pieces}
        local = {}
        for name, entry in state.items():
            if name in pieces and isinstance(entry, Mapping):
                local[name] = {key: _slice_moment(value, pieces[name]) for key, value in entry.items()}
            elif name not in self.partition.all_names:
                local[name] = entry  # shared state, or an unknown key that validation will report
        return local


def _slice_moment(value, piece: _Piece):
    if not isinstance(value, torch.Tensor) or piece.whole or tuple(value.shape) != piece.shape:
        return value
    return value.reshape(-1)[piece.start : piece.start + piece.numel]
