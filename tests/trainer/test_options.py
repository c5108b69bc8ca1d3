"""ORTTrainerOptions: legacy dict in, validated frozen sections out, every problem named by path."""

import copy
import dataclasses
import importlib

import onnxruntime
import pytest

from ort_trainer.amp import DynamicLossScaler
from ort_trainer.config._sections import default_cast_strategy
from ort_trainer.config.options import (
    BatchOptions,
    OptionsError,
    OptionTypeError,
    ORTTrainerOptions,
)
from ort_trainer.engine._build import session_options_for  # the session options a trainer makes


def _cast_strategy():
    """The cast-strategy enum of this runtime: onnxruntime-training's, or the stand-in with its names (stock)."""
    return type(default_cast_strategy())


@pytest.fixture(autouse=True)
def _no_torchrun_env(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)


DEFAULTS = {
    "batch": {"gradient_accumulation_steps": 1},
    "device": {"id": "cpu", "mem_limit": 0},
    "distributed": {
        "world_rank": 0,
        "world_size": 1,
        "local_rank": 0,
        "data_parallel_size": 1,
        "horizontal_parallel_size": 1,
        "horizontal_parallel_blocks": [],
        "pipeline_parallel": {
            "pipeline_parallel_size": 1,
            "num_pipeline_micro_batches": 1,
            "pipeline_cut_info_string": "",
            "sliced_schema": {},
            "sliced_axes": {},
            "sliced_tensor_names": [],
        },
        "allreduce_post_accumulation": False,
        "deepspeed_zero_optimization": {"stage": 0},
        "enable_adasum": False,
    },
    "lr_scheduler": None,
    "mixed_precision": {"enabled": False, "loss_scaler": None, "dtype": "float16"},
    "graph_transformer": {
        "attn_dropout_recompute": False,
        "gelu_recompute": False,
        "transformer_layer_recompute": False,
        "number_recompute_layers": 0,
        "propagate_cast_ops_config": {"strategy": _cast_strategy().FLOOD_FILL, "level": 1, "allow": []},
    },
    "utils": {
        "frozen_weights": [],
        "grad_norm_clip": True,
        "memory_efficient_gradient": False,
        "run_symbolic_shape_infer": False,
        "share_module_parameters": True,
        "shrink_memory_arena": False,
        "engine": "auto",
        "graph_cache": True,
        "intra_op_threads": 0,
    },
    "debug": {
        "deterministic_compute": False,
        "check_model_export": False,
        "graph_save_paths": {
            "model_after_graph_transforms_path": "",
            "model_with_gradient_graph_path": "",
            "model_with_training_graph_path": "",
            "model_with_training_graph_after_optimization_path": "",
        },
    },
    "_internal_use": {
        "enable_internal_postprocess": True,
        "extra_postprocess": None,
        "onnx_opset_version": 17,
        "enable_onnx_contrib_ops": True,
    },
    "provider_options": {},
    "session_options": None,
}


def test_every_default():
    assert ORTTrainerOptions().to_dict() == DEFAULTS
    assert ORTTrainerOptions({}) == ORTTrainerOptions(None)


def test_legacy_dict_becomes_attributes():
    options = ORTTrainerOptions(
        {
            "batch": {"gradient_accumulation_steps": 4},
            "device": {"id": "cuda:1", "mem_limit": 1 << 30},
            "utils": {"frozen_weights": ["fc1.bias"]},
            "debug": {"graph_save_paths": {"model_with_training_graph_path": "train.onnx"}},
            "distributed": {"deepspeed_zero_optimization": {"stage": 2}},
            "_internal_use": {"onnx_opset_version": 14},
        }
    )
    assert options.batch.gradient_accumulation_steps == 4
    assert (options.device.id, options.device.mem_limit) == ("cuda:1", 1 << 30)
    assert options.utils.frozen_weights == ("fc1.bias",)
    assert options.debug.graph_save_paths.model_with_training_graph_path == "train.onnx"
    assert options.distributed.deepspeed_zero_optimization.stage == 2
    assert options._internal_use.onnx_opset_version == 14
    assert options.utils.grad_norm_clip is True  # untouched keys keep their defaults


def test_section_instances_are_accepted_as_values():
    options = ORTTrainerOptions({"batch": BatchOptions(gradient_accumulation_steps=3)})
    assert options.batch.gradient_accumulation_steps == 3


