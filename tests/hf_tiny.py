"""Tiny Hugging Face models built from config objects (nothing downloaded), wrapped for ORTTrainer.

The wrappers take ``(input_ids, attention_mask)`` and return logits; the loss is a separate ``loss_fn``.
Eager attention, dropout 0: what the exporter turns into plain ONNX ops.
"""

from __future__ import annotations

import torch
import transformers

transformers.logging.set_verbosity_error()  # configs without tokenizers warn about special token ids

HF_DESC = {
    "inputs": [("input_ids", ["batch", "seq"]), ("attention_mask", ["batch", "seq"]), ("label", ["batch", "seq"])],
    "outputs": [("loss", [], True)],
}
HF_CLASSIFIER_DESC = {
    "inputs": [("input_ids", ["batch", "seq"]), ("attention_mask", ["batch", "seq"]), ("label", ["batch"])],
    "outputs": [("loss", [], True)],
}


def tiny_gpt2_config(vocab: int = 64, dropout: float | None = 0.0) -> transformers.GPT2Config:
    """2 layers, d 32, 2 heads, 16 positions; ``dropout=None`` keeps GPT-2's default 0.1 everywhere."""
    rates = {} if dropout is None else {"resid_pdrop": dropout, "embd_pdrop": dropout, "attn_pdrop": dropout}
    return transformers.GPT2Config(
        vocab_size=vocab, n_positions=16, n_embd=32, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0, **rates
    )


class GPT2(torch.nn.Module):
    def __init__(self, layers: int = 1, d_model: int = 16, vocab: int = 50, positions: int = 16):
        super().__init__()
        config = transformers.GPT2Config(
            n_layer=layers, n_embd=d_model, n_head=2, vocab_size=vocab, n_positions=positions,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="eager",
        )  # fmt: skip
        self.model = transformers.GPT2LMHeadModel(config)

    def forward(self, input_ids, attention_mask):
        return self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits


class BertClassifier(torch.nn.Module):
    def __init__(self, layers: int = 1, d_model: int = 16, vocab: int = 50, positions: int = 16):
        super().__init__()
        config = transformers.BertConfig(
            num_hidden_layers=layers, hidden_size=d_model, num_attention_heads=2, intermediate_size=4 * d_model,
            vocab_size=vocab, max_position_embeddings=positions, hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0, attn_implementation="eager",
        )  # fmt: skip
        self.model = transformers.BertForSequenceClassification(config)

    def forward(self, input_ids, attention_mask):
        return self.model(input_ids=input_ids, attention_mask=attention_mask).logits


def token_loss(logits, label):
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), label.reshape(-1))


PAD_ID = 0  # BertConfig's pad_token_id (the padding_idx of its word embeddings); GPT-2 pads with it too
IGNORE_INDEX = -100  # the label of a padded position (cross_entropy's default ignore_index), as Hugging Face's


def _padded_lengths(batch: int, seq: int) -> list[int]:
    """Sequence lengths of a real batch: the first full, the others padded at the end (a few tokens to half)."""
    return [seq if i == 0 else max(1, seq - (i * seq) // (2 * max(batch - 1, 1)) - 1) for i in range(batch)]


def _pad(ids: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
    """Pad ``ids`` (and ``labels``) in place to `_padded_lengths`; returns the attention mask.

    The first (full) row also reads `PAD_ID` once as a real token, as when the pad token is the EOS token:
    masked positions rarely reach the loss, that one does (and torch gives the padding row no gradient from it).
    """
    batch, seq = ids.shape
    mask = torch.ones(batch, seq, dtype=torch.int64)
    for row, length in enumerate(_padded_lengths(batch, seq)):
        ids[row, length:], mask[row, length:] = PAD_ID, 0
        if labels is not None:
            labels[row, length:] = IGNORE_INDEX
    ids[0, seq // 2] = PAD_ID
    if labels is not None:
        labels[0, seq // 2 - 1] = PAD_ID  # the token before predicts it
    return mask


def lm_batch(batch: int = 3, seq: int = 8, vocab: int = 50, seed: int = 0):
    """``(input_ids, attention_mask, labels)`` padded as a collator pads: ids `PAD_ID`, mask 0, labels -100."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(1, vocab, (batch, seq + 1), generator=g)
    ids, labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    mask = _pad(ids, labels)
    return ids, mask, labels


def classifier_batch(batch: int = 3, seq: int = 8, vocab: int = 50, seed: int = 0):
    """``(input_ids, attention_mask, label)``: real tokens from 1, padded ends with `PAD_ID` and mask 0."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (batch, seq), generator=g)
    mask = _pad(ids)
    return ids, mask, torch.randint(0, 2, (batch,), generator=g)
