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
    def __init__(self, layers: int, attn: str, **config):
        super().__init__()
        sizes = {"n_layer": layers, "n_embd": 256, "n_head": 4, "vocab_size": VOCAB, "n_positions": SEQ, **config}
        config = transformers.GPT2Config(
            **sizes, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation=attn
        )  # fmt: skip
        self.model = transformers.GPT2LMHeadModel(config)

    def forward(self, input_ids, attention_mask):
        return self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits


class BertClassifier(torch.nn.Module):
    def __init__(self, layers: int, attn: str, **config):
        super().__init__()
        sizes = {
            "num_hidden_layers": layers, "hidden_size": 256, "num_attention_heads": 4, "intermediate_size": 1024,
            "vocab_size": VOCAB, "max_position_embeddings": SEQ, **config,
        }  # fmt: skip
        config = transformers.BertConfig(
            **sizes, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, attn_implementation=attn
        )  # fmt: skip
        self.model = transformers.BertForSequenceClassification(config)

    def forward(self, input_ids, attention_mask):
        return self.model(input_ids=input_ids, attention_mask=attention_mask).logits


PAD_ID = 0  # BertConfig's pad_token_id (its word embeddings' padding_idx); GPT-2 (no pad token) pads with it too


def _padded(tokens: torch.Tensor) -> torch.Tensor:
    """Pad a quarter of the rows to half length in place, as a collator does (ids `PAD_ID`); the attention mask.

    The first row also reads `PAD_ID` once as a real token (an EOS used for padding), so the padding row's
    gradient rule (``padding_idx``) matters, as it does in real data."""
    batch = tokens.shape[0]
    mask = torch.ones(tokens.shape, dtype=torch.int64)
    mask[batch - max(batch // 4, 1) :, SEQ // 2 :] = 0
    tokens.masked_fill_(mask == 0, PAD_ID)
    tokens[0, SEQ // 3] = PAD_ID
    return mask


def _gpt2_batches(batch: int, vocab: int = VOCAB):
    def make(n: int):
        g = torch.Generator().manual_seed(0)
        out = []
        for _ in range(n):
            tokens = torch.randint(1, vocab, (batch, SEQ + 1), generator=g)
            ids, labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
            mask = _padded(ids)
            out.append((ids, mask, labels.masked_fill(mask == 0, -100)))  # padded positions: no loss
        return out

    return make


def _bert_batches(batch: int, vocab: int = VOCAB):
    def make(n: int):
        g = torch.Generator().manual_seed(0)
        out = []
        for _ in range(n):
            tokens = torch.randint(1, vocab, (batch, SEQ), generator=g)
            mask = _padded(tokens)
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


# Real sizes: the library defaults of GPT2Config / BertConfig (GPT-2 124M, BERT-base) and GPT-2 medium
# (350M), sequence 128; the small configs above under their own names. name -> (family, layers, config,
# default batch, summary).
SCALE_MODELS = {
    "gpt2-small": ("gpt2", 4, {}, 8, "HF GPT-2 4 layers d 256 vocab 8000 (5.2M)"),
    "bert-small": ("bert", 4, {}, 16, "HF BERT classifier 4 layers d 256 vocab 8000 (5.3M)"),
    "gpt2-124m": ("gpt2", 12, {"n_embd": 768, "n_head": 12, "vocab_size": 50257, "n_positions": 1024}, 2,
                  "HF GPT-2 124M (GPT2Config defaults: 12 layers, d 768, vocab 50257)"),
    "gpt2-350m": ("gpt2", 24, {"n_embd": 1024, "n_head": 16, "vocab_size": 50257, "n_positions": 1024}, 2,
                  "HF GPT-2 medium 355M (24 layers, d 1024, vocab 50257)"),
    "gpt2-774m": ("gpt2", 36, {"n_embd": 1280, "n_head": 20, "vocab_size": 50257, "n_positions": 1024}, 2,
                  "HF GPT-2 large 774M (36 layers, d 1280, vocab 50257)"),
    "bert-base": ("bert", 12, {"hidden_size": 768, "num_attention_heads": 12, "intermediate_size": 3072,
                               "vocab_size": 30522, "max_position_embeddings": 512}, 4,
                  "HF BERT-base classifier (BertConfig defaults: 12 layers, d 768, vocab 30522, 109M)"),
}  # fmt: skip


def scale_spec(name: str, batch: int | None = None, attn: str = "eager") -> ModelSpec:
    """A `SCALE_MODELS` entry as a `ModelSpec` (batch x 128 tokens; ``batch`` None: the entry's default)."""
    family, layers, config, default_batch, summary = SCALE_MODELS[name]
    batch = batch or default_batch
    vocab = config.get("vocab_size", VOCAB)
    if family == "gpt2":
        make, desc, loss, batches = (lambda: GPT2(layers, attn, **config)), GPT2_DESC, lm_loss, _gpt2_batches
    else:
        make, desc = (lambda: BertClassifier(layers, attn, **config)), BERT_DESC
        loss, batches = torch.nn.functional.cross_entropy, _bert_batches
    summary = f"{summary}, batch {batch} x {SEQ}, {attn} attention"
    return ModelSpec(name, summary, make, desc, loss, batches(batch, vocab))