def test_caller_dict_is_never_mutated_or_shared():
    weights = ["w1"]
    raw = {
        "utils": {"frozen_weights": weights},
        "provider_options": {"CPUExecutionProvider": {"arena": "1"}},
        "mixed_precision": {"enabled": True},
    }
    snapshot = copy.deepcopy(raw)
    options = ORTTrainerOptions(raw)
    assert raw == snapshot  # in particular no loss scaler was written into it
    weights.append("w2")
    raw["provider_options"]["CPUExecutionProvider"]["arena"] = "0"
    assert options.utils.frozen_weights == ("w1",)
    assert options.provider_options == {"CPUExecutionProvider": {"arena": "1"}}


def test_options_are_immutable():
    options = ORTTrainerOptions()
    with pytest.raises(AttributeError, match="ORTTrainerOptions is immutable"):
        options.batch = BatchOptions()
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.batch.gradient_accumulation_steps = 2


def test_copy_from_instance_is_equal_and_independent():
    scaler = DynamicLossScaler()
    original = ORTTrainerOptions(
        {"mixed_precision": {"enabled": True, "loss_scaler": scaler}, "provider_options": {"X": {"a": "1"}}}
    )
    clone = ORTTrainerOptions(original)
    assert clone == original and clone is not original
    assert clone.provider_options is not original.provider_options
    assert clone.mixed_precision.loss_scaler is scaler  # objects are kept by reference
    assert ORTTrainerOptions(original.to_dict()) == original
    original.to_dict()["provider_options"]["X"]["a"] = "2"
    assert original.provider_options["X"]["a"] == "1"


def test_repr_shows_sections():
    text = repr(ORTTrainerOptions({"device": {"id": "cuda"}}))
    assert text.startswith("ORTTrainerOptions(batch=BatchOptions(gradient_accumulation_steps=1), device=DeviceOptions(")
    assert "id='cuda'" in text


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"bogus": 1}, "bogus: unknown option; valid keys at the top level: batch, device, distributed, lr_scheduler"),
        ({"batch": {"size": 1}}, "batch.size: unknown option; valid keys under 'batch': gradient_accumulation_steps"),
        (
            {"distributed": {"pipeline_parallel": {"stages": 2}}},
            "distributed.pipeline_parallel.stages: unknown option; valid keys under 'distributed.pipeline_parallel': "
            "pipeline_parallel_size, num_pipeline_micro_batches,",
        ),
        (
            {"debug": {"graph_save_paths": {"x": ""}}},
            "debug.graph_save_paths.x: unknown option; valid keys under 'debug.graph_save_paths': model_after",
        ),
    ],
)
def test_unknown_keys_name_the_path_and_list_valid_keys(raw, message):
    with pytest.raises(OptionsError, match=message.replace(".", r"\.").replace("(", r"\(")):
        ORTTrainerOptions(raw)


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (
            {"batch": {"gradient_accumulation_steps": True}},
            r"batch.gradient_accumulation_steps: expected int, got True",
        ),
        ({"batch": {"gradient_accumulation_steps": 2.0}}, r"batch.gradient_accumulation_steps: expected int, got 2.0"),
        ({"mixed_precision": {"enabled": 1}}, r"mixed_precision.enabled: expected bool, got 1 \(int\)"),
        ({"batch": 3}, r"batch: expected a dict for 'batch', got 3 \(int\)"),
        ({"device": {"id": 0}}, r"device.id: expected str, got 0 \(int\)"),
        ({"utils": {"frozen_weights": "w"}}, r"utils.frozen_weights: expected list of str, got 'w'"),
        ({"utils": {"frozen_weights": ["w", 1]}}, r"utils.frozen_weights: expected list of str"),
        ({"lr_scheduler": "linear"}, r"lr_scheduler: "),
        (
            {"mixed_precision": {"enabled": True, "loss_scaler": 2.0}},
            r"loss_scaler: expected an amp.LossScaler or None",
        ),
        ({"session_options": {}}, r"session_options: expected onnxruntime.SessionOptions or None, got \{\}"),
        ({"provider_options": {"CUDA": "x"}}, r"provider_options: expected dict of dicts"),
        ({"_internal_use": {"extra_postprocess": 3}}, r"_internal_use.extra_postprocess: expected a callable or None"),
        (
            {"graph_transformer": {"propagate_cast_ops_config": {"strategy": 2}}},
            r"propagate_cast_ops_config.strategy: expected an onnxruntime.training.PropagateCastOpsStrategy",
        ),
        (
            {"distributed": {"pipeline_parallel": {"sliced_schema": {"x": [1, True]}}}},
            r"sliced_schema: expected dict of str -> list of int",
        ),
    ],
)
def test_wrong_types_are_type_errors_naming_path_expected_and_value(raw, message):
    with pytest.raises(OptionTypeError, match=message) as info:
        ORTTrainerOptions(raw)
    assert isinstance(info.value, TypeError) and isinstance(info.value, ValueError)


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"batch": {"gradient_accumulation_steps": 0}}, "expected int >= 1, got 0"),
        ({"device": {"id": "gpu"}}, "device.id: expected 'cpu', 'cuda' or 'cuda:N', got 'gpu'"),
        ({"device": {"id": "cuda:x"}}, "device.id: expected 'cpu', 'cuda' or 'cuda:N'"),
        ({"device": {"mem_limit": -1}}, "device.mem_limit: expected int >= 0, got -1"),
        ({"_internal_use": {"onnx_opset_version": 13}}, "onnx_opset_version: expected int between 14 and 17, got 13"),
        ({"_internal_use": {"onnx_opset_version": 18}}, "onnx_opset_version: expected int between 14 and 17, got 18"),
        ({"distributed": {"deepspeed_zero_optimization": {"stage": 3}}}, "stage: expected int between 0 and 2, got 3"),
        ({"graph_transformer": {"propagate_cast_ops_config": {"level": -2}}}, "level: expected int >= -1, got -2"),
        (
            {"mixed_precision": {"loss_scaler": DynamicLossScaler()}},
            "Loss Scaler cannot be specified when Mixed Precision is not enabled",
        ),
    ],
)
def test_out_of_range_values_are_value_errors(raw, message):
    with pytest.raises(OptionsError, match=message) as info:
        ORTTrainerOptions(raw)
    assert not isinstance(info.value, TypeError)


