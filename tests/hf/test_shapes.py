"""``ort_trainer.hf.Trainer`` on the shapes real data has (issue V): transformers' own language-modelling collator
padding each batch to its longest row, batches grouped by length, a last smaller batch and an eval set of another
batch size, all from one training graph and one eval graph, equal to ``transformers.Trainer``."""

from __future__ import annotations

import logging

import transformers

from tests.hf.common import OrtHFTrainer, TokenData, arguments, assert_losses_close, assert_weights_close, gpt2, run


class _Tokenizer:
    """What transformers' collators ask of a tokenizer to pad a batch (nothing is downloaded): pad id 0, right
    padding, and ``pad``."""

    pad_token_id = 0
    padding_side = "right"
    model_input_names = ["input_ids", "attention_mask"]

    def pad(self, features, padding=True, max_length=None, pad_to_multiple_of=None, return_tensors="pt", **_):
        import torch

        width = max(len(f["input_ids"]) for f in features)
        out = {"input_ids": [], "attention_mask": []}
        for f in features:
            ids = [int(t) for t in f["input_ids"]]
            gap = width - len(ids)
            out["input_ids"].append(ids + [0] * gap)
            out["attention_mask"].append([1] * len(ids) + [0] * gap)
        return {k: torch.tensor(v) for k, v in out.items()}


def test_lm_collator_group_by_length_and_other_eval_batches_use_one_graph_each(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="ort_trainer")
    model = gpt2()
    collate = transformers.DataCollatorForLanguageModeling(_Tokenizer(), mlm=False)  # labels -100 under the padding
    train, evaluate = TokenData(22, seed=3), TokenData(7, seed=5)  # 22 rows / 4: the epoch ends in a batch of 2
    options = dict(
        train_sampling_strategy="group_by_length", per_device_eval_batch_size=3, max_steps=-1, num_train_epochs=1
    )
    args = arguments(tmp_path / "torch", **options)
    reference, expected, expected_eval = run(transformers.Trainer, model, args, train, evaluate, collate=collate)
    args = arguments(tmp_path / "ort", **options)
    ours, losses, eval_loss = run(OrtHFTrainer, model, args, train, evaluate, collate=collate)
    assert ours.state.global_step == reference.state.global_step == 6
    assert_losses_close(losses, expected)
    assert abs(eval_loss - expected_eval) <= 1e-4 * abs(expected_eval)
    assert_weights_close(ours.model, reference.model)
    assert "new input shapes" not in caplog.text  # every later shape ran on the first training / eval graph
    assert caplog.text.count("phase 'trace and export the training graph'") == 1
