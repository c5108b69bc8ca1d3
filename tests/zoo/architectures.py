"""Tiny configs of the main Hugging Face families (nothing downloaded), for the zoo test.

Each entry builds a model whose forward takes the ``model_desc`` inputs (labels included) and returns
a ``ModelOutput`` whose first field is the loss, as HF models do when given labels. Dropout is 0 and
SpecAugment-style masking off: the runs are compared with eager PyTorch step by step.

Token batches are padded as a collator pads them: the last sequence ends in the model's pad token
(the ``padding_idx`` of its embeddings where it has one: BERT, RoBERTa, BART, Whisper, Llama-family),
with attention-mask zeros where the model takes a mask and ``-100`` labels under the padding. The pad
id also occurs once among the first sequence's real tokens, as when the pad token is the EOS token:
torch gives the padding row no gradient from there either (masked positions rarely reach the loss).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
import transformers

from tests.hf_tiny import tiny_gpt2_config

transformers.logging.set_verbosity_error()

VOCAB = 64
SMALL = {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 2, "vocab_size": VOCAB}
DECODER = {
    **SMALL, "num_hidden_layers": 2, "num_key_value_heads": 1, "max_position_embeddings": 32, "use_cache": False,
    "pad_token_id": 0,  # the embeddings' padding_idx
}  # fmt: skip
NO_DROPOUT = {"hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}
LM_INPUTS = [("input_ids", ["batch", "seq"]), ("labels", ["batch", "seq"])]
MASKED_LM_INPUTS = [("input_ids", ["batch", "seq"]), ("attention_mask", ["batch", "seq"]), ("labels", ["batch", "seq"])]
IGNORE = -100  # the label of a padded position


@dataclass(frozen=True)
class Architecture:
    build: Callable[[], torch.nn.Module]
    inputs: list  # model_desc inputs: forward()'s parameter names
    batch: Callable[[torch.Generator], tuple[torch.Tensor, ...]]

    @property
    def desc(self) -> dict:
        return {"inputs": self.inputs, "outputs": [("loss", [], True)]}


def _make(cls, config) -> Callable[[], torch.nn.Module]:
    def build():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return cls(config)

    return build


def _ids(g, *shape):
    return torch.randint(3, VOCAB, shape, generator=g)  # 0..2: the pad/bos/eos ids of the configs below


def _padded(g, rows: int, length: int, pad: int, real: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids, attention_mask)``: the last row holds ``real`` tokens, then ``pad`` (mask 0) to ``length``;
    the first row reads ``pad`` as a real token too (mask 1), at its second position."""
    ids, mask = _ids(g, rows, length), torch.ones(rows, length, dtype=torch.int64)
    ids[-1, real:], mask[-1, real:] = pad, 0
    ids[0, 1] = pad
    return ids, mask