def test_every_problem_is_reported_in_one_error_sorted():
    raw = {"utils": {"grad_norm_clip": "yes"}, "batch": {"gradient_accumulation_steps": 0, "x": 1}, "zzz": {}}
    with pytest.raises(OptionsError) as info:
        ORTTrainerOptions(raw)
    paths = [p.path for p in info.value.problems]
    assert paths == ["batch.gradient_accumulation_steps", "batch.x", "utils.grad_norm_clip", "zzz"]
    assert "4 problem(s)" in str(info.value)


def test_mixed_precision_creates_a_dynamic_loss_scaler():
    options = ORTTrainerOptions({"mixed_precision": {"enabled": True}})
    assert isinstance(options.mixed_precision.loss_scaler, DynamicLossScaler)
    other = ORTTrainerOptions({"mixed_precision": {"enabled": True}})
    assert other.mixed_precision.loss_scaler is not options.mixed_precision.loss_scaler


def test_session_options_are_kept_by_reference():
    session_options = onnxruntime.SessionOptions()
    assert ORTTrainerOptions({"session_options": session_options}).session_options is session_options


def test_intra_op_threads_keep_our_other_session_settings():
    made = session_options_for(ORTTrainerOptions({"utils": {"intra_op_threads": 1}}))
    assert made.intra_op_num_threads == 1
    assert made.get_session_config_entry("session.intra_op.allow_spinning") == "0"
    assert made.enable_mem_pattern is False and made.log_severity_level == 3
    assert session_options_for(ORTTrainerOptions()).intra_op_num_threads == 0  # ORT's default: one per core


def test_intra_op_threads_beside_own_session_options_is_refused_naming_both():
    options = ORTTrainerOptions({"utils": {"intra_op_threads": 2}, "session_options": onnxruntime.SessionOptions()})
    with pytest.raises(ValueError, match=r"utils.intra_op_threads=2 and options.session_options are both given"):
        session_options_for(options)
    with pytest.raises(OptionsError, match=r"utils.intra_op_threads: expected int >= 0, got -1"):
        ORTTrainerOptions({"utils": {"intra_op_threads": -1}})


