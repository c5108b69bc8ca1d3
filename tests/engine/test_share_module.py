"""Memory options: ``utils.share_module_parameters`` (the module holds the trainer's weights, held once)
and ``utils.shrink_memory_arena`` (ONNX Runtime's arena returned after each run)."""

from __future__ import annotations

import copy

import pytest
import torch

from ort_trainer import ORTTrainer, optim
from tests.builders import assert_steps_match_torch_sgd
from tests.models import CNN, CNN_DESC, MLP, MLP_DESC, TinyLM, cnn_batches, lm_batches, lm_loss, mlp_batches

ce = torch.nn.functional.cross_entropy
LM_DESC = {"inputs": [("tokens", ["batch", "seq"]), ("label", ["batch", "seq"])], "outputs": [("loss", [], True)]}
SHARE = {"utils": {"share_module_parameters": True}}


def _inside(tensor: torch.Tensor, flat: torch.Tensor) -> bool:
    start = flat.data_ptr()
    return start <= tensor.data_ptr() < start + flat.numel() * flat.element_size()


def test_shared_module_shows_the_trained_weights_and_matches_torch():
    torch.manual_seed(0)
    model = CNN()
    reference = copy.deepcopy(model)
    trainer = ORTTrainer(model, CNN_DESC, optim.SGDConfig(lr=0.1), loss_fn=ce, options=SHARE)
    assert all(_inside(p, trainer.trainer_state.store.params) for p in model.parameters())
    assert_steps_match_torch_sgd(trainer, reference, cnn_batches(3))
    for name, value in reference.state_dict().items():  # running statistics and num_batches_tracked included
        torch.testing.assert_close(model.state_dict()[name], value, atol=1e-5, rtol=1e-5, msg=name)
        torch.testing.assert_close(trainer.state_dict(pytorch_format=True)[name], value, atol=1e-5, rtol=1e-5)


def test_tied_weights_stay_tied_and_loads_reach_the_module():
    torch.manual_seed(1)
    model = TinyLM()
    model.head.weight = model.embed.weight
    trainer = ORTTrainer(model, LM_DESC, optim.AdamConfig(lr=1e-2), loss_fn=lm_loss, options=SHARE)
    trainer.train_step(*lm_batches(1)[0])
    assert model.head.weight is model.embed.weight and _inside(model.embed.weight, trainer.trainer_state.store.params)
    fresh = TinyLM()
    fresh.head.weight = fresh.embed.weight
    trainer.load_state_dict(fresh.state_dict(), strict=False)
    torch.testing.assert_close(model.embed.weight, fresh.embed.weight, atol=0, rtol=0)


def test_without_the_option_the_module_keeps_its_own_storage():
    model = MLP()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    keep = {"utils": {"share_module_parameters": False}}
    trainer = ORTTrainer(model, MLP_DESC, optim.SGDConfig(lr=0.1), loss_fn=ce, options=keep)
    trainer.train_step(*mlp_batches(1)[0])
    assert not any(_inside(p, trainer.trainer_state.store.params) for p in model.parameters())
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value, before[name], atol=0, rtol=0)


def test_shrinking_the_arena_keeps_the_numbers():
    torch.manual_seed(3)
    model = TinyLM(layers=2)
    lean = ORTTrainer(
        copy.deepcopy(model), LM_DESC, optim.AdamConfig(lr=1e-2), loss_fn=lm_loss,
        options={"utils": {"shrink_memory_arena": True}},
    )  # fmt: skip
    plain = ORTTrainer(model, LM_DESC, optim.AdamConfig(lr=1e-2), loss_fn=lm_loss)
    for batch in lm_batches(3):
        torch.testing.assert_close(lean.train_step(*batch), plain.train_step(*batch), atol=0, rtol=0)
    key = "memory.enable_memory_arena_shrinkage"
    assert lean.trainer_state.engine.session._run_options.get_run_config_entry(key) == "cpu:0"
    torch.testing.assert_close(lean.eval_step(*lm_batches(1)[0]), plain.eval_step(*lm_batches(1)[0]), atol=0, rtol=0)


def test_by_default_the_module_is_trained_in_place_like_with_a_torch_optimizer():
    torch.manual_seed(4)
    model = MLP()
    reference = copy.deepcopy(model)
    trainer = ORTTrainer(model, MLP_DESC, optim.SGDConfig(lr=0.1), loss_fn=ce)
    assert trainer.options.utils.share_module_parameters is True
    assert_steps_match_torch_sgd(trainer, reference, mlp_batches(2))
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(model.state_dict()[name], value, atol=1e-6, rtol=1e-5, msg=name)


