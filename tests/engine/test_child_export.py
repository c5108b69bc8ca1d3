"""Exports in a forked child process (`ORT_TRAINER_EXPORT_IN_CHILD`): the same graphs and numbers as an export in
this process, the exporter's memory never in the training process, errors, warnings and logs as before."""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import onnx
import pytest
import torch

from ort_trainer import ORTModule, ORTTrainer, optim
from ort_trainer.engine.autograd import _build as autograd_build
from ort_trainer.graph.autograd import TraceError, build_in_child, export_in_child
from ort_trainer.graph.autograd._child_export import AUTO_BYTES, ENV
from tests.models import KthValue  # an op without an ONNX translation

ROOT = Path(__file__).resolve().parents[2]

# one fresh interpreter per setting: which modules it imported is part of the answer
_RUN = textwrap.dedent(
    """
    import json, sys
    import torch
    from ort_trainer import ORTTrainer, optim
    from ort_trainer.engine.autograd import _build

    traces = []  # the traces run in this process (a child's are counted in the child)
    _trace_graph = _build.trace_graph
    _build.trace_graph = lambda *args, **kwargs: traces.append(1) or _trace_graph(*args, **kwargs)

    class LM(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(50, 16)
            self.mix = torch.nn.Linear(16, 16)
            self.head = torch.nn.Linear(16, 50)
            self.register_buffer("offset", torch.tensor([3]))  # an integer buffer: a constant input of the graph

        def forward(self, ids):
            return self.head(torch.tanh(self.mix(self.emb((ids + self.offset) % 50))))

    def loss(logits, label):
        return torch.nn.functional.cross_entropy(logits.reshape(-1, 50), label.reshape(-1))

    torch.manual_seed(0)
    desc = {"inputs": [("ids", ["batch", "seq"]), ("label", ["batch", "seq"])], "outputs": [("loss", [], True)]}
    trainer = ORTTrainer(LM(), desc, optim.AdamConfig(lr=1e-2), loss_fn=loss,
                         options={"utils": {"engine": "autograd", "graph_cache": False}})
    g = torch.Generator().manual_seed(1)
    losses = []
    for rows, length in ((4, 6), (3, 9), (5, 2)):
        batch = [torch.randint(0, 50, (rows, length), generator=g) for _ in range(2)]
        losses.append(float(trainer.train_step(*batch)))
    losses.append(float(trainer.eval_step(*batch)))
    try:  # the label check the first training graph asks for
        trainer.train_step(batch[0], torch.full_like(batch[1], 50))
        refused = ""
    except ValueError as error:
        refused = str(error)
    result = {"losses": losses, "exporter_imported": "onnxscript" in sys.modules, "traces": len(traces)}
    print("RESULT " + json.dumps({**result, "refused": refused}))
    """
)


def _run(setting: str) -> dict:
    env = {**os.environ, ENV: setting, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", _RUN], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(x for x in done.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line.removeprefix("RESULT "))


def test_a_trainer_whose_graphs_build_in_a_child_trains_the_same_and_never_traces_or_imports_the_exporter():
    in_child, here = _run("1"), _run("0")
    assert in_child["losses"] == here["losses"]  # bit for bit: the same graphs, three shapes and eval
    assert not in_child["exporter_imported"]  # onnxscript was imported by the children only
    assert here["exporter_imported"]
    assert in_child["traces"] == 0 and here["traces"] >= 2  # the training and the eval graph traced in children
    for run in (in_child, here):  # the label input a child found is checked here
        assert re.search(r"label.*50", run["refused"]), run["refused"]


def _mlp_and_reference() -> tuple[torch.nn.Module, torch.nn.Module]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    reference = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    reference.load_state_dict(model.state_dict())
    return model, reference


def test_ortmodule_exports_in_a_child_train_as_pytorch_and_a_failed_export_says_what_it_said_here(monkeypatch):
    monkeypatch.setenv(ENV, "1")
    model, reference = _mlp_and_reference()
    wrapped = ORTModule(model)
    x = torch.randn(5, 6)
    wrapped(x).square().sum().backward()
    reference(x).square().sum().backward()
    for (name, got), expected in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(got.grad, expected.grad, rtol=1e-5, atol=1e-6, msg=name)
    with pytest.raises(TraceError, match=r"no ONNX translation for aten\.kthvalue\), called at .*models\.py"):
        ORTModule(KthValue())(torch.randn(3, 4))


def test_a_trainer_exporting_in_a_child_trains_as_pytorch(monkeypatch):
    monkeypatch.setenv(ENV, "1")
    model, reference = _mlp_and_reference()
    desc = {"inputs": [("x", ["batch", 6]), ("y", ["batch"])], "outputs": [("loss", [], True)]}
    trainer = ORTTrainer(
        model, desc, optim.SGDConfig(lr=0.1), loss_fn=torch.nn.functional.cross_entropy,
        options={"utils": {"engine": "autograd", "graph_cache": False, "grad_norm_clip": False}},
    )  # fmt: skip
    opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(2)
    for rows in (4, 7, 2):
        x, y = torch.randn(rows, 6, generator=g), torch.randint(0, 3, (rows,), generator=g)
        got = trainer.train_step(x, y)
        opt.zero_grad()
        expected = torch.nn.functional.cross_entropy(reference(x), y)
        expected.backward()
        opt.step()
        torch.testing.assert_close(got, expected.detach(), rtol=1e-6, atol=1e-6)
    state = trainer.state_dict(pytorch_format=True)
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(state[key], value, rtol=1e-5, atol=1e-6, msg=key)


def _tiny_model(name: str = "y") -> onnx.ModelProto:
    node = onnx.helper.make_node("Identity", ["x"], [name])
    graph = onnx.helper.make_graph(
        [node], "g", [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2])],
        [onnx.helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, [2])],
    )  # fmt: skip
    return onnx.helper.make_model(graph)


