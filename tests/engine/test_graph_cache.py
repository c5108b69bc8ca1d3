"""The autograd engine's on-disk graph cache: hits for the same graph, misses for any change, atomic files
shared by concurrent builders, a size bound, a switch, and rebuilt when a file is damaged. A resumed job
finds its graph by a pre-key read off the module and runs its first step on it while a trace verifies it:
a graph the trace rejects (an edit the pre-key cannot see) is rebuilt and the step run again on it."""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import sys
import textwrap
import time

import onnx
import pytest
import torch

from ort_trainer import ORTTrainer, optim
from ort_trainer.graph.autograd import GraphCache
from tests.paths import REPO

DESC = {"inputs": [("x", ["batch", 6]), ("label", ["batch"])], "outputs": [("loss", [], True)]}


def _sgd_trainer(model, debug=None, **utils):
    options = {"utils": {"engine": "autograd", **utils}, "debug": debug or {}}
    return ORTTrainer(model, DESC, optim.SGDConfig(lr=0.1), loss_fn=torch.nn.functional.cross_entropy, options=options)


def _trained_loss(hidden=8, batch=4, debug=None, width=6, **utils):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(width, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 3))
    desc = {"inputs": [("x", ["batch", width]), ("label", ["batch"])], "outputs": [("loss", [], True)]}
    options = {"utils": {"engine": "autograd", **utils}, "debug": debug or {}}
    loss_fn = torch.nn.functional.cross_entropy
    trainer = ORTTrainer(model, desc, optim.SGDConfig(lr=0.1), loss_fn=loss_fn, options=options)
    g = torch.Generator().manual_seed(1)
    x, label = torch.randn(batch, width, generator=g), torch.randint(0, 3, (batch,), generator=g)
    return float(trainer.train_step(x, label))


def _files(folder):
    return sorted(p.name for p in folder.glob("*.onnx"))


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    folder = tmp_path / "graphs"
    monkeypatch.setenv("ORT_TRAINER_GRAPH_CACHE_DIR", str(folder))
    monkeypatch.delenv("ORT_TRAINER_GRAPH_CACHE", raising=False)
    return folder


def test_the_same_graph_is_loaded_and_any_change_is_a_new_entry(cache_dir, caplog):
    caplog.set_level(logging.INFO, logger="ort_trainer")
    first = _trained_loss()
    assert len(_files(cache_dir)) == 1 and "loaded from" not in caplog.text
    caplog.clear()
    assert _trained_loss() == first  # the cached graph computes the same loss
    assert "graph cache: training graph found by the model's pre-key" in caplog.text and len(_files(cache_dir)) == 1
    assert "rebuilding" not in caplog.text
    _trained_loss(hidden=9)  # another model structure
    assert len(_files(cache_dir)) == 2
    caplog.clear()
    _trained_loss(batch=5)  # another size of the named dim "batch": the same symbolic graph, found by its pre-key
    assert len(_files(cache_dir)) == 2 and "found by the model's pre-key" in caplog.text
    _trained_loss(batch=5, width=7)  # another size of a dim model_desc fixes: a new entry
    assert len(_files(cache_dir)) == 3


def test_the_cache_can_be_turned_off(cache_dir, monkeypatch):
    _trained_loss(graph_cache=False)
    assert not cache_dir.exists() or not _files(cache_dir)
    monkeypatch.setenv("ORT_TRAINER_GRAPH_CACHE", "0")
    _trained_loss()
    assert not cache_dir.exists() or not _files(cache_dir)


def test_a_damaged_file_is_dropped_and_rebuilt(cache_dir, caplog):
    first = _trained_loss()
    (path,) = cache_dir.glob("*.onnx")
    path.write_bytes(b"\x08\x07not a model")
    caplog.set_level(logging.WARNING, logger="ort_trainer")
    assert _trained_loss() == first
    assert "dropping unreadable" in caplog.text
    onnx.load(path)  # rewritten whole


def test_the_folder_stays_under_its_bound_least_recently_used_first(tmp_path):
    cache = GraphCache(tmp_path, max_bytes=1)
    model = onnx.helper.make_model(
        onnx.helper.make_graph(
            [onnx.helper.make_node("Identity", ["x"], ["y"])],
            "g",
            [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1])],
            [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1])],
        )
    )
    size = len(model.SerializeToString())
    cache.max_bytes = 2 * size
    keys = [GraphCache.key(str(i), {}) for i in range(3)]
    cache.put(keys[0], model)
    cache.put(keys[1], model)
    assert cache.get(keys[0]) is not None  # used: now the most recent
    old = time.time() - 100
    os.utime(tmp_path / f"{keys[1]}.onnx", (old, old))
    cache.put(keys[2], model)
    assert cache.get(keys[1]) is None and cache.get(keys[0]) is not None and cache.get(keys[2]) is not None
    with pytest.raises(ValueError, match="64 hex digits"):
        cache.get("../etc/passwd")
    with pytest.raises(ValueError, match="max_bytes must be > 0"):
        GraphCache(tmp_path, 0)