def _labels_of(ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return ids.masked_fill(mask == 0, IGNORE)


def _lm(g):
    ids, mask = _padded(g, 2, 8, pad=0, real=5)
    return ids, _labels_of(ids, mask)  # HF causal LMs shift the labels themselves


def _masked_lm(g):
    ids, mask = _padded(g, 2, 8, pad=0, real=5)
    return ids, mask, _labels_of(ids, mask)


def _classes(n, pad):
    def batch(g):
        ids, mask = _padded(g, 2, 8, pad=pad, real=5)
        return ids, mask, torch.randint(0, n, (2,), generator=g)

    return batch


def _seq2seq(g):
    ids, mask = _padded(g, 2, 8, pad=0, real=5)
    target, target_mask = _padded(g, 2, 6, pad=0, real=4)
    return ids, mask, _labels_of(target, target_mask)


def _decoder(cls, config_cls, masked: bool = True, **extra):
    """A causal LM; ``masked=False``: no attention mask (transformers then looks for packed sequences)."""
    config = config_cls(**DECODER, attn_implementation="eager", **extra)
    return Architecture(_make(cls, config), MASKED_LM_INPUTS if masked else LM_INPUTS, _masked_lm if masked else _lm)


def _encoder(cls, config_cls):
    config = config_cls(**SMALL, num_hidden_layers=2, max_position_embeddings=40, num_labels=3, **NO_DROPOUT)
    inputs = [("input_ids", ["batch", "seq"]), ("attention_mask", ["batch", "seq"]), ("labels", ["batch"])]
    return Architecture(_make(cls, config), inputs, _classes(3, pad=config.pad_token_id))


def _t5():
    config = transformers.T5Config(
        vocab_size=VOCAB, d_model=32, d_kv=16, d_ff=64, num_layers=2, num_heads=2, dropout_rate=0.0,
        decoder_start_token_id=0, pad_token_id=0,
    )  # fmt: skip
    inputs = [("input_ids", ["batch", "seq"]), ("attention_mask", ["batch", "seq"]), ("labels", ["batch", "target"])]
    return Architecture(_make(transformers.T5ForConditionalGeneration, config), inputs, _seq2seq)


def _bart():
    config = transformers.BartConfig(
        vocab_size=VOCAB, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=32,
        dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, pad_token_id=0, bos_token_id=1,
        eos_token_id=2, decoder_start_token_id=2, forced_eos_token_id=None,
    )  # fmt: skip
    inputs = [("input_ids", ["batch", "seq"]), ("attention_mask", ["batch", "seq"]), ("labels", ["batch", "target"])]
    return Architecture(_make(transformers.BartForConditionalGeneration, config), inputs, _seq2seq)


def _whisper():
    config = transformers.WhisperConfig(
        vocab_size=VOCAB, num_mel_bins=8, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, max_source_positions=8,
        max_target_positions=16, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, pad_token_id=0,
        bos_token_id=1, eos_token_id=2, decoder_start_token_id=1, use_cache=False, attn_implementation="eager",
        suppress_tokens=None, begin_suppress_tokens=None,
    )  # fmt: skip
    inputs = [("input_features", ["batch", 8, 16]), ("labels", ["batch", "target"])]
    return Architecture(
        _make(transformers.WhisperForConditionalGeneration, config),
        inputs,
        lambda g: (torch.randn(2, 8, 16, generator=g), _labels_of(*_padded(g, 2, 6, pad=0, real=4))),
    )


def _vit():
    config = transformers.ViTConfig(
        image_size=16, patch_size=4, num_channels=3, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64, num_labels=3, **NO_DROPOUT,
    )  # fmt: skip
    inputs = [("pixel_values", ["batch", 3, 16, 16]), ("labels", ["batch"])]
    return Architecture(
        _make(transformers.ViTForImageClassification, config),
        inputs,
        lambda g: (torch.randn(2, 3, 16, 16, generator=g), torch.randint(0, 3, (2,), generator=g)),
    )


def _wav2vec2_config(**extra):
    return transformers.Wav2Vec2Config(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
        conv_dim=(16, 16), conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=16,
        num_conv_pos_embedding_groups=2, hidden_dropout=0.0, activation_dropout=0.0, attention_dropout=0.0,
        feat_proj_dropout=0.0, final_dropout=0.0, layerdrop=0.0, mask_time_prob=0.0, mask_feature_prob=0.0,
        classifier_proj_size=16, num_labels=3, **extra,
    )  # fmt: skip


def _wav2vec2():
    inputs = [("input_values", ["batch", 400]), ("labels", ["batch"])]
    return Architecture(
        _make(transformers.Wav2Vec2ForSequenceClassification, _wav2vec2_config()),
        inputs,
        lambda g: (torch.randn(2, 400, generator=g), torch.randint(0, 3, (2,), generator=g)),
    )


def _wav2vec2_ctc() -> Architecture:
    inputs = [("input_values", ["batch", 400]), ("labels", ["batch", "target"])]
    return Architecture(
        _make(transformers.Wav2Vec2ForCTC, _wav2vec2_config(pad_token_id=0)),
        inputs,
        lambda g: (torch.randn(2, 400, generator=g), _labels_of(*_padded(g, 2, 5, pad=0, real=3))),
    )


class _ContrastiveLoss(torch.nn.Module):
    """CLIP with ``return_loss=True`` (its loss needs no label input: the pairs are the labels)."""

    def __init__(self, config):
        super().__init__()
        self.clip = transformers.CLIPModel(config)

    def forward(self, input_ids, pixel_values):
        return self.clip(input_ids=input_ids, pixel_values=pixel_values, return_loss=True)


def _clip():
    text = dict(SMALL, num_hidden_layers=1, max_position_embeddings=16)
    vision = {"image_size": 16, "patch_size": 4, "hidden_size": 32, "intermediate_size": 64,
              "num_hidden_layers": 1, "num_attention_heads": 2}  # fmt: skip
    config = transformers.CLIPConfig(text_config=text, vision_config=vision, projection_dim=16)
    inputs = [("input_ids", [3, 8]), ("pixel_values", [3, 3, 16, 16])]  # CLIP's labels are arange(len(batch))
    return Architecture(
        _make(_ContrastiveLoss, config),
        inputs,
        lambda g: (_ids(g, 3, 8), torch.randn(3, 3, 16, 16, generator=g)),
    )


def mixtral(experts: str = "eager") -> Architecture:
    return _decoder(
        transformers.MixtralForCausalLM,
        transformers.MixtralConfig,
        masked=False,
        num_local_experts=4,
        num_experts_per_tok=2,
        experts_implementation=experts,
    )


ARCHITECTURES: dict[str, Callable[[], Architecture]] = {
    "gpt2": lambda: Architecture(
        _make(
            transformers.GPT2LMHeadModel,
            tiny_gpt2_config(VOCAB),
        ),
        LM_INPUTS,  # no attention mask: transformers looks for packed sequences (torch.diff)
        _lm,
    ),
    "llama": lambda: _decoder(transformers.LlamaForCausalLM, transformers.LlamaConfig),
    "mistral": lambda: _decoder(transformers.MistralForCausalLM, transformers.MistralConfig),
    "qwen2": lambda: _decoder(transformers.Qwen2ForCausalLM, transformers.Qwen2Config),
    "mixtral": mixtral,
    "bert": lambda: _encoder(transformers.BertForSequenceClassification, transformers.BertConfig),
    "roberta": lambda: _encoder(transformers.RobertaForSequenceClassification, transformers.RobertaConfig),
    "t5": _t5,
    "bart": _bart,
    "whisper": _whisper,
    "vit": _vit,
    "wav2vec2": _wav2vec2,
    "clip": _clip,
    "wav2vec2-ctc": _wav2vec2_ctc,
}
