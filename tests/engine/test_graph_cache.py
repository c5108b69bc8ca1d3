"""The autograd engine's on-disk graph cache: hits for the same graph, misses for any change, atomic files
shared by concurrent builders, a size bound, a switch, and rebuilt when a file is damaged. The engine always
traces; a hit is found by the trace's full key and loaded without an export, in this process or a resumed one.
A change that no cheaper key could see (a global the forward reads) is a new entry, right from the first step.
Files older releases left in the folder (the pre-key's ``.alias`` files) are ignored and pruned."""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import pathlib
import shutil
import stat
import subprocess
import sys
import textwrap
import time

import onnx
import pytest
import torch
from onnx import numpy_helper

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


@contextlib.contextmanager
def _no_export():
    """Fails any export inside the block: what runs in it must come from the cache."""
    from ort_trainer.engine.autograd import _build as _autograd_build

    real = _autograd_build.graph_to_onnx

    def refuse(*args, **kwargs):
        raise AssertionError("exported although the graph is in the cache")

    _autograd_build.graph_to_onnx = refuse
    try:
        yield
    finally:
        _autograd_build.graph_to_onnx = real


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
    with _no_export():  # a second trainer on the same model: traced, then loaded under the trace's key
        assert _trained_loss() == first  # the cached graph computes the same loss
    assert "graph cache: training graph loaded from" in caplog.text and len(_files(cache_dir)) == 1
    _trained_loss(hidden=9)  # another model structure
    assert len(_files(cache_dir)) == 2
    caplog.clear()
    with _no_export():  # another size of the named dim "batch": the same symbolic graph
        _trained_loss(batch=5)
    assert len(_files(cache_dir)) == 2 and "graph cache: training graph loaded from" in caplog.text
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


def _identity_model():
    """The smallest graph worth storing: y = x."""
    return onnx.helper.make_model(
        onnx.helper.make_graph(
            [onnx.helper.make_node("Identity", ["x"], ["y"])],
            "g",
            [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1])],
            [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1])],
        )
    )


def _stored_size(model, folder):
    """The bytes ``model`` takes in a cache folder (its graph and the digest that ends it), measured in ``folder``,
    which is then removed."""
    key = GraphCache.key("probe", {})
    GraphCache(folder).put(key, model)
    size = (folder / f"{key}.onnx").stat().st_size
    shutil.rmtree(folder)
    return size


def test_the_folder_stays_under_its_bound_least_recently_used_first(tmp_path):
    cache = GraphCache(tmp_path, max_bytes=1)
    model = _identity_model()
    size = _stored_size(model, tmp_path / "probe")
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
    assert not list(cache_dir.glob(".*.tmp-*"))  # no temporary file left behind


@pytest.mark.processes
def test_a_resumed_process_loads_the_training_graph_without_exporting(cache_dir):
    """Another process (a resumed job) on the graph this one stored: at the same batch size and at another size of
    the named dim, the graph is loaded and never exported, and the losses are this process's."""
    expected = {4: _trained_loss(), 5: _trained_loss(batch=5)}
    script = textwrap.dedent(
        f"""
        import logging, sys
        sys.path.insert(0, {str(REPO)!r})
        logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(message)s")
        from tests.engine.test_graph_cache import _no_export, _trained_loss
        with _no_export():
            print("LOSS", _trained_loss(), _trained_loss(batch=5))
        """
    )
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.count("graph cache: training graph loaded from") == 2, run.stdout
    (line,) = [line for line in run.stdout.splitlines() if line.startswith("LOSS")]
    assert [float(v) for v in line.split()[1:]] == [expected[4], expected[5]]
    assert len(_files(cache_dir)) == 1


_ACTIVATION = {"now": torch.tanh}  # a global the forward reads: only a trace sees a change of it


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


def _eager_eval_loss(activation):
    """PyTorch's loss of `_activated_run`'s first batch on its untrained model, in eval mode (no Dropout)."""
    torch.manual_seed(0)
    _ACTIVATION["now"] = activation
    model = _Activated().eval()
    g = torch.Generator().manual_seed(1)
    x, label = torch.randn(4, 6, generator=g), torch.randint(0, 3, (4,), generator=g)
    with torch.no_grad():
        return float(torch.nn.functional.cross_entropy(model(x), label))