def test_keys_change_with_options_and_versions():
    assert GraphCache.key("f", {"training": True}) != GraphCache.key("f", {"training": False})
    assert GraphCache.key("f", {"a": 1}) == GraphCache.key("f", {"a": 1})
    assert GraphCache.key("f", {}) != GraphCache.key("g", {})


@pytest.mark.processes
def test_processes_building_the_same_graph_at_once_share_one_file(cache_dir):
    script = textwrap.dedent(
        f"""
        import sys
        sys.path.insert(0, {str(REPO)!r})
        from tests.engine.test_graph_cache import _trained_loss
        print("LOSS", _trained_loss())
        """
    )
    runs = [subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True) for _ in range(3)]
    outputs = [run.communicate(timeout=300)[0] for run in runs]
    assert all(run.returncode == 0 for run in runs), outputs
    losses = {line for out in outputs for line in out.splitlines() if line.startswith("LOSS")}
    assert len(losses) == 1, outputs
    assert len(_files(cache_dir)) == 1
    assert not list(cache_dir.glob("*.tmp"))


_ACTIVATION = {"now": torch.tanh}  # a global the forward reads: a change of it is invisible to the pre-key


class _Activated(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.first, self.drop, self.second = torch.nn.Linear(6, 8), torch.nn.Dropout(0.3), torch.nn.Linear(8, 3)

    def forward(self, x):
        return self.second(self.drop(_ACTIVATION["now"](self.first(x))))


def _data_dependent(x):
    return x if x.sum() > 0 else -x  # Python control flow on a tensor's value: cannot be traced


@pytest.fixture(autouse=True)
def _tanh_again():
    yield
    _ACTIVATION["now"] = torch.tanh


def _activated_run(activation, steps=2, eval_first=False):
    """(losses, eval loss, final weights) of a few steps of an `_Activated` model."""
    torch.manual_seed(0)
    _ACTIVATION["now"] = activation
    trainer = _sgd_trainer(_Activated())
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(4, 6, generator=g), torch.randint(0, 3, (4,), generator=g)) for _ in range(steps)]
    evaluated = float(trainer.eval_step(*batches[0])) if eval_first else None
    losses = [float(trainer.train_step(*batch)) for batch in batches]
    return losses, evaluated, {k: v.clone() for k, v in trainer.state_dict()["model"]["full_precision"].items()}


def test_a_graph_found_by_its_pre_key_is_verified_and_rebuilt_when_the_model_changed_unseen(
    cache_dir, caplog, monkeypatch
):
    _activated_run(torch.tanh)  # fills the cache
    assert len(list(cache_dir.glob("*.alias"))) == 1
    caplog.set_level(logging.INFO, logger="ort_trainer")
    # the same model again: the pre-key finds the graph, the trace agrees, nothing is rebuilt
    again = _activated_run(torch.tanh)
    assert "found by the model's pre-key" in caplog.text and "rebuilding" not in caplog.text
    caplog.clear()
    # another activation: the same pre-key, another graph. The first step ran on the stale graph; its result is
    # thrown away, the graph rebuilt from the trace, and the step run again with the same Dropout masks
    changed = _activated_run(torch.sigmoid)
    assert "found by the model's pre-key" in caplog.text and "rebuilding it from the trace" in caplog.text
    caplog.clear()
    monkeypatch.setenv("ORT_TRAINER_GRAPH_CACHE", "0")  # the reference: built from the trace, no cache
    fresh = _activated_run(torch.sigmoid)
    fresh_tanh = _activated_run(torch.tanh)
    assert changed[0] == fresh[0] and again[0] == fresh_tanh[0] and changed[0] != again[0]
    for name, value in fresh[2].items():
        torch.testing.assert_close(changed[2][name], value, rtol=0, atol=0)


def test_an_eval_step_first_waits_for_the_training_graph_s_verifying_trace(cache_dir, caplog, monkeypatch):
    first = _activated_run(torch.tanh, eval_first=True)
    caplog.set_level(logging.WARNING, logger="ort_trainer")
    changed = _activated_run(torch.sigmoid, eval_first=True)  # both graphs found by pre-key, both rejected
    assert caplog.text.count("rebuilding it from the trace") == 2
    monkeypatch.setenv("ORT_TRAINER_GRAPH_CACHE", "0")
    fresh = _activated_run(torch.sigmoid, eval_first=True)
    assert changed[:2] == fresh[:2] and changed[1] != first[1]