def test_a_hugging_face_module_trained_by_default_saves_and_reloads_with_save_pretrained(tmp_path):
    import transformers

    from tests.hf_tiny import HF_DESC, lm_batch, tiny_gpt2_config, token_loss

    class Wrapped(torch.nn.Module):
        def __init__(self, lm):
            super().__init__()
            self.lm = lm

        def forward(self, input_ids, attention_mask):
            return self.lm(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits

    torch.manual_seed(5)
    lm = transformers.GPT2LMHeadModel(tiny_gpt2_config())  # tied input/output embeddings
    trainer = ORTTrainer(Wrapped(lm), HF_DESC, optim.AdamConfig(lr=1e-2), loss_fn=token_loss)
    trainer.train_step(*lm_batch(vocab=64))
    lm.save_pretrained(tmp_path)  # safetensors: the weights are disjoint views of one flat buffer
    reloaded = transformers.GPT2LMHeadModel.from_pretrained(tmp_path)
    trained = {k.removeprefix("lm."): v for k, v in trainer.state_dict(pytorch_format=True).items()}
    for name, value in reloaded.state_dict().items():
        torch.testing.assert_close(value, trained[name], atol=0, rtol=0, msg=name)
    assert reloaded.lm_head.weight.data_ptr() == reloaded.transformer.wte.weight.data_ptr()


def test_default_cpu_sessions_plan_memory_without_the_pattern_in_one_arena_and_given_options_are_kept():
    """Our CPU sessions skip ORT's memory pattern and take memory from one arena in ORT's environment (the
    training and eval graphs never run at once: each kept an arena of its own); a user's options are theirs."""
    import onnxruntime

    from ort_trainer.config import ORTTrainerOptions
    from ort_trainer.engine._build import session_options_for

    ours = session_options_for(ORTTrainerOptions({}))
    assert ours.enable_mem_pattern is False
    assert ours.get_session_config_entry("session.intra_op.allow_spinning") == "0"
    assert ours.get_session_config_entry("session.use_env_allocators") == "1"
    # the graph's own order (forward, then backward, each tensor freed soon after its last reader): ORT's default
    # depth-first order held more at once (peak RSS at GPT-2 124M, batch 4 x 128: -81 MiB)
    assert ours.execution_order == onnxruntime.ExecutionOrder.PRIORITY_BASED
    given = onnxruntime.SessionOptions()
    assert session_options_for(ORTTrainerOptions({"session_options": given})) is given
    assert given.enable_mem_pattern is True  # the user's options are theirs
    assert given.execution_order == onnxruntime.ExecutionOrder.DEFAULT
    with pytest.raises(RuntimeError, match="does not have configuration"):  # ORT's answer for an unset entry
        given.get_session_config_entry("session.use_env_allocators")
    torch.manual_seed(6)
    model = TinyLM(layers=2)
    plain = ORTTrainer(copy.deepcopy(model), LM_DESC, optim.AdamConfig(lr=1e-2), loss_fn=lm_loss)
    patterned = ORTTrainer(
        model, LM_DESC, optim.AdamConfig(lr=1e-2), loss_fn=lm_loss, options={"session_options": given}
    )
    for batch in lm_batches(3):
        torch.testing.assert_close(plain.train_step(*batch), patterned.train_step(*batch), atol=0, rtol=0)


def test_the_module_copy_is_released_before_gradients_and_moments_take_memory(monkeypatch):
    import gc
    import weakref

    import ort_trainer.engine._store as store_module

    torch.manual_seed(8)
    model = MLP()
    originals = [weakref.ref(p.data.untyped_storage()) for p in model.parameters()]
    seen = {}
    real = store_module.FlatOptimizer

    def optimizer_after_sharing(config, layout, params, grads):
        gc.collect()
        seen["module in the flat buffer"] = all(_inside(p, params) for p in model.parameters())
        seen["module storage freed"] = all(ref() is None for ref in originals)
        return real(config, layout, params, grads)

    monkeypatch.setattr(store_module, "FlatOptimizer", optimizer_after_sharing)
    ORTTrainer(model, MLP_DESC, optim.AdamConfig(lr=0.1), loss_fn=ce)
    assert seen == {"module in the flat buffer": True, "module storage freed": True}