def test_a_change_only_a_trace_sees_is_a_new_entry_right_from_the_first_step(cache_dir, caplog, monkeypatch):
    """The forward reads a global (an edit the removed pre-key could not see and rolled back after a stale first
    step): the trace's key differs, so the changed model gets its own graphs, and its first eval and training
    steps are PyTorch's and an uncached run's."""
    tanh = _activated_run(torch.tanh, eval_first=True)  # fills the cache: an eval graph and a training graph
    assert len(_files(cache_dir)) == 2
    caplog.set_level(logging.INFO, logger="ort_trainer")
    with _no_export():
        again = _activated_run(torch.tanh, eval_first=True)  # the same model: both graphs loaded
    assert caplog.text.count("graph cache: training graph loaded from") == 1
    assert caplog.text.count("graph cache: eval graph loaded from") == 1
    caplog.clear()
    changed = _activated_run(torch.sigmoid, eval_first=True)  # another activation: two new entries
    assert "loaded from" not in caplog.text and len(_files(cache_dir)) == 4
    monkeypatch.setenv("ORT_TRAINER_GRAPH_CACHE", "0")  # the reference: built from the trace, no cache
    fresh = _activated_run(torch.sigmoid, eval_first=True)
    fresh_tanh = _activated_run(torch.tanh, eval_first=True)
    assert changed[:2] == fresh[:2] and again[:2] == fresh_tanh[:2] == tanh[:2] and changed[0][0] != again[0][0]
    assert changed[1] == pytest.approx(_eager_eval_loss(torch.sigmoid), rel=1e-5)
    assert again[1] == pytest.approx(_eager_eval_loss(torch.tanh), rel=1e-5) and changed[1] != again[1]
    for name, value in fresh[2].items():
        torch.testing.assert_close(changed[2][name], value, rtol=0, atol=0)


def test_a_model_that_no_longer_traces_fails_its_first_step_and_leaves_the_trainer_as_it_was(cache_dir):
    _activated_run(torch.tanh)
    torch.manual_seed(0)
    _ACTIVATION["now"] = _data_dependent
    model = _Activated()  # the same module as the cached tanh model: only the trace tells them apart
    before = {k: v.clone() for k, v in model.state_dict().items()}
    trainer = _sgd_trainer(model)
    with pytest.raises(ValueError, match=r"could not trace .*test_graph_cache.py:\d+ \(return x if x.sum\(\) > 0"):
        trainer.train_step(torch.randn(4, 6), torch.randint(0, 3, (4,)))
    state = trainer.state_dict()
    for name, value in before.items():
        torch.testing.assert_close(state["model"]["full_precision"][name], value, rtol=0, atol=0)
    with pytest.raises(ValueError, match="could not trace"):  # and again: never the stale graph
        trainer.train_step(torch.randn(4, 6), torch.randint(0, 3, (4,)))


