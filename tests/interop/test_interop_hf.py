"""Real models nobody here wrote: Hugging Face ``transformers`` GPT-2, BERT, T5 and ViT from tiny configs.

Each trains a few steps on ORT and in eager PyTorch with ``torch.optim.AdamW`` (losses and weights compared),
saves a checkpoint midway, a fresh trainer over a freshly built HF model loads it and continues (bit-identical
to the uninterrupted run), and the trained weights go back into a plain HF module with ``strict=True``.
Nothing is downloaded: every model is built from a config. Dims are dynamic (``"batch"``, ``"seq"``).
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import transformers

from ort_trainer import ORTTrainer, optim
from tests.hf_tiny import tiny_gpt2_config

STEPS, SPLIT = 4, 2
# eps 1e-5: Adam divides by sqrt(v) + eps, so with eps 1e-8 a parameter whose gradient is rounding noise
# (a key bias: softmax ignores it) moves by +-lr in a direction the noise picks, in torch and ORT differently.
LR, DECAY, EPS = 1e-3, 0.01, 1e-5
VOCAB = 64
ce = torch.nn.functional.cross_entropy


def _tokens(g, *shape):
    return torch.randint(1, VOCAB, shape, generator=g)


def gpt2():
    config = tiny_gpt2_config(VOCAB)
    desc = {"inputs": [("input_ids", ["batch", "seq"]), ("labels", ["batch", "seq"])], "outputs": [("loss", [], True)]}

    def batch(g):
        ids = _tokens(g, 2, 9)
        return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()

    return (
        transformers.GPT2LMHeadModel,
        config,
        desc,
        lambda out, y: ce(out.logits.reshape(-1, VOCAB), y.reshape(-1)),
        batch,
    )


def bert():
    config = transformers.BertConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=16,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        num_labels=3,
    )
    desc = {"inputs": [("input_ids", ["batch", "seq"]), ("labels", ["batch"])], "outputs": [("loss", [], True)]}
    return (
        transformers.BertForSequenceClassification,
        config,
        desc,
        lambda out, y: ce(out.logits, y),
        lambda g: (_tokens(g, 2, 8), torch.randint(0, 3, (2,), generator=g)),
    )


def t5():
    config = transformers.T5Config(
        vocab_size=VOCAB,
        d_model=32,
        d_kv=16,
        d_ff=64,
        num_layers=2,
        num_heads=2,
        dropout_rate=0.0,
        decoder_start_token_id=0,
        pad_token_id=0,
    )
    inputs = [
        ("input_ids", ["batch", "seq"]),
        ("attention_mask", ["batch", "seq"]),
        ("decoder_input_ids", ["batch", "target"]),
        ("labels", ["batch", "target"]),
    ]
    desc = {"inputs": inputs, "outputs": [("loss", [], True)]}

    def batch(g):
        target = _tokens(g, 2, 6)
        decoder_inputs = torch.cat([torch.zeros(2, 1, dtype=torch.int64), target[:, :-1]], dim=1)
        return _tokens(g, 2, 8), torch.ones(2, 8, dtype=torch.int64), decoder_inputs, target

    return (
        transformers.T5ForConditionalGeneration,
        config,
        desc,
        lambda out, y: ce(out.logits.reshape(-1, VOCAB), y.reshape(-1)),
        batch,
    )


def vit():
    config = transformers.ViTConfig(
        image_size=16,
        patch_size=4,
        num_channels=3,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        num_labels=3,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    desc = {"inputs": [("pixel_values", ["batch", 3, 16, 16]), ("labels", ["batch"])], "outputs": [("loss", [], True)]}
    return (
        transformers.ViTForImageClassification,
        config,
        desc,
        lambda out, y: ce(out.logits, y),
        lambda g: (torch.randn(2, 3, 16, 16, generator=g), torch.randint(0, 3, (2,), generator=g)),
    )


MODELS = {"gpt2": gpt2, "bert": bert, "t5": t5, "vit": vit}


def _build(cls, config, seed):
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return cls(config)


def _trainer(model, desc, loss_fn):
    options = {"utils": {"grad_norm_clip": False}, "debug": {"deterministic_compute": True}}
    return ORTTrainer(
        model, desc, optim.AdamConfig(lr=LR, lambda_coef=DECAY, epsilon=EPS), loss_fn=loss_fn, options=options
    )


def _torch_losses(model, loss_fn, batches):
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=DECAY, eps=EPS)
    model.train()
    losses = []
    for *inputs, label in batches:
        opt.zero_grad()
        loss = loss_fn(model(*inputs), label)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("name", sorted(MODELS))
def test_hugging_face_model_trains_like_torch_resumes_and_goes_back(tmp_path, name):
    cls, config, desc, loss_fn, make_batch = MODELS[name]()
    g = torch.Generator().manual_seed(1)
    batches = [make_batch(g) for _ in range(STEPS)]
    model = _build(cls, config, seed=0)
    reference = copy.deepcopy(model)

    trainer = _trainer(model, desc, loss_fn)
    losses = [trainer.train_step(*b).item() for b in batches[:SPLIT]]
    trainer.save_checkpoint(tmp_path / "hf.ortcp")
    losses += [trainer.train_step(*b).item() for b in batches[SPLIT:]]

    expected = _torch_losses(reference, loss_fn, batches)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), atol=1e-5, rtol=1e-5)
    weights = trainer.state_dict(pytorch_format=True)
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(weights[key], value, atol=2e-6, rtol=1e-5, msg=f"{name}: {key}")  # core tests'

    resumed = _trainer(_build(cls, config, seed=7), desc, loss_fn)
    resumed.load_checkpoint(tmp_path / "hf.ortcp")
    assert [resumed.train_step(*b).item() for b in batches[SPLIT:]] == losses[SPLIT:]
    final = resumed.state_dict(pytorch_format=True)
    for key, value in weights.items():
        assert torch.equal(final[key], value), f"{name}: {key} differs after resuming"

    plain = _build(cls, config, seed=9)
    plain.load_state_dict(final, strict=True)
    plain.eval()
    *inputs, label = batches[0]
    with torch.no_grad():
        eager = loss_fn(plain(*inputs), label)
    torch.testing.assert_close(resumed.eval_step(*batches[0]), eager, atol=1e-5, rtol=1e-5)