def test_a_model_that_no_longer_traces_fails_its_first_step_and_leaves_the_trainer_as_it_was(cache_dir):
    _activated_run(torch.tanh)
    torch.manual_seed(0)
    _ACTIVATION["now"] = _data_dependent
    model = _Activated()  # the same pre-key as the cached tanh model
    before = {k: v.clone() for k, v in model.state_dict().items()}
    trainer = _sgd_trainer(model)
    with pytest.raises(ValueError, match=r"could not trace .*test_graph_cache.py:\d+ \(return x if x.sum\(\) > 0"):
        trainer.train_step(torch.randn(4, 6), torch.randint(0, 3, (4,)))
    state = trainer.state_dict()
    for name, value in before.items():
        torch.testing.assert_close(state["model"]["full_precision"][name], value, rtol=0, atol=0)
    with pytest.raises(ValueError, match="could not trace"):  # and again: never the stale graph
        trainer.train_step(torch.randn(4, 6), torch.randint(0, 3, (4,)))


def test_a_damaged_pre_key_file_is_dropped(cache_dir, caplog):
    first = _trained_loss()
    (alias,) = cache_dir.glob("*.alias")
    alias.write_text("not a key")
    caplog.set_level(logging.WARNING, logger="ort_trainer")
    assert _trained_loss() == first
    assert "dropping unreadable" in caplog.text and len(alias.read_text()) == 64


def _quick(model, inputs=None, training=True):
    from ort_trainer.config.model_desc import validate_model_desc
    from ort_trainer.graph.autograd import quick_fingerprint

    desc = validate_model_desc(DESC, require_loss=True)
    params = {n: p.detach() for n, p in model.named_parameters()}
    inputs = inputs or [torch.zeros(4, 6), torch.zeros(4, dtype=torch.long)]
    return quick_fingerprint(model, torch.nn.functional.cross_entropy, desc, params, {}, inputs, training=training)


def test_the_pre_key_sees_structure_sizes_attributes_constants_and_shapes_but_not_weights():
    torch.manual_seed(0)
    model = _Activated()
    key = _quick(model)
    assert _quick(model) == key
    with torch.no_grad():
        model.first.weight.add_(1.0)  # the weights' values are inputs of the graph, not part of it
    assert _quick(model) == key
    assert _quick(model, [torch.zeros(5, 6), torch.zeros(5, dtype=torch.long)]) != key  # another batch size
    assert _quick(model, training=False) != key
    model.drop.p = 0.5  # a plain attribute: Dropout's probability
    assert _quick(model) != key
    model.drop.p = 0.3
    model.register_buffer("table", torch.arange(3))  # a constant buffer: its value is baked into the graph
    with_table = _quick(model)
    assert with_table != key
    model.table[0] = 7
    assert _quick(model) != with_table
    handle = model.first.register_forward_hook(lambda module, args, out: out * 2)
    assert _quick(model) not in (key, with_table)
    handle.remove()
    key = _quick(model)
    model._scale = 2.0  # a private plain attribute (an HF loss wrapper's factor)
    assert _quick(model) != key
    del model._scale
    assert _quick(model) == key
    model.activation = torch.tanh  # a function kept in an attribute
    with_tanh = _quick(model)
    model.activation = torch.sigmoid
    with_sigmoid = _quick(model)
    model.activation = _data_dependent
    assert len({key, with_tanh, with_sigmoid, _quick(model)}) == 4
    del model.activation
    _ACTIVATION["now"] = torch.sigmoid  # a global the forward reads: not seen (the verifying trace catches it)
    assert _quick(model) == key


def test_graph_names_round_trip_and_refuse_what_is_not_theirs():
    from ort_trainer.graph.autograd import GraphNames, RandomInput

    names = GraphNames(
        input_names=["w", "x", "draw"],
        output_names=["loss", "w_grad"],
        trained=["w"],
        idle=["v"],
        updated=[],
        unused_inputs=("mask",),
        state_count=1,
        random_inputs=[RandomInput("draw", (4, 8), torch.float32, "keep", 0.7, (8, 1))],
    )
    assert GraphNames.from_json(names.to_json()) == names
    for text in ("not json", "{}", '{"inputs": 3}', names.to_json().replace('"float32"', '"nonsense"')):
        with pytest.raises(ValueError, match="not the names of a cached graph"):
            GraphNames.from_json(text)