def _leftover_aliases(folder, count=2, age=1000):
    """``.alias`` files as older releases left them (a pre-key file naming a full key), the others damaged;
    ``age`` seconds old (negative: newer than anything stored now)."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = [folder / f"{GraphCache.key(str(i), {})}.alias" for i in range(count)]
    paths[0].write_text(GraphCache.key("graph", {}))
    for path in paths[1:]:
        path.write_bytes(b"\xffnot a key" * 1000)
    when = time.time() - age
    for path in paths:
        os.utime(path, (when, when))
    return paths


def test_leftover_pre_key_files_are_ignored_and_pruned(cache_dir, caplog):
    """A cache folder from a release with the pre-key: its ``.alias`` files are never read (the graph is found by
    the trace's key), and the next store deletes them."""
    first = _trained_loss()
    leftovers = _leftover_aliases(cache_dir)
    caplog.set_level(logging.INFO, logger="ort_trainer")
    with _no_export():
        assert _trained_loss() == first
    assert "graph cache: training graph loaded from" in caplog.text and "unreadable" not in caplog.text
    assert all(path.exists() for path in leftovers)  # a hit writes nothing: they wait for the next store
    _trained_loss(hidden=9)  # a new entry: stored, the folder trimmed
    assert not list(cache_dir.glob("*.alias")) and len(_files(cache_dir)) == 2


def test_leftover_pre_key_files_do_not_count_against_the_bound(tmp_path):
    """The bound is kept over the graphs alone: an old, large ``.alias`` file never evicts a graph."""
    cache = GraphCache(tmp_path, max_bytes=1)
    model = _identity_model()
    cache.max_bytes = 2 * _stored_size(model, tmp_path / "probe")
    _leftover_aliases(tmp_path, count=3, age=-1000)  # each larger than the whole bound, and newer than any graph
    keys = [GraphCache.key(str(i), {}) for i in range(2)]
    cache.put(keys[0], model)
    cache.put(keys[1], model)
    assert cache.get(keys[0]) is not None and cache.get(keys[1]) is not None
    assert sorted(p.suffix for p in tmp_path.iterdir() if not p.name.endswith(".lock")) == [".onnx", ".onnx"]


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


def test_check_model_export_runs_on_a_cached_graph(cache_dir, caplog):
    """``debug.check_model_export`` runs the module eagerly right after the build: on a graph loaded from the cache
    too, with the loss of the run that stored it."""
    first = _trained_loss()
    caplog.set_level(logging.INFO, logger="ort_trainer")
    assert _trained_loss(debug={"check_model_export": True}) == first
    assert "graph cache: training graph loaded from" in caplog.text


_SWITCH = {"weighted": False}  # a global the forward reads: only a trace sees it


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
def test_a_switched_model_gets_its_own_graph_with_its_inputs_idle_parameters_and_draws(
    cached, now, cache_dir, caplog, monkeypatch
):
    """The cached graph of the same module read other inputs, trained other parameters and drew other random numbers
    than the switched model's: the switched model gets its own graph, is fed the inputs it reads, its idle parameters
    stay put, and its Dropout masks are the step's own, as in an uncached run."""
    try:
        _switched_run(cached)  # fills the cache with the other graph of the same module
        caplog.set_level(logging.INFO, logger="ort_trainer")
        changed = _switched_run(now)
        assert "graph cache: training graph loaded from" not in caplog.text
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


@pytest.mark.parametrize("value", ["0", "-5", "abc"])
def test_a_bad_bound_names_the_variable_the_value_the_unit_and_how_to_turn_the_cache_off(value, monkeypatch):
    """``ORT_TRAINER_GRAPH_CACHE_MB`` not a positive number: the error says which variable, what it held, that it
    counts MiB and must be > 0, and that ``ORT_TRAINER_GRAPH_CACHE=0`` is how to turn the cache off."""
    from ort_trainer.graph.autograd import graph_cache_from_env

    monkeypatch.delenv("ORT_TRAINER_GRAPH_CACHE", raising=False)
    monkeypatch.setenv("ORT_TRAINER_GRAPH_CACHE_MB", value)
    with pytest.raises(ValueError) as raised:
        graph_cache_from_env()
    message = str(raised.value)
    for part in ("ORT_TRAINER_GRAPH_CACHE_MB", repr(value), "MiB", "> 0", "ORT_TRAINER_GRAPH_CACHE=0"):
        assert part in message, message


def _weights_equal(ran, reference):
    """The final weights of two `_activated_run`s, bit for bit."""
    assert ran[2].keys() == reference[2].keys()
    for name, value in reference[2].items():
        torch.testing.assert_close(ran[2][name], value, rtol=0, atol=0, msg=name)


def test_a_flipped_bit_in_a_cached_constant_is_a_miss_and_the_graph_is_rebuilt(cache_dir, caplog):
    """One bit of a float constant flipped in the stored graph: the file still parses and the graph still runs, with
    the constant negated. Its sha256 no longer matches, so the entry is dropped with a warning and rebuilt, and three
    steps end on the weights of the run that exported the graph (nothing read from the cache)."""
    exported = _activated_run(torch.tanh, steps=3)
    (path,) = cache_dir.glob("*.onnx")
    data = bytearray(path.read_bytes())
    constant = next(
        t
        for t in onnx.load_from_string(bytes(data)).graph.initializer
        if t.data_type == onnx.TensorProto.FLOAT and t.raw_data and numpy_helper.to_array(t).any()
    )
    blob = constant.SerializeToString()
    high = data.find(blob) + blob.rfind(constant.raw_data) + len(constant.raw_data) - 1  # little-endian: sign byte
    data[high] ^= 0x80
    path.write_bytes(bytes(data))
    (flipped,) = [t for t in onnx.load(path).graph.initializer if t.name == constant.name]  # still parses
    assert numpy_helper.to_array(flipped).reshape(-1)[-1] == -numpy_helper.to_array(constant).reshape(-1)[-1]
    caplog.set_level(logging.WARNING, logger="ort_trainer")
    _weights_equal(_activated_run(torch.tanh, steps=3), exported)
    assert "graph cache: dropping" in caplog.text and "sha256" in caplog.text, caplog.text
    assert GraphCache(cache_dir).get(path.stem) is not None  # rebuilt: the new file verifies


def test_another_models_graph_copied_under_this_key_is_a_miss_and_the_graph_is_rebuilt(cache_dir, caplog):
    """The relu model's graph copied over the tanh model's entry: the same inputs, parameter names and shapes, so it
    would load and train relu. (The relu graph is the tanh graph with its Tanh node made Relu, stored by the cache
    under another key: a sound entry of that key, made without a third export.) Each entry's sha256 covers its key,
    so the copy is dropped with a warning and the tanh graph rebuilt: three steps end on the weights of the run that
    exported it."""
    exported = _activated_run(torch.tanh, steps=3)
    (tanh_path,) = cache_dir.glob("*.onnx")
    relu = onnx.load(tanh_path)
    (node,) = [n for n in relu.graph.node if n.op_type == "Tanh"]
    node.op_type = "Relu"
    relu_key = GraphCache.key("the relu model", {})
    GraphCache(cache_dir).put(relu_key, relu)
    shutil.copyfile(cache_dir / f"{relu_key}.onnx", tanh_path)
    caplog.set_level(logging.WARNING, logger="ort_trainer")
    _weights_equal(_activated_run(torch.tanh, steps=3), exported)
    assert "graph cache: dropping" in caplog.text and "sha256" in caplog.text, caplog.text
    ops = {n.op_type for n in onnx.load(tanh_path).graph.node}
    assert "Tanh" in ops and "Relu" not in ops  # rebuilt: the tanh graph again


@pytest.mark.parametrize("umask, mode", [(0o002, 0o664), (0o077, 0o600)], ids=["group-shared", "private"])
def test_the_files_the_cache_creates_follow_the_umask(umask, mode, tmp_path):
    """A folder shared by a group (umask 002): the graphs and locks are group-writable, as any file its user creates,
    so that the group's other users can read and replace them; a private umask keeps them private."""
    folder = tmp_path / "graphs"
    cache, key = GraphCache(folder), GraphCache.key("shared", {})
    before = os.umask(umask)
    try:
        with cache.building(key):
            cache.put(key, _identity_model())
    finally:
        os.umask(before)
    assert stat.S_IMODE((folder / f"{key}.onnx").stat().st_mode) == mode
    assert stat.S_IMODE((folder / f"{key}.lock").stat().st_mode) == mode
    assert cache.get(key) is not None


@pytest.mark.parametrize("how", ["permission-denied", "a-directory"])
def test_an_entry_that_cannot_be_read_is_a_miss_and_training_goes_on(how, cache_dir, caplog, monkeypatch):
    """Another user's entry this one may not read (mode 000), or a directory in the entry's place (which cannot be
    replaced either): a miss with a warning, the graph built in memory, the loss of a readable cache. Root reads a
    file of mode 000, so as root the cache's read of that entry raises the PermissionError any other user gets."""
    first = _trained_loss()
    (path,) = cache_dir.glob("*.onnx")
    if how == "a-directory":
        path.unlink()
        path.mkdir()
    else:
        path.chmod(0)
        if os.geteuid() == 0:
            read = pathlib.Path.read_bytes

            def refuse(self):
                if self == path:
                    raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(self))
                return read(self)

            monkeypatch.setattr(pathlib.Path, "read_bytes", refuse)
    caplog.set_level(logging.WARNING, logger="ort_trainer")
    assert _trained_loss() == first
    assert f"graph cache: cannot read {path}" in caplog.text, caplog.text


