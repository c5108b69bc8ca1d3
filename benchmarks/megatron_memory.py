"""Per-rank parameter + optimizer memory of Megatron (horizontal parallel) training, h = 1, 2, 4.

Builds an ORTTrainer over a GPT-2 built from a config (n_embd 256, 4 layers, 4 heads, vocab 1000) on
h local gloo ranks and runs one train_step (so the graphs exist), then counts on each rank the float
elements of its trainable state (flat parameter buffer) and of its optimizer state (Adam moments),
for the split blocks and for the rest. Memory of the split blocks should fall as 1/h; the rest
(embeddings, LayerNorms, the LM head) is replicated.

    python benchmarks/megatron_memory.py              # h = 1, 2, 4
    python benchmarks/megatron_memory.py --h 1 2
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _rank(h: int) -> None:
    import torch
    import transformers

    from ort_trainer import ORTTrainer, optim

    class GPT2(torch.nn.Module):
        def __init__(self):
            super().__init__()
            config = transformers.GPT2Config(
                n_layer=4, n_embd=256, n_head=4, vocab_size=1000, n_positions=64, resid_pdrop=0.0,
                embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="eager",
            )  # fmt: skip
            self.model = transformers.GPT2LMHeadModel(config)

        def forward(self, input_ids, attention_mask):
            return self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits

    def loss_fn(logits, label):
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), label.reshape(-1))

    torch.manual_seed(0)
    inputs = [("input_ids", ["b", "s"]), ("attention_mask", ["b", "s"]), ("label", ["b", "s"])]
    desc = {"inputs": inputs, "outputs": [("loss", [], True)]}
    options = {"distributed": {"horizontal_parallel_size": h}}
    trainer = ORTTrainer(GPT2(), desc, optim.AdamConfig(lr=1e-3), loss_fn=loss_fn, options=options)
    tokens = torch.randint(0, 1000, (2, 33))
    trainer.train_step(tokens[:, :-1].contiguous(), torch.ones(2, 32, dtype=torch.int64), tokens[:, 1:].contiguous())
    store = trainer.trainer_state.store  # the live buffers
    split = set(trainer.trainer_state.horizontal.specs) if h > 1 else _split_names(store.param_views)
    counts = {"split_params": 0, "other_params": 0, "split_optimizer": 0, "other_optimizer": 0}
    for name, tensor in store.param_views.items():
        counts["split_params" if name in split else "other_params"] += tensor.numel()
    for name, entry in store.optimizer.state_dict().items():
        if not isinstance(entry, dict):
            continue
        for key, value in entry.items():
            if key.startswith("Moment"):
                counts["split_optimizer" if name in split else "other_optimizer"] += value.numel()
    if int(os.environ.get("RANK", 0)) == 0:
        print(json.dumps(counts))
    trainer.close()


def _split_names(names) -> set[str]:
    marks = ("attn.c_attn", "attn.c_proj.weight", "mlp.c_fc", "mlp.c_proj.weight")
    return {n for n in names if any(m in n for m in marks)}


def _launch(h: int) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(h):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(h), "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}  # fmt: skip
        procs.append(subprocess.Popen([sys.executable, __file__, "--rank", str(h)], cwd=REPO, env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True))  # fmt: skip
    outputs = [p.communicate(timeout=600)[0] for p in procs]
    if any(p.returncode for p in procs):
        raise SystemExit(f"h={h}: a rank failed")
    return json.loads(outputs[0].strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--h", type=int, nargs="*", default=[1, 2, 4])
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank is not None:
        _rank(args.rank)
        return
    base = None
    print("h  split params  split optimizer  other params  other optimizer  (float elements per rank)")
    for h in args.h:
        c = _launch(h)
        base = base or c
        ratio = (c["split_params"] + c["split_optimizer"]) / (base["split_params"] + base["split_optimizer"])
        print(f"{h}  {c['split_params']:>12,}  {c['split_optimizer']:>15,}  {c['other_params']:>12,}  "
              f"{c['other_optimizer']:>15,}  split x{ratio:.3f} of h={args.h[0]}")  # fmt: skip


if __name__ == "__main__":
    main()