def test_lr_scheduler_instance_is_accepted():
    lr_scheduler = importlib.import_module("ort_trainer.optim.lr_scheduler")
    scheduler = lr_scheduler.ConstantWarmupLRScheduler(total_steps=10, warmup=0.5)
    assert ORTTrainerOptions({"lr_scheduler": scheduler}).lr_scheduler is scheduler


# --- torchrun environment and topology --------------------------------------------------------


def test_torchrun_environment_gives_the_distributed_defaults(monkeypatch):
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "1")
    d = ORTTrainerOptions().distributed
    assert (d.world_rank, d.world_size, d.local_rank, d.data_parallel_size) == (3, 4, 1, 4)
    explicit = ORTTrainerOptions({"distributed": {"world_rank": 0, "world_size": 2, "local_rank": 0}}).distributed
    assert (explicit.world_rank, explicit.world_size, explicit.local_rank) == (0, 2, 0)


def test_bad_torchrun_environment_is_named(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "four")
    with pytest.raises(
        OptionsError, match="distributed.world_size: environment variable WORLD_SIZE='four' is not an int"
    ):
        ORTTrainerOptions()


def test_data_parallel_size_is_world_size_over_horizontal_parallel_size():
    d = ORTTrainerOptions({"distributed": {"world_size": 8, "horizontal_parallel_size": 2}}).distributed
    assert d.data_parallel_size == 4
    with pytest.raises(OptionsError, match="horizontal_parallel_size: must divide distributed.world_size=8, got 3"):
        ORTTrainerOptions({"distributed": {"world_size": 8, "horizontal_parallel_size": 3}})
    with pytest.raises(OptionsError, match=r"data_parallel_size: must equal world_size // horizontal_parallel_size"):
        ORTTrainerOptions({"distributed": {"world_size": 8, "horizontal_parallel_size": 2, "data_parallel_size": 8}})


def test_ranks_must_be_inside_the_world():
    with pytest.raises(OptionsError, match="distributed.world_rank: must be < distributed.world_size=2, got 2"):
        ORTTrainerOptions({"distributed": {"world_rank": 2, "world_size": 2}})


# --- check_implemented --------------------------------------------------------------------------


def test_defaults_are_implemented():
    ORTTrainerOptions().check_implemented()
    ORTTrainerOptions({"distributed": {"world_size": 2, "horizontal_parallel_size": 2}}).check_implemented()  # Megatron


@pytest.mark.parametrize(
    ("raw", "path"),
    [
        ({"distributed": {"pipeline_parallel": {"pipeline_parallel_size": 2}}}, "pipeline_parallel_size=2"),
        ({"distributed": {"pipeline_parallel": {"num_pipeline_micro_batches": 4}}}, "num_pipeline_micro_batches=4"),
        ({"distributed": {"enable_adasum": True}}, "distributed.enable_adasum=True: Adasum"),
        ({"graph_transformer": {"gelu_recompute": True}}, "graph_transformer.gelu_recompute=True: recomputation"),
        ({"graph_transformer": {"attn_dropout_recompute": True}}, "attn_dropout_recompute=True"),
        ({"graph_transformer": {"transformer_layer_recompute": True}}, "transformer_layer_recompute=True"),
        ({"graph_transformer": {"propagate_cast_ops_config": {"level": 2}}}, "propagate_cast_ops_config.level=2"),
        ({"graph_transformer": {"propagate_cast_ops_config": {"allow": ["Add"]}}}, "allow=('Add',)"),
        (
            {"graph_transformer": {"propagate_cast_ops_config": {"strategy": _cast_strategy().NONE}}},
            "propagate_cast_ops_config.strategy=",
        ),
        ({"utils": {"memory_efficient_gradient": True}}, "utils.memory_efficient_gradient=True"),
    ],
)
def test_check_implemented_rejects_unsupported_options(raw, path):
    options = ORTTrainerOptions(raw)
    with pytest.raises(NotImplementedError, match="not supported yet") as info:
        options.check_implemented()
    assert path in str(info.value) and "is not implemented yet" in str(info.value)


def test_check_implemented_lists_every_offender():
    options = ORTTrainerOptions({"distributed": {"enable_adasum": True}, "utils": {"memory_efficient_gradient": True}})
    with pytest.raises(NotImplementedError) as info:
        options.check_implemented()
    assert "distributed.enable_adasum" in str(info.value) and "utils.memory_efficient_gradient" in str(info.value)