def test_a_symbolic_link_planted_as_a_lock_is_not_followed(cache_dir, tmp_path, caplog):
    """``<key>.lock`` replaced by a symbolic link to a path outside the folder: the next build does not follow it (no
    file appears there), warns, and trains without the cache, with the loss of the run that filled it."""
    first = _trained_loss()
    (lock,) = cache_dir.glob("*.lock")
    (entry,) = cache_dir.glob("*.onnx")
    entry.unlink()  # the next build exports and would store the graph: under a lock it must not create
    lock.unlink()
    outside = tmp_path / "outside" / "planted"
    outside.parent.mkdir()
    lock.symlink_to(outside)
    caplog.set_level(logging.WARNING, logger="ort_trainer")
    assert _trained_loss() == first
    assert not outside.exists() and lock.is_symlink()
    assert "symbolic link" in caplog.text and "without it" in caplog.text, caplog.text


def test_an_entry_is_written_by_the_checkpoint_file_rules(tmp_path, monkeypatch):
    """The cache publishes as a checkpoint save does (``checkpoint.format.files``): a temporary name carrying the
    writer's host and pid, the file fsynced before an atomic rename, then the folder."""
    from ort_trainer.checkpoint.format import files

    published, synced = [], []
    real_publish, real_fsync = files.publish, os.fsync
    monkeypatch.setattr(
        files,
        "publish",
        lambda tmp, path, overwrite: (published.append((tmp, path, overwrite)), real_publish(tmp, path, overwrite))[1],
    )
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(os.readlink(f"/proc/self/fd/{fd}")), real_fsync(fd))[1])
    cache, key = GraphCache(tmp_path), GraphCache.key("published", {})
    cache.put(key, _identity_model())
    [(tmp, path, overwrite)] = published
    assert path == tmp_path / f"{key}.onnx" and overwrite
    assert files.TEMP_RE.match(tmp.name) and f".{os.getpid()}-" in tmp.name, tmp.name
    assert synced[0] == str(tmp) and str(tmp_path) in synced[1:], synced  # the file before its rename, then the folder
    assert cache.get(key) is not None and not list(tmp_path.glob(".*.tmp-*"))


