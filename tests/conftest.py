"""Fixtures every test folder shares (the builders themselves live in ``tests/builders.py``, so that
spawned worker scripts and helper modules can import them too)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.builders import legacy_trainer_options, mlp_trainer


@pytest.fixture
def make_trainer() -> Callable[..., Any]:
    """`tests.builders.mlp_trainer`: ``make_trainer(model=None, *, config=None, seed=0, hidden=16, **options)``."""
    return mlp_trainer


@pytest.fixture
def trainer_options() -> dict[str, Any]:
    """A fresh copy of the legacy ``trainer_options`` record of a one-process Adam run."""
    return legacy_trainer_options()


# Test files that mean the onnxblock engine (onnxruntime-training's gradient builder, its graph rewrites,
# fp16 graphs, Megatron segments, ONNX-model input): every test in them is marked `onnxblock`. The stock-runtime
# venv runs `-m "not onnxblock"` (`make test-stock`), which then does not even import them; anywhere else they
# run, and without onnxruntime-training they fail on import (never skipped).
ONNXBLOCK_ONLY = frozenset(
    {
        "engine/test_build_memory.py",
        "graph/test_gelu_threads.py",
        "graph/test_graph_broadcast.py",
        "graph/test_graph_gelu.py",
        "graph/test_graph_relu.py",
        "graph/test_graph_rewrites.py",
        "graph/test_layer_norm_grad.py",
        "graph/test_mixed_precision_graph.py",
        "trainer/test_gradient_buffers.py",
        "amp/test_mixed_precision.py",
        "graph/test_scaled_sum.py",
        "graph/test_split_accumulation.py",
        "distributed/test_megatron.py",
        # Stock onnxruntime 1.31: a forked child that exits through sys.exit blocks forever in ORT's own C++
        # static destructors (pthread_cond_destroy on the parent's thread-pool state; microsoft/onnxruntime
        # PR 31961, open), so the test's os.fork children never report. Freeing inherited sessions in a child no
        # longer hangs (engine/_fork_safety.py, tests/engine/test_fork_safety.py); the exit is ORT's. It runs
        # where onnxruntime-training is installed (`make test-onnxblock`), where it passes.
        "checkpoint/test_checkpoint_fork.py",
    }
)
# Single tests that mean the onnxblock engine (its graph passes, fp16 graphs, Megatron, ONNX-model input, its
# debug graph files), by "file::test" prefix (parametrized ids included).
ONNXBLOCK_TESTS = frozenset(
    {
        # Megatron is refused by the autograd engine at construction, before the refusals these tests check
        "distributed/test_megatron_plan.py::test_what_h2_does_not_do_is_refused_before_any_process_group",
        # the onnxblock session's own hooks and graph names
        "engine/test_memory_release.py::test_memory_is_released_after_the_build_and_once_after_the_first_training_run",
        "trainer/test_legacy_models.py::test_training_graph_dump_is_the_gradient_graph_and_the_docs_say_so",
        "trainer/test_trainer_api.py::test_check_model_export_and_graph_save_paths",
        # the TorchScript export of a deep copy (the autograd engine traces with the module's state as inputs)
        "trainer/test_legacy_models.py::test_a_module_that_cannot_be_deep_copied_trains_and_is_left_as_it_was",
        "trainer/test_legacy_models.py::test_a_module_that_cannot_be_deep_copied_shows_one_training_forward_in_its_statistics",
        "trainer/test_trainer_api.py::test_dimension_baked_by_the_exporter_gets_a_clear_error",
        # onnxblock-only inputs: _internal_use.extra_postprocess, an onnx.ModelProto model
        "trainer/test_legacy_models.py::test_extra_postprocess_gets_the_forward_graph_and_its_result_is_used",
        "trainer/test_trainer_api.py::test_onnx_model_trains_like_the_torch_model",
        "trainer/test_trainer_api.py::test_onnx_model_checks",
        # the onnxblock engine's message from its graph's label specs; the autograd engine names the input with
        # PyTorch's own message (tests/engine/test_autograd_engine.py)
        "trainer/test_input_errors.py::test_label_index_out_of_range_where_the_graph_does_not_say_the_class_count",
    }
)
_TESTS = Path(__file__).parent


def _relative(path: Path) -> str:
    try:
        return path.relative_to(_TESTS).as_posix()
    except ValueError:
        return ""


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    if _relative(collection_path) in ONNXBLOCK_ONLY and "not onnxblock" in (config.option.markexpr or ""):
        return True
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        relative = _relative(Path(str(item.fspath)))
        test = f"{relative}::{item.name.split('[')[0]}"
        if relative in ONNXBLOCK_ONLY or test in ONNXBLOCK_TESTS:
            item.add_marker(pytest.mark.onnxblock)


def pytest_configure(config: pytest.Config) -> None:
    """One graph cache per test run (the autograd engine's exported graphs), never the user's ~/.cache.

    Spawned ranks and workers inherit the environment, so a run's processes share it; a fresh run starts empty.
    """
    import os
    import tempfile

    if "ORT_TRAINER_GRAPH_CACHE_DIR" not in os.environ:
        os.environ["ORT_TRAINER_GRAPH_CACHE_DIR"] = tempfile.mkdtemp(prefix="ort_trainer_graphs_")
