"""Fixtures every test folder shares, and the marker lists (the builders themselves live in ``tests/builders.py``,
so that spawned worker scripts and helper modules can import them too; tests call ``mlp_trainer`` from there)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.builders import legacy_trainer_options


@pytest.fixture
def trainer_options() -> dict[str, Any]:
    """A fresh copy of the legacy ``trainer_options`` record of a one-process Adam run."""
    return legacy_trainer_options()


# Tests that mean the onnxblock engine (onnxruntime-training's gradient builder, its graph rewrites, fp16 graphs,
# Megatron segments) live in tests/onnxblock/, the test wing of the engine wing: every test there is marked
# `onnxblock`. The stock-runtime venv's targets leave the folder out (`--ignore=tests/onnxblock` in the Makefile: its
# files import onnxruntime-training, and fail on import elsewhere, never skipped); elsewhere a test that runs on
# both engines marks its onnxblock parametrization itself (`pytest.param("onnxblock", marks=pytest.mark.onnxblock)`).
ONNXBLOCK_FOLDER = "onnxblock/"
# Tests over ~10 s each (the function's parametrizations together; measured 2026-11-27 at load 4-5 on 2 cores,
# `pytest --durations`): they run in `make test-slow` (CI), so that `make test` stays under 10 minutes. By
# "file::test" (every parametrization).
SLOW_TESTS = frozenset(
    {
        # 189 s; 35 s at load 6-7 since its fork helper builds the engine's modules once (2026-12-07)
        "checkpoint/test_checkpoint_crafted.py::test_every_reader_refuses_the_crafted_file",
        "interop/test_interop_hf.py::test_hugging_face_model_trains_like_torch_resumes_and_goes_back",  # 100 s
        "distributed/test_distributed.py::test_reshard_and_continue_matches_uninterrupted_training",  # 82 s
        "distributed/test_distributed.py::test_data_parallel_and_zero_match_one_process_on_the_whole_batch",  # 66 s
        "hf/test_checkpoints.py::test_checkpoints_rotate_and_resume_like_the_uninterrupted_run",  # 64 s
        # the uninterrupted HF run of the module's fixture (~35 s at load 2-4) is set up by the first of these
        "hf/test_resume.py::test_resume_true_skips_the_incomplete_newest_folder_and_ends_bit_exact",  # 40 s
        "hf/test_resume.py::test_resume_checks_read_only_the_counters_of_our_file",
        # 59 s; its 18 cases share one trained source state since 2026-12-07 (64 s at load 6, 105 s before)
        "interop/test_interop_state.py::test_every_check_happens_at_the_call_and_a_failed_load_changes_nothing",
        "package/test_docs.py::test_python_blocks_run_in_order_in_one_namespace",  # 50 s
        "package/test_packaging.py::test_import_from_the_repository_root",  # 47 s
        # 43 s
        "distributed/test_dropout_ranks.py::test_zero_ranks_with_dropout_resume_exactly_and_draw_their_own_masks",
        "distributed/test_distributed.py::test_bad_distributed_saves_fail_on_every_rank_without_hanging",  # 42 s
        "package/test_samples.py::test_train_lm_sample_learns_and_writes_the_loss_curve",  # 40 s
        # four sample runs, two of them ORTModule (182 s at load 6-7, an empty graph cache)
        "package/test_samples.py::test_train_lm_and_custom_loop_rerun_in_any_order_from_one_folder",
        "hf/test_numerics.py::test_compute_loss_override_and_callbacks_behave_as_in_hf",  # 38 s
        "engine/test_graph_cache.py::test_processes_building_the_same_graph_at_once_share_one_file",  # 37 s
        "distributed/test_distributed.py::test_checkpoint_manager_on_two_ranks_resumes_the_latest_set",  # 36 s
        # 33 s
        "checkpoint/test_checkpoint_corruption.py::test_damaged_files_load_identically_or_raise_checkpoint_error",
        "hf/test_numerics.py::test_llama_with_a_padding_idx_trains_like_transformers_trainer",  # 31 s
        # 54 s (three runs on the autograd engine, three of transformers.Trainer)
        "hf/test_graph_cache.py::test_two_trainers_whose_graphs_differ_each_get_their_own_and_train_as_transformers",
        "package/test_samples.py::test_resume_sample_continues_bit_for_bit_after_sigkill",  # 29 s
        "trainer/test_dropout_resume.py::test_a_new_process_resumes_bit_exact_with_dropout_on",  # 29 s
        "engine/test_share_module.py::test_shrinking_the_arena_keeps_the_numbers",  # 27 s
        "hf/test_checkpoints.py::test_load_best_model_at_end_restores_the_best_weights_everywhere",  # 25 s
        # its ZeRO-1 launch (24 s) is the module fixture zero1_set, shared with the data-parallel test's (2, 1) case
        "distributed/test_distributed.py::test_zero_checkpoint_set_aggregates_to_the_single_process_state",
        "distributed/test_distributed.py::test_reshard_two_ranks_to_one_process",  # 24 s
        # 24 s; 72 s with its shorter second run on the same folder (at load 6-7)
        "package/test_samples.py::test_distributed_sample_trains_with_zero_aggregates_and_generates",
        # 24 s
        "checkpoint/test_checkpoint_async.py::test_async_save_writes_the_state_of_the_call_while_training_goes_on",
        "engine/test_session_binding.py::test_returned_outputs_survive_later_steps_of_other_batch_sizes",  # 22 s
        "distributed/test_distributed.py::test_legacy_per_rank_paths_each_rank_writes_exactly_its_file",  # 21 s
        "engine/test_teardown.py::test_two_rank_zero_run_exits_with_the_group_destroyed_by_the_exit_hook",  # 20 s
        "trainer/test_trainer_state.py::test_resume_in_fresh_process_is_bit_identical",  # 20 s
        # 19 s
        "checkpoint/test_checkpoint_async.py::"
        "test_process_exit_waits_for_unfinished_saves_and_reports_a_failure_nobody_saw",
        "checkpoint/test_missing_folders.py::test_two_gloo_ranks_save_into_new_folders_after_training",  # 18 s
        "checkpoint/test_checkpoint_faults.py::test_an_async_save_started_at_exit_completes",  # 17 s
        "package/test_packaging.py::test_wheel_has_exactly_one_top_level_package",  # 17 s
        "engine/test_share_module.py::test_tied_weights_stay_tied_and_loads_reach_the_module",  # 17 s
        "checkpoint/test_checkpoint_aggregate.py::test_streaming_peak_memory_is_about_two_tensors",  # 16 s
        "trainer/test_dropout_resume.py::test_a_new_trainer_resumes_bit_exact_with_dropout_on",  # 16 s
        "amp/test_autograd_mixed_precision.py::test_fp16_graph_trains_as_autocast_with_gradscaler",  # 16 s (load 6)
        # 12 s
        "engine/test_share_module.py::"
        "test_a_hugging_face_module_trained_by_default_saves_and_reloads_with_save_pretrained",
        "interop/test_interop_models.py::test_position_ids_sliced_from_a_buffer_train_like_torch",  # 12 s
        "interop/test_interop_distributed.py::test_full_state_user_dicts_and_broadcast_from_rank0",  # 11 s
        "checkpoint/test_checkpoint_crafted.py::test_sound_files_pass_every_reader",  # 11 s
        "trainer/test_backward_attributes.py::test_cross_entropy_attributes_give_torchs_gradients",  # 11 s
        # training artifacts (docs/anywhere.md): tiny GPT-2 exports (~40 s cold, 120-170 s at load 8-10 on 2
        # workers); the main suite keeps the MLP for every optimizer, the round trips and the bad inputs
        "export/test_artifact_numbers.py::test_tiny_gpt2_artifact_trains_as_the_trainer_with_adamw",
        "export/test_artifact_numbers.py::test_tiny_gpt2_artifact_trains_as_the_trainer_with_every_optimizer",
        "export/test_artifact_numbers.py::test_dropout_draws_are_graph_inputs_and_the_trainer_s_masks_give_its_numbers",
        "export/test_artifact_round_trip.py::test_a_plain_torch_module_loads_the_trained_state_tied_weights_included",
        "package/test_benchmark_anywhere.py::"
        "test_anywhere_benchmark_times_both_contenders_and_keeps_the_artifact_for_other_runtimes",  # 44 s
        "engine/test_graph_cache.py::test_the_same_graph_is_loaded_and_any_change_is_a_new_entry",  # 11 s
        "package/test_docs.py::test_blocks_marked_processes_run_on_two_ranks",  # 10 s
        # 10 s
        "engine/test_autograd_engine.py::"
        "test_sgd_with_accumulation_equals_torch_padding_row_tied_head_batchnorm_and_new_batch_sizes",
        "module/test_ortmodule_ddp.py::test_two_gloo_ranks_equal_one_eager_process_on_the_whole_batch",  # 20 s
        # 30 s
        "distributed/test_objects_distributed.py::"
        "test_ddp_writes_once_and_zero_shards_aggregate_and_load_into_any_world_size",
        "engine/test_fork_safety.py::test_a_forked_child_frees_its_inherited_trainer_without_hanging",  # 24 s
        # 12 s at load 3, 34-55 s at load 5-6 (five forked children, three build a trainer)
        "engine/test_fork_exit.py::test_forked_children_that_train_exit_normally_with_their_code_and_their_output",
        # 40 s at load 5 (runs on stock onnxruntime since forked children exit: engine/_fork_safety.py)
        "checkpoint/test_checkpoint_fork.py::"
        "test_children_forked_at_every_phase_of_an_async_save_never_touch_the_published_file",
        # 23 s and 29 s at load 7 (both engines' first builds; a spawned process that imports torch and ORT)
        "onnxblock/test_shared_storage_onnxblock.py::"
        "test_shared_memory_module_trains_on_onnxblock_like_torch_and_the_autograd_engine",
        "onnxblock/test_shared_storage_onnxblock.py::test_a_module_received_through_a_spawn_queue_trains_on_onnxblock_like_torch",
        "hf/test_shapes.py::test_lm_collator_group_by_length_and_other_eval_batches_use_one_graph_each",  # 67 s loaded
        "engine/test_symbolic_shapes.py::test_one_graph_trains_and_evaluates_like_torch_at_every_shape",  # 75 s loaded
        # 28 s at load 4
        "engine/test_symbolic_shapes.py::test_gradient_accumulation_over_batches_of_different_lengths_equals_torch",
        # 22 s (MLP, CNN with BatchNorm, Embedding/LayerNorm/reshape; the MLP alone runs in `make test` too)
        "engine/test_onnx_model_engines.py::test_an_onnx_model_trains_on_the_autograd_engine_as_pytorch_trains_its_source",
        # 65 s at load 6 (two fresh interpreters, each exporting two graphs); 16 s (three ORTModule exports in
        # children, each importing the exporter anew)
        "engine/test_child_export.py::"
        "test_a_trainer_whose_graphs_build_in_a_child_trains_the_same_and_never_traces_or_imports_the_exporter",
        "engine/test_child_export.py::"
        "test_ortmodule_exports_in_a_child_train_as_pytorch_and_a_failed_export_says_what_it_said_here",
        # 2 x 30 s (two ranks, a GPT-2 trace each)
        "distributed/test_varlen_ranks.py::test_ranks_with_batches_of_different_lengths_train_one_graph_each_and_equal_torch",
        "hf/test_shapes.py::test_classifier_with_data_collator_with_padding_uses_one_graph_for_every_batch",  # 30 s
        # benchmarks/varlen.py at a tiny size: two cold builds (~35 s at load 2, ~60 s at load 5)
        "package/test_benchmark_varlen.py::test_ort_trainer_and_ortmodule_build_one_graph_per_mode_and_train_as_pytorch",
        # benchmarks/varlen_memory.py at a tiny size: three child processes, one cold build (~40 s)
        "package/test_benchmark_varlen.py::test_varlen_memory_splits_ort_trainer_s_rss_into_phases_and_a_cache_hit_skips_the_export",
    }
)
# `make test-latest`: a representative selection run in a fresh venv with the newest releases the declared ranges
# admit (no lock), so that an upstream release that breaks us turns CI red: both doors (ORTTrainer, ORTModule and
# the compile backend), checkpoints and resume, hf.Trainer against transformers.Trainer, a zoo subset, the samples,
# the DLPack route and the CLI's version report. By "file", "file::test" or "file::test[id]".
LATEST_TESTS = frozenset(
    {
        "engine/test_dlpack.py",
        "engine/test_autograd_engine.py::test_sgd_with_accumulation_equals_torch_padding_row_tied_head_batchnorm_and_new_batch_sizes",
        "engine/test_autograd_engine.py::test_bad_inputs_are_named_with_pytorchs_own_words_before_and_after_the_build",
        "module/test_ortmodule.py::test_a_transformer_with_dropout_trains_as_in_eager_over_five_adamw_steps",
        "module/test_ortmodule.py::test_on_cpu_the_outputs_come_from_onnx_runtime_and_keep_their_dtypes",
        "module/test_compile_backend.py::test_graph_breaks_run_their_pieces_in_onnx_runtime_and_train_as_in_eager",
        "trainer/test_trainer_numerics.py::test_transformer_lm_matches_torch_adamw",
        "trainer/test_trainer_numerics.py::test_cnn_batchnorm_statistics_and_eval_match_torch",
        "trainer/test_dropout_resume.py::test_a_new_trainer_resumes_bit_exact_with_dropout_on",
        "trainer/test_trainer_state.py::test_checkpoint_round_trip_with_user_dict",
        "trainer/test_trainer_state.py::test_legacy_checkpoint_loads_into_equivalent_trainer",
        "trainer/test_trainer_state.py::test_pytorch_format_loads_into_original_module_strictly",
        "hf/test_numerics.py::test_training_equals_transformers_trainer[cosine-clip-log2]",
        "zoo/test_zoo.py::test_one_symbolic_graph_trains_like_torch_at_every_shape[gpt2]",
        "zoo/test_zoo.py::test_one_symbolic_graph_trains_like_torch_at_every_shape[bert]",
        "zoo/test_zoo.py::test_a_custom_adamw_loop_over_the_wrapped_architecture_equals_eager[llama-ortmodule]",
        "package/test_samples.py::test_train_lm_sample_learns_and_writes_the_loss_curve",
        "package/test_versions.py",
        # symbolic shapes (issue V): one graph for images of several sizes on both doors
        "engine/test_symbolic_shapes.py::test_a_vision_model_fed_images_of_several_sizes_trains_one_graph_like_torch",
        "module/test_ortmodule_shapes.py::test_a_cnn_fed_two_image_sizes_then_others_runs_them_on_one_symbolic_graph",
        # training artifacts (issue Y): exported with the newest exporter, run by the newest runtime, and back
        "export/test_artifact_numbers.py::test_mlp_artifact_trains_as_the_trainer_for_20_steps_at_two_batch_sizes[adamw]",
        "export/test_artifact_round_trip.py::test_ten_steps_in_the_artifact_then_ten_in_the_trainer_equal_twenty_in_the_trainer[adamw]",
        "engine/test_aliased_inputs.py",
        # the exact GELU's one shared erf: the newest exporter's common-subexpression pass must still merge it
        "engine/test_gelu_graph.py::test_an_exact_gelu_computes_erf_once_and_trains_as_pytorch_at_two_batch_sizes",
    }
)
_TESTS = Path(__file__).parent


def _relative(path: Path) -> str:
    try:
        return path.relative_to(_TESTS).as_posix()
    except ValueError:
        return ""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    latest_found: set[str] = set()
    for item in items:
        relative = _relative(Path(str(item.fspath)))
        test = f"{relative}::{item.name.split('[')[0]}"
        latest_found |= {relative, test, f"{relative}::{item.name}"} & LATEST_TESTS
        if relative.startswith(ONNXBLOCK_FOLDER):
            item.add_marker(pytest.mark.onnxblock)
        if test in SLOW_TESTS:
            item.add_marker(pytest.mark.slow)
        if relative.startswith("checkpoint/"):
            item.add_marker(pytest.mark.checkpoint_package)
        if relative.startswith("js/"):
            item.add_marker(pytest.mark.js)
        if {relative, test, f"{relative}::{item.name}"} & LATEST_TESTS:
            item.add_marker(pytest.mark.latest)
    if (config.option.markexpr or "").strip().startswith("latest") and LATEST_TESTS - latest_found:
        # a renamed test or parametrization would silently shrink `make test-latest`'s selection
        missing = sorted(LATEST_TESTS - latest_found)
        raise pytest.UsageError(f"LATEST_TESTS entries that name no collected test: {missing}")


def pytest_configure(config: pytest.Config) -> None:
    """One graph cache per test run (the autograd engine's exported graphs), never the user's ~/.cache.

    Spawned ranks and workers inherit the environment, so a run's processes share it; a fresh run starts empty.
    """
    import os
    import tempfile

    if "ORT_TRAINER_GRAPH_CACHE_DIR" not in os.environ:
        os.environ["ORT_TRAINER_GRAPH_CACHE_DIR"] = tempfile.mkdtemp(prefix="ort_trainer_graphs_")
