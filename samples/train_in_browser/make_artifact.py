"""Write the training artifact that samples/train_in_browser/index.html fine-tunes in the browser.

    python samples/train_in_browser/make_artifact.py                     # pretrain 200 steps, then export
    python samples/train_in_browser/make_artifact.py --pretrain-steps 0  # export the untrained model (quick)

The model is the character-level transformer of samples/model.py. It is pretrained here for a few steps with
ORTTrainer on samples/data/corpus.txt (GNU license texts), then ``ort_trainer.export_training`` writes the
trainer as it stands (weights, Adam moments, update count) to OUT (default: artifact/ beside this file):
manifest.json, train_step.onnx, eval_step.onnx and state.safetensors, plus vocab.json, the characters the page
maps text to (the driver ignores files the manifest does not name).
"""

import argparse
import json
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # samples/model.py, shared with the other samples
from model import CharTransformer, get_batch, lm_loss, load_corpus  # noqa: E402

from ort_trainer import ORTTrainer, export_training, optim  # noqa: E402

SEED = 1337
CONTEXT = 32  # characters per window: every batch the page makes is this long
D_MODEL, HEADS, LAYERS, DROPOUT = 48, 4, 2, 0.1
BATCH = 16
LR = 3e-3

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--out", type=Path, default=HERE / "artifact", help="the artifact folder (replaced)")
parser.add_argument("--pretrain-steps", type=int, default=200, help="ORTTrainer steps before the export")
args = parser.parse_args()

torch.manual_seed(SEED)
chars, data = load_corpus(HERE.parent / "data" / "corpus.txt")
model = CharTransformer(len(chars), CONTEXT, D_MODEL, HEADS, LAYERS, DROPOUT)
model_desc = {
    "inputs": [("tokens", ["batch", CONTEXT]), ("label", ["batch", CONTEXT])],
    "outputs": [("loss", [], True)],
}
config = optim.AdamConfig(lr=LR, lambda_coef=0.01, max_norm_clip=1.0)
trainer = ORTTrainer(model, model_desc, config, loss_fn=lm_loss, options={"utils": {"grad_norm_clip": True}})
generator = torch.Generator().manual_seed(SEED)
for step in range(1, args.pretrain_steps + 1):
    loss = trainer.train_step(*get_batch(data, CONTEXT, BATCH, generator)).item()
    if step % 50 == 0 or step == args.pretrain_steps:
        print(f"pretrain step {step}: loss {loss:.3f}")
export_training(trainer, args.out, inputs=get_batch(data, CONTEXT, BATCH, generator), overwrite=True)
(args.out / "vocab.json").write_text(json.dumps({"chars": "".join(chars), "context": CONTEXT}))
print(f"artifact: {args.out} ({sum(p.numel() for p in model.parameters()):,} parameters, vocab {len(chars)})")