def test_the_child_s_warnings_and_log_records_are_replayed_here(caplog):
    def build():
        warnings.warn("a warning from the export", UserWarning, stacklevel=1)
        logging.getLogger("ort_trainer.graph").warning("a record from the export")
        return _tiny_model()

    with caplog.at_level(logging.DEBUG, logger="ort_trainer"), pytest.warns(UserWarning, match="from the export"):
        model = build_in_child(build, "test")
    assert model == _tiny_model()
    said = [(r.name, r.levelno, r.getMessage()) for r in caplog.records]
    assert said[0] == ("ort_trainer.graph", logging.WARNING, "a record from the export")
    assert len(said) == 2 and re.fullmatch(
        r"test graph exported in a child \(pid \d+\): \d+ MiB of its own", said[1][2]
    )


def test_a_child_that_fails_or_is_killed_leaves_the_export_to_this_process():
    parent = os.getpid()
    calls = []

    def failing():
        calls.append(os.getpid())  # the child's list is its own copy: only this process's calls are seen here
        if os.getpid() != parent:
            raise RuntimeError("the exporter failed in the child")
        return _tiny_model("here")

    assert build_in_child(failing, "test") == _tiny_model("here")
    assert calls == [parent]

    def killed():
        if os.getpid() != parent:
            os.kill(os.getpid(), signal.SIGKILL)  # the OOM killer's way out
        return _tiny_model("again")

    assert build_in_child(killed, "test") == _tiny_model("again")

    def raising():
        raise ValueError("the export's own error")

    with pytest.raises(ValueError, match="the export's own error"):  # raised here, as without a child
        build_in_child(raising, "test")


def test_the_setting_is_checked_and_auto_sends_only_large_graphs(monkeypatch):
    small = [torch.zeros(10)]
    large = [torch.empty(AUTO_BYTES // 4, device="meta"), torch.zeros(3)]  # sizes without the memory
    monkeypatch.delenv(ENV, raising=False)
    assert export_in_child(large) and not export_in_child(small)
    monkeypatch.setenv(ENV, "1")
    assert export_in_child(small)
    monkeypatch.setenv(ENV, "0")
    assert not export_in_child(large)
    monkeypatch.setenv(ENV, "sometimes")
    with pytest.raises(ValueError, match=r"ORT_TRAINER_EXPORT_IN_CHILD must be auto, 1 or 0, got 'sometimes'"):
        export_in_child(small)


def test_a_graph_exported_in_a_child_is_stored_in_the_cache_and_found_by_the_next_trainer(monkeypatch, tmp_path):
    """The child's graph goes into the graph cache like any other, and the next trainer of the same model finds it
    (its child traces, hits and sends the cached graph back): no export, the same numbers."""
    monkeypatch.setenv(ENV, "1")
    monkeypatch.setenv("ORT_TRAINER_GRAPH_CACHE_DIR", str(tmp_path))
    desc = {"inputs": [("x", ["batch", 6]), ("y", ["batch"])], "outputs": [("loss", [], True)]}
    g = torch.Generator().manual_seed(4)
    batches = [(torch.randn(rows, 6, generator=g), torch.randint(0, 3, (rows,), generator=g)) for rows in (4, 5)]
    losses = []
    for _ in range(2):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
        trainer = ORTTrainer(
            model, desc, optim.SGDConfig(lr=0.1), loss_fn=torch.nn.functional.cross_entropy,
            options={"utils": {"engine": "autograd", "grad_norm_clip": False}},
        )  # fmt: skip
        losses.append([float(trainer.train_step(*batch)) for batch in batches])
        if len(losses) == 1:
            assert len(list(tmp_path.glob("*.onnx"))) == 1  # stored after the first trainer's export
            # the second trainer must not export at all (its child inherits this; a failed child builds here)
            monkeypatch.setattr(autograd_build, "graph_to_onnx", _no_export)
    assert losses[0] == losses[1]


def _no_export(*args, **kwargs):
    raise AssertionError("a graph the cache holds was exported again")
