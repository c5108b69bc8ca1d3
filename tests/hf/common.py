"""Shared pieces of the ort_trainer.hf tests: a tiny GPT-2 and a tiny Llama built from configs (nothing
downloaded), token data with sequences of different lengths (padding, ``-100`` labels: HF's per-token loss
normalisation matters), and runs of ``transformers.Trainer`` (PyTorch) and ``ort_trainer.hf.Trainer`` side by
side. Id 0 is the pad token and the end-of-text token (as when a tokenizer pads with EOS): the collator pads
with it (attention mask 0, label -100) and some rows hold it as a real token, which Llama's
``nn.Embedding(padding_idx=0)`` gives no gradient from its lookups."""

from __future__ import annotations

import copy
import math
import warnings

import torch
import transformers

from ort_trainer.hf import Trainer as OrtHFTrainer

transformers.logging.set_verbosity_error()

VOCAB = 64
PAD = EOS = 0


def gpt2(seed: int = 0) -> transformers.GPT2LMHeadModel:
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2, n_head=2,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=EOS, eos_token_id=EOS,
        attn_implementation="eager",
    )  # fmt: skip
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return transformers.GPT2LMHeadModel(config)


def llama(seed: int = 0) -> transformers.LlamaForCausalLM:
    """2 layers, d 32; ``pad_token_id=0``: its embeddings' ``padding_idx``."""
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=32, pad_token_id=PAD, bos_token_id=1, eos_token_id=EOS,
        use_cache=False, attn_implementation="eager",
    )  # fmt: skip
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return transformers.LlamaForCausalLM(config)


class TokenData(torch.utils.data.Dataset):
    """``count`` sequences of 5..12 random tokens (fixed by ``seed``); every third holds two documents, the
    first ended by `EOS` (= `PAD`), as packed rows do: that token is read, and predicted, as a real one."""

    def __init__(self, count: int, seed: int = 1, lengths: tuple[int, int] = (5, 13)):
        g = torch.Generator().manual_seed(seed)
        sizes = torch.randint(*lengths, (count,), generator=g)
        self.rows = [torch.randint(1, VOCAB, (int(n),), generator=g) for n in sizes]
        for row in self.rows[::3]:
            row[len(row) // 2] = EOS

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.rows[i]}


def pad_collate(rows: list[dict]) -> dict[str, torch.Tensor]:
    """Right-pad to the batch's longest row: ids `PAD`, attention_mask 0, labels -100 (ignored by the loss)."""
    width = max(len(r["input_ids"]) for r in rows)
    ids = torch.full((len(rows), width), PAD, dtype=torch.int64)
    mask = torch.zeros(len(rows), width, dtype=torch.int64)
    labels = torch.full((len(rows), width), -100, dtype=torch.int64)
    for i, r in enumerate(rows):
        n = len(r["input_ids"])
        ids[i, :n], mask[i, :n], labels[i, :n] = r["input_ids"], 1, r["input_ids"]
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def pad_collate_without_mask(rows: list[dict]) -> dict[str, torch.Tensor]:
    """`pad_collate` without the attention mask (decoders then look for packed sequences themselves)."""
    batch = pad_collate(rows)
    del batch["attention_mask"]
    return batch


def arguments(output_dir, **overrides) -> transformers.TrainingArguments:
    values = dict(
        output_dir=str(output_dir), per_device_train_batch_size=4, per_device_eval_batch_size=4, max_steps=6,
        learning_rate=3e-3, weight_decay=0.01, warmup_steps=2, logging_steps=1, save_strategy="no",
        report_to="none", disable_tqdm=True, use_cpu=True, seed=7, dataloader_num_workers=0,
    )  # fmt: skip
    values.update(overrides)
    return transformers.TrainingArguments(**values)


def run(trainer_cls, model, args, train=None, evaluate=None, collate=pad_collate, **kwargs):
    """Train ``copy.deepcopy(model)``; returns (trainer, logged train losses, eval loss or None)."""
    train = TokenData(24) if train is None else train
    trainer = trainer_cls(
        model=copy.deepcopy(model), args=args, train_dataset=train, eval_dataset=evaluate, data_collator=collate,
        **kwargs,
    )  # fmt: skip
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    eval_loss = trainer.evaluate()["eval_loss"] if evaluate is not None else None
    return trainer, losses, eval_loss


def assert_losses_close(ours: list[float], reference: list[float], rel: float = 1e-4) -> None:
    assert len(ours) == len(reference) and ours, (ours, reference)
    for step, (a, b) in enumerate(zip(ours, reference, strict=True), start=1):
        assert math.isclose(a, b, rel_tol=rel), f"logged step {step}: ort {a} vs torch {b} (all: {ours} / {reference})"


def assert_weights_close(ours: torch.nn.Module, reference: torch.nn.Module, atol: float = 2e-5) -> None:
    mine = ours.state_dict()
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(mine[key], value, atol=atol, rtol=1e-4, msg=lambda m, k=key: f"{k}: {m}")


__all__ = ["OrtHFTrainer", "TokenData", "arguments", "gpt2", "llama", "pad_collate", "pad_collate_without_mask", "run"]
