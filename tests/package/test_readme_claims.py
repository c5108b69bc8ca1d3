"""Claims of README.md's prose that a code block alone does not check, each against PyTorch or the repository."""

from __future__ import annotations

import ast
import copy
import re

import torch

from ort_trainer import ORTTrainer, optim
from tests.paths import REPO

README = (REPO / "README.md").read_text(encoding="utf-8")
F = torch.nn.functional


def _readme_mlp_run(options: dict | None, steps: int = 30):
    """The README's usage example (its MLP, AdamConfig line and model_desc), ``steps`` steps of batch 32; inputs
    of scale 4, whose gradient norms exceed 1 (where clipping acts)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(20, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    desc = {"inputs": [("x", ["batch", 20]), ("label", ["batch"])], "outputs": [("loss", [], True)]}
    config = optim.AdamConfig(lr=1e-3, lambda_coef=0.01)
    trainer = ORTTrainer(copy.deepcopy(model), desc, config, loss_fn=F.cross_entropy, options=options)
    g = torch.Generator().manual_seed(1)
    batches = [(4 * torch.randn(32, 20, generator=g), torch.randint(0, 4, (32,), generator=g)) for _ in range(steps)]
    for x, label in batches:
        trainer.train_step(x, label)
    return model, batches, trainer.state_dict(pytorch_format=True)


def _torch_adamw(model, batches, clip: bool) -> dict[str, torch.Tensor]:
    model = copy.deepcopy(model)
    adamw = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    for x, label in batches:
        adamw.zero_grad()
        F.cross_entropy(model(x), label).backward()
        if clip:  # ours: g * min(1, max_norm / norm) (clip_grad_norm_ divides by norm + 1e-6)
            norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()]))
            for p in model.parameters():
                p.grad.mul_(min(1.0, 1.0 / norm.item()))
        adamw.step()
    return model.state_dict()


def _max_difference(a: dict, b: dict) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in b)


def test_the_usage_examples_adam_is_adamw_after_global_norm_clipping():
    """README: ``AdamConfig(lr=1e-3, lambda_coef=0.01)  # torch.optim.AdamW, after clipping ...``: clipping is on by
    default (utils.grad_norm_clip, max_norm_clip=1.0), as in the legacy trainer, and the comment says so."""
    line = next(line for line in README.splitlines() if "optim.AdamConfig(lr=1e-3, lambda_coef=0.01)" in line)
    assert "torch.optim.AdamW" in line and "clip" in line, line
    model, batches, clipped = _readme_mlp_run(None)
    assert _max_difference(clipped, _torch_adamw(model, batches, clip=True)) < 1e-6
    assert _max_difference(clipped, _torch_adamw(model, batches, clip=False)) > 1e-4  # the comment is needed
    _, _, unclipped = _readme_mlp_run({"utils": {"grad_norm_clip": False}})
    assert _max_difference(unclipped, _torch_adamw(model, batches, clip=False)) < 1e-6


def test_the_samples_section_lists_every_sample():
    """README's "## Samples" table has a row per script of samples/ (model.py is their shared module)."""
    section = README.split("## Samples", 1)[1].split("\n## ", 1)[0]
    listed = set(re.findall(r"^\| `([a-z_]+\.py|[a-z_]+/)` \|", section, flags=re.MULTILINE))
    scripts = {p.name for p in (REPO / "samples").glob("*.py")} - {"model.py"}
    # a sample folder (the browser page); data/ is the corpus the scripts share
    pages = {f"{p.parent.name}/" for p in (REPO / "samples").glob("*/README.md")} - {"data/"}
    assert listed == scripts | pages, (listed, scripts | pages)


def test_the_install_section_names_every_extra():
    """Each extra of setup.py appears in README's "## Install" (`.[name]` in its commands or `name` in its prose):
    `hf` was missing, so `from ort_trainer.hf import Trainer` met users with no word of how to install it."""
    tree = ast.parse((REPO / "setup.py").read_text(encoding="utf-8"))
    extras = next(
        ast.literal_eval(node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "EXTRAS_REQUIRE" for t in node.targets)
    )
    section = README.split("## Install", 1)[1].split("\n## ", 1)[0]
    missing = sorted(name for name in extras if f".[{name}]" not in section and f"`{name}`" not in section)
    assert not missing, missing
