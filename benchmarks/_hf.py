"""Hugging Face models for the benchmarks, built from config objects (nothing is downloaded).

GPT-2 (``GPT2LMHeadModel``: 4 layers, d 256, 4 heads, vocab 8000, 128 positions: 5.2M parameters) and
BERT for sequence classification (4 layers, d 256, 4 heads, ff 1024, vocab 8000, 128 positions, 2
labels: 5.3M), dropout 0. Both take ``(input_ids, attention_mask)`` and return logits; the loss is a
separate ``loss_fn`` (token cross-entropy for GPT-2, sequence cross-entropy for BERT), as a user hands
them to ORTTrainer. ``attn`` picks ``attn_implementation``: "eager" (explicit matmul/softmax, what the
TorchScript exporter turns into plain ONNX ops) or "sdpa" (``scaled_dot_product_attention``, the
transformers default in PyTorch).
"""

from __future__ import annotations

import torch
import transformers

from benchmarks._common import ModelSpec, lm_loss

transformers.logging.set_verbosity_error()  # configs without tokenizers warn about special token ids

VOCAB, SEQ = 8000, 128
GPT2_DESC = {
    "inputs": [("input_ids", ["batch", "seq"]), ("attention_mask", ["batch", "seq"]), ("label", ["batch", "seq"])],
    "outputs": [("loss", [], True)],
}
BERT_DESC = {
    "inputs": [("input_ids", ["batch", "seq"]), ("attention_mask", ["batch", "seq"]), ("label", ["batch"])],
    "outputs": [("loss", [], True)],
}


class GPT2(torch.nn.Module):
    def __init__(self, layers: int, attn: str):
        super().__init__()
        config = transformers.GPT2Config(
            n_layer=layers, n_embd=256, n_head=4, vocab_size=VOCAB, n_positions=SEQ,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation=attn,
        )  # fmt: skip
        self.model = transformers.GPT2LMHeadModel(config)

    def forward(self, input_ids, attention_mask):
        return self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits


class BertClassifier(torch.nn.Module):
    def __init__(self, layers: int, attn: str):
        super().__init__()
        config = transformers.BertConfig(
            num_hidden_layers=layers, hidden_size=256, num_attention_heads=4, intermediate_size=1024,
            vocab_size=VOCAB, max_position_embeddings=SEQ, hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0, attn_implementation=attn,
        )  # fmt: skip
        self.model = transformers.BertForSequenceClassification(config)

    def forward(self, input_ids, attention_mask):
        return self.model(input_ids=input_ids, attention_mask=attention_mask).logits


def _gpt2_batches(batch: int):
    def make(n: int):
        g = torch.Generator().manual_seed(0)
        out = []
        for _ in range(n):
            tokens = torch.randint(0, VOCAB, (batch, SEQ + 1), generator=g)
            mask = torch.ones(batch, SEQ, dtype=torch.int64)
            out.append((tokens[:, :-1].contiguous(), mask, tokens[:, 1:].contiguous()))
        return out

    return make


def _bert_batches(batch: int):
    def make(n: int):
        g = torch.Generator().manual_seed(0)
        out = []
        for _ in range(n):
            mask = torch.ones(batch, SEQ, dtype=torch.int64)
            mask[: batch // 4, SEQ // 2 :] = 0  # a quarter of the sequences padded to half length
            tokens = torch.randint(1, VOCAB, (batch, SEQ), generator=g)  # no padding_idx (0) tokens
            out.append((tokens, mask, torch.randint(0, 2, (batch,), generator=g)))
        return out

    return make


def gpt2_spec(layers: int = 4, batch: int = 8, attn: str = "eager") -> ModelSpec:
    return ModelSpec(
        "gpt2",
        f"HF GPT-2 ({layers} layers, d 256, vocab {VOCAB}), batch {batch} x {SEQ}, {attn} attention",
        lambda: GPT2(layers, attn),
        GPT2_DESC,
        lm_loss,
        _gpt2_batches(batch),
    )


def bert_spec(layers: int = 4, batch: int = 16, attn: str = "eager") -> ModelSpec:
    return ModelSpec(
        "bert",
        f"HF BERT classifier ({layers} layers, d 256, vocab {VOCAB}), batch {batch} x {SEQ}, {attn} attention",
        lambda: BertClassifier(layers, attn),
        BERT_DESC,
        torch.nn.functional.cross_entropy,
        _bert_batches(batch),
    )
