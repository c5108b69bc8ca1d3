"""Tiny configs of the main Hugging Face families (nothing downloaded), for the zoo test.

Each entry builds a model whose forward takes the ``model_desc`` inputs (labels included) and returns
a ``ModelOutput`` whose first field is the loss, as HF models do when given labels. Dropout is 0 and
SpecAugment-style masking off: the runs are compared with eager PyTorch step by step.
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
DECODER = {**SMALL, "num_hidden_layers": 2, "num_key_value_heads": 1, "max_position_embeddings": 32, "use_cache": False}
NO_DROPOUT = {"hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}
LM_INPUTS = [("input_ids", ["batch", "seq"]), ("labels", ["batch", "seq"])]


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
    return torch.randint(1, VOCAB, shape, generator=g)


def _lm(g):
    ids = _ids(g, 2, 8)
    return ids, ids  # HF causal LMs shift the labels themselves


def _classes(n):
    return lambda g: (_ids(g, 2, 8), torch.randint(0, n, (2,), generator=g))


def _seq2seq(g):
    return _ids(g, 2, 8), torch.ones(2, 8, dtype=torch.int64), _ids(g, 2, 6)


def _decoder(cls, config_cls, **extra):
    return Architecture(_make(cls, config_cls(**DECODER, attn_implementation="eager", **extra)), LM_INPUTS, _lm)


def _encoder(cls, config_cls):
    config = config_cls(**SMALL, num_hidden_layers=2, max_position_embeddings=40, num_labels=3, **NO_DROPOUT)
    return Architecture(_make(cls, config), [("input_ids", ["batch", "seq"]), ("labels", ["batch"])], _classes(3))


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
        lambda g: (torch.randn(2, 8, 16, generator=g), _ids(g, 2, 6)),
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
        lambda g: (torch.randn(2, 400, generator=g), _ids(g, 2, 5)),
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
        LM_INPUTS,
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
