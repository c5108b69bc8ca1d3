"""Which blocks a Megatron run splits, how weights are sliced, and the errors for models that cannot be split."""

from __future__ import annotations

import pytest
import torch

from ort_trainer import ORTTrainer, ORTTrainerOptions, checkpoint, optim
from ort_trainer.checkpoint.sets import megatron
from ort_trainer.parallel import PartitionSpec, SplitBlock, find_blocks, shard_model
from tests.hf_tiny import GPT2, BertClassifier
from tests.models import MLP, MLP_DESC, TinyLM


def test_blocks_found_in_gpt2_bert_and_mlp():
    gpt2 = find_blocks(GPT2(layers=2))
    assert [(b.columns, b.row) for b in gpt2[:2]] == [
        (("model.transformer.h.0.attn.c_attn",), "model.transformer.h.0.attn.c_proj"),
        (("model.transformer.h.0.mlp.c_fc",), "model.transformer.h.0.mlp.c_proj"),
    ]
    assert len(gpt2) == 4 and gpt2[0].stride("model.transformer.h.0.attn.c_attn") == 3
    bert = {b.row: b.columns for b in find_blocks(BertClassifier(layers=1))}
    layer = "model.bert.encoder.layer.0"
    assert bert == {
        f"{layer}.attention.output.dense": tuple(f"{layer}.attention.self.{n}" for n in ("query", "key", "value")),
        f"{layer}.output.dense": (f"{layer}.intermediate.dense",),
    }
    assert find_blocks(MLP()) == [SplitBlock(("fc1",), "fc2")]


def test_user_patterns_pair_modules_in_order():
    blocks = find_blocks(GPT2(layers=2), [("*.mlp.c_fc", "*.mlp.c_proj")])
    assert [b.row for b in blocks] == ["model.transformer.h.0.mlp.c_proj", "model.transformer.h.1.mlp.c_proj"]


def test_models_without_splittable_blocks_are_refused_by_name():
    with pytest.raises(ValueError, match="no block to split"):
        find_blocks(torch.nn.Sequential(torch.nn.Linear(4, 4)))
    with pytest.raises(ValueError, match="'nothing' names no module"):
        find_blocks(MLP(), [("nothing", "fc2")])
    lm = TinyLM()
    with pytest.raises(ValueError, match=r"cannot split block .*'encoder.layers.0.self_attn' is a MultiheadAttention"):
        find_blocks(lm, [("encoder.layers.0.self_attn", "encoder.layers.0.linear2")])


def test_uneven_blocks_are_refused_by_name():
    with pytest.raises(ValueError, match=r"block \(columns \['fc1'\], row 'fc2'\).*'fc1' has 16 outputs"):
        shard_model(MLP(hidden=16), find_blocks(MLP(hidden=16)), 3, 0)
    gpt2 = GPT2(layers=1, d_model=24)  # 2 heads, split 4 ways: 24 columns divide, heads do not
    with pytest.raises(ValueError, match="attention 'model.transformer.h.0.attn' has 2 heads"):
        shard_model(gpt2, find_blocks(gpt2), 4, 0)


def test_fused_qkv_slices_take_whole_heads_and_join_back():
    full = torch.arange(2 * 12, dtype=torch.float32).reshape(2, 12)  # [in, Q|K|V] with 4 columns each
    spec = PartitionSpec((2, 12), axis=1, stride=3)
    shards = [spec.take(full, 2, r) for r in range(2)]
    assert shards[0][0].tolist() == [0, 1, 4, 5, 8, 9]
    assert torch.equal(spec.join(shards), full)
    assert spec.row_partition_flag == 0 and PartitionSpec((4, 2), axis=0).row_partition_flag == 1


def test_sliced_model_keeps_names_and_computes_the_full_block():
    """Column slices then row slices, summed over ranks, give the original MLP (what g's all-reduce does)."""
    torch.manual_seed(0)
    mlp, x = MLP(hidden=16), torch.randn(3, 20)
    blocks = find_blocks(mlp)
    slices = [shard_model(mlp, blocks, 2, r)[0] for r in range(2)]
    assert [n for n, _ in slices[0].named_parameters()] == [n for n, _ in mlp.named_parameters()]
    partial = sum(s.fc2(torch.relu(s.fc1(x))) - s.fc2.bias for s in slices)
    torch.testing.assert_close(partial + mlp.fc2.bias, mlp(x))


def test_options_refuse_a_non_list_plan():
    with pytest.raises(TypeError, match="horizontal_parallel_blocks"):
        ORTTrainerOptions({"distributed": {"horizontal_parallel_blocks": "fc1"}})


def test_what_h2_does_not_do_is_refused_before_any_process_group():
    options = {"distributed": {"world_size": 2, "world_rank": 0, "horizontal_parallel_size": 2}}
    loss = torch.nn.functional.cross_entropy
    with pytest.raises(NotImplementedError, match="LAMB"):
        ORTTrainer(MLP(), MLP_DESC, optim.LambConfig(), loss_fn=loss, options=options)
    with pytest.raises(NotImplementedError, match="ZeRO stages 0 and 1"):
        zero2 = {"distributed": {**options["distributed"], "deepspeed_zero_optimization": {"stage": 2}}}
        ORTTrainer(MLP(), MLP_DESC, optim.AdamConfig(), loss_fn=loss, options=zero2)
    assert not torch.distributed.is_initialized()


def test_fused_slices_with_stride_aggregate_to_the_full_weight():
    """Our partition_info ``stride``: GPT-2's Q|K|V slices (whole heads of each part) join back on aggregation."""
    torch.manual_seed(0)
    weight, other = torch.randn(4, 12), torch.randn(3)
    full = {
        "model": {"full_precision": {"attn.weight": weight, "ln.bias": other}},
        "optimizer": {},
        "trainer_options": {"mixed_precision": False, "zero_stage": 0, "world_rank": 0, "world_size": 1,
                            "optimizer_name": "AdamOptimizer", "data_parallel_size": 1, "horizontal_parallel_size": 1},
        "train_step_info": {"step": 1, "optimization_step": 1},
    }  # fmt: skip
    ranks = megatron.partition(full, 2, column=["attn.weight"])
    spec = PartitionSpec((4, 12), axis=1, stride=3)
    for r, state in enumerate(ranks):
        state["model"]["full_precision"]["attn.weight"] = spec.take(weight, 2, r)
        state["partition_info"]["attn.weight"]["stride"] = 3
    joined = checkpoint.aggregate_states(ranks)["model"]["full_precision"]
    assert torch.equal(joined["attn.weight"], weight) and torch.equal(joined["ln.bias"], other)
    ranks[1]["partition_info"]["attn.weight"]["stride"] = 1
    with pytest.raises(ValueError, match="stride"):
        checkpoint.aggregate_states(ranks)