def test_a_killed_writers_temporary_file_is_removed_at_the_next_write_and_a_live_ones_is_kept(tmp_path):
    from ort_trainer.checkpoint.format.files import host_tag

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    key = GraphCache.key("stale", {})
    killed = tmp_path / f".{key}.onnx.tmp-{host_tag()}.{int(dead.stdout)}-0badf00d"
    live = tmp_path / f".{key}.onnx.tmp-{host_tag()}.{os.getppid()}-0badf00d"
    for leftover in (killed, live):
        leftover.write_bytes(b"half a graph")
    GraphCache(tmp_path).put(GraphCache.key("another", {}), _identity_model())
    assert not killed.exists() and live.exists()


def test_the_trainer_and_ortmodule_both_get_their_graphs_through_get_or_build(cache_dir, monkeypatch):
    """One cache API for both doors: the same key, lock, verified read and write, whoever asks."""
    from ort_trainer import ORTModule

    asked, real = [], GraphCache.get_or_build

    def recorded(self, key, build, usable=lambda model: True):
        model, hit = real(self, key, build, usable)
        asked.append(hit)
        return model, hit

    monkeypatch.setattr(GraphCache, "get_or_build", recorded)
    _trained_loss()
    assert asked == [False]  # the trainer's training graph, built and stored
    _trained_loss()
    assert asked == [False, True]  # a second trainer finds it
    torch.manual_seed(0)
    module = ORTModule(torch.nn.Sequential(torch.nn.Linear(6, 3), torch.nn.Tanh()))
    module(torch.randn(4, 6)).sum().backward()
    assert len(asked) >= 4 and asked[2:] == [False] * (len(asked) - 2)  # ORTModule's forward and backward graphs