def test_check_model_export_traces_before_the_first_run_instead(cache_dir, caplog):
    """``debug.check_model_export`` runs the module eagerly right after the build, which a trace in a thread must not
    overlap: the cached graph is found by the full key of a trace made first."""
    first = _trained_loss()
    caplog.set_level(logging.INFO, logger="ort_trainer")
    assert _trained_loss(debug={"check_model_export": True}) == first
    assert "graph cache: training graph loaded from" in caplog.text and "pre-key" not in caplog.text


_SWITCH = {"weighted": False}  # a global the forward reads: no pre-key can see it


class _Switched(torch.nn.Module):
    """Weighted, it reads the ``weight`` input, trains ``spare`` and draws Dropout masks; unweighted, it does none
    of these."""

    def __init__(self):
        super().__init__()
        self.first, self.second, self.spare = torch.nn.Linear(6, 8), torch.nn.Linear(8, 3), torch.nn.Linear(8, 3)
        self.drop = torch.nn.Dropout(0.3)

    def forward(self, x, label, weight):
        hidden = torch.relu(self.first(x))
        if _SWITCH["weighted"]:
            hidden = self.drop(hidden)
            logits = self.second(hidden) + self.spare(hidden)
            losses = torch.nn.functional.cross_entropy(logits, label, reduction="none")
            return (losses * weight).mean()
        return torch.nn.functional.cross_entropy(self.second(hidden), label)


def _switched_run(weighted):
    """(train losses, eval loss, final weights) of three clipped SGD steps of `_Switched`."""
    _SWITCH["weighted"] = weighted
    torch.manual_seed(0)
    desc = {
        "inputs": [("x", ["batch", 6]), ("label", ["batch"]), ("weight", ["batch"])],
        "outputs": [("loss", [], True)],
    }
    options = {"utils": {"engine": "autograd", "grad_norm_clip": True}}
    trainer = ORTTrainer(_Switched(), desc, optim.SGDConfig(lr=0.5), options=options)
    g = torch.Generator().manual_seed(1)
    batches = [
        (torch.randn(4, 6, generator=g), torch.randint(0, 3, (4,), generator=g), torch.rand(4, generator=g))
        for _ in range(3)
    ]
    with pytest.warns(UserWarning, match="not used") if not weighted else contextlib.nullcontext():
        losses = [float(trainer.train_step(*batch)) for batch in batches]
    evaluated = float(trainer.eval_step(*batches[0]))
    return losses, evaluated, {k: v.clone() for k, v in trainer.state_dict()["model"]["full_precision"].items()}


@pytest.mark.parametrize("cached, now", [(False, True), (True, False)], ids=["input-appears", "input-goes"])
def test_a_rejected_graph_s_inputs_idle_parameters_and_gradients_follow_the_rebuilt_graph(
    cached, now, cache_dir, caplog, monkeypatch
):
    """The graph found by the pre-key read other inputs, trained other parameters and drew other random numbers than
    the trace's graph: the rebuilt graph is fed the inputs it reads, its idle parameters stay put, no stale gradient
    is left behind, and its Dropout masks are the step's own (as in an uncached run)."""
    try:
        _switched_run(cached)  # fills the cache under the same pre-key
        caplog.set_level(logging.WARNING, logger="ort_trainer")
        changed = _switched_run(now)
        assert "rebuilding it from the trace" in caplog.text
        monkeypatch.setenv("ORT_TRAINER_GRAPH_CACHE", "0")
        fresh = _switched_run(now)
    finally:
        _SWITCH["weighted"] = False
    assert changed[:2] == fresh[:2]
    for name, value in fresh[2].items():
        torch.testing.assert_close(changed[2][name], value, rtol=0, atol=0, msg=name)


def test_every_exporter_package_version_is_part_of_the_key(monkeypatch):
    """A new onnx-ir (the exporter's IR and optimizer passes) can change an exported graph: its version is in the key,
    as torch's, onnxscript's and onnx's are."""
    from importlib import metadata

    from ort_trainer.graph.autograd import _cache

    real = metadata.version
    keys = {}
    for package in ("torch", "onnxscript", "onnx-ir", "onnx", "onnxruntime"):
        monkeypatch.setattr(_cache.metadata, "version", lambda name, p=package: "0.0.0" if name == p else real(name))
        keys[package] = GraphCache.key("f" * 64, {"training": True})
    monkeypatch.setattr(_cache.metadata, "version", real)
    baseline = GraphCache.key("f" * 64, {"training": True})
    assert all(key != baseline for key in keys.values()), keys
