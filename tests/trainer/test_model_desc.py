"""model_desc validation (legacy phrases, every problem in one error) and call-time input checks."""

import re

import pytest
import torch

from ort_trainer.config.model_desc import (
    InputDescription,
    InputDescriptionTyped,
    ModelDescription,
    OutputDescription,
    OutputDescriptionTyped,
    check_inputs,
    validate_model_desc,
)

DESC = {
    "inputs": [("x", ["batch", 784]), ("label", ["batch"])],
    "outputs": [("loss", [], True), ("probs", ["batch", 10])],
}


def test_valid_description_becomes_legacy_namedtuples():
    desc = validate_model_desc(DESC, require_loss=True)
    assert desc.inputs == (InputDescription("x", ["batch", 784]), InputDescription("label", ["batch"]))
    assert desc.outputs == (OutputDescription("loss", [], True), OutputDescription("probs", ["batch", 10], False))
    name, shape = desc.inputs[0]  # legacy: (name, shape) until the dtype is known
    assert (name, shape) == ("x", ["batch", 784]) and isinstance(shape, list)
    assert desc.input_names == ["x", "label"] and desc.output_names == ["loss", "probs"]
    assert desc.loss_index == 0 and desc.loss_output.name == "loss"
    assert desc.inputs[0].dtype is None
    with pytest.raises(AttributeError):
        desc.inputs[0].name = "y"


def test_caller_dict_is_not_mutated_and_round_trips():
    before = repr(DESC)
    desc = validate_model_desc(DESC, require_loss=False)
    assert repr(DESC) == before
    assert desc.to_dict() == {
        "inputs": [("x", ["batch", 784]), ("label", ["batch"])],
        "outputs": [("loss", [], True), ("probs", ["batch", 10], False)],
    }


def test_two_element_outputs_and_no_loss_allowed_when_not_required():
    desc = validate_model_desc({"inputs": [("x", [2])], "outputs": [("y", [2])]}, require_loss=False)
    assert desc.loss_index is None and desc.loss_output is None


def test_dynamic_axes():
    desc = validate_model_desc(DESC, require_loss=True)
    assert desc.dynamic_axes() == {"x": {0: "batch"}, "label": {0: "batch"}, "probs": {0: "batch"}}


def _problems(model_desc, require_loss=False) -> str:
    with pytest.raises(ValueError, match="^Invalid model_desc") as info:
        validate_model_desc(model_desc, require_loss=require_loss)
    return str(info.value)


@pytest.mark.parametrize(
    ("model_desc", "phrase"),
    [
        ({"outputs": [("y", [1])]}, "inputs: required field"),
        ({"inputs": [("x", [1])]}, "outputs: required field"),
        ({"inputs": [], "outputs": [("y", [1])]}, "inputs: must be a non-empty list"),
        ({"inputs": "x", "outputs": [("y", [1])]}, "inputs: must be a list, got str"),
        ({**DESC, "inputz": []}, r"'inputz': unknown field \(valid keys: inputs, outputs\)"),
        ({"inputs": [("x",)], "outputs": [("y", [1])]}, r"inputs\[0\]: must be a tuple with size 2, got 1 elements"),
        ({"inputs": [("x", [1], True)], "outputs": [("y", [1])]}, r"inputs\[0\]: must be a tuple with size 2,"),
        ({"inputs": ["x"], "outputs": [("y", [1])]}, r"inputs\[0\]: must be a tuple with size 2, got 'x' \(str\)"),
        ({"inputs": [("x", [1])], "outputs": [("y",)]}, r"outputs\[0\]: must be a tuple with size 2 or 3"),
        (
            {"inputs": [(1, [1])], "outputs": [("y", [1])]},
            r"inputs\[0\]: the first element of the tuple \(aka name\) must be a string, got 1 \(int\)",
        ),
        (
            {"inputs": [("x", 5)], "outputs": [("y", [1])]},
            r"inputs\[0\]: the second element of the tuple \(aka shape\) must be a list, got 5",
        ),
        (
            {"inputs": [("x", [1.5])], "outputs": [("y", [1])]},
            r"inputs\[0\].shape\[0\]: each shape must be either a string or integer, got 1.5",
        ),
        (
            {"inputs": [("x", [True])], "outputs": [("y", [1])]},
            r"inputs\[0\].shape\[0\]: each shape must be either a string or integer, got True \(bool\)",
        ),
        ({"inputs": [("x", [0])], "outputs": [("y", [1])]}, r"inputs\[0\].shape\[0\]: integer dims must be >= 1"),
        (
            {"inputs": [("x", [1])], "outputs": [("y", [1], "yes")]},
            r"outputs\[0\]: the third element of the tuple \(aka is_loss\) must be a boolean, got 'yes'",
        ),
        (
            {"inputs": [("x", [1])], "outputs": [("a", [], True), ("b", [], True)]},
            r"outputs: only one is_loss can be set to True, got 2 \(outputs\[0\], outputs\[1\]\)",
        ),
        ({"inputs": [("x", [1]), ("x", [2])], "outputs": [("y", [1])]}, r"inputs: names must be unique.*\['x'\]"),
    ],
)
def test_each_legacy_invalid_case_has_its_phrase(model_desc, phrase):
    message = _problems(model_desc)
    assert re.search(phrase, message), message


def test_require_loss_demands_exactly_one():
    message = _problems({"inputs": [("x", [1])], "outputs": [("y", [1])]}, require_loss=True)
    assert "exactly one output must have is_loss=True" in message


def test_non_dict_description():
    with pytest.raises(ValueError, match=r"Invalid model_desc: expected a dict with keys \['inputs', 'outputs'\]"):
        validate_model_desc([("x", [1])], require_loss=False)


def test_every_problem_is_reported_once_sorted_by_path():
    bad = {
        "inputs": [("x", [1])] * 2 + [(1, "s")] + [("x2", [1])] * 7 + [("z", [-1])],
        "outputs": [("y", [1], 1)],
        "extra": 1,
    }
    message = _problems(bad)
    lines = [line for line in message.splitlines() if line.startswith("  - ")]
    assert len(lines) == 6, message
    assert "6 problem(s)" in message
    order = [
        "'extra': unknown field",
        "inputs: names must be unique, duplicated: ['x', 'x2']",
        "inputs[2]: the first",
        "inputs[2]: the second",
        "inputs[10].shape[0]: integer dims",
        "outputs[0]: the third element",
    ]
    positions = [message.index(o) for o in order]
    assert positions == sorted(positions), message


def test_model_description_is_accepted_and_loss_rechecked():
    desc = validate_model_desc(DESC, require_loss=True)
    assert validate_model_desc(desc, require_loss=True) is desc
    no_loss = validate_model_desc({"inputs": [("x", [1])], "outputs": [("y", [1])]}, require_loss=False)
    with pytest.raises(ValueError, match="exactly one output must have is_loss=True"):
        validate_model_desc(no_loss, require_loss=True)


def test_with_dtypes():
    desc = validate_model_desc(DESC, require_loss=True)
    typed = desc.with_input_dtypes({"label": torch.int64}).with_output_dtypes([torch.float32, torch.float32])
    assert [d.dtype for d in typed.inputs] == [None, torch.int64]
    assert [d.dtype for d in typed.outputs] == [torch.float32, torch.float32]
    assert typed.inputs[1] == InputDescriptionTyped("label", ["batch"], torch.int64)
    assert typed.outputs[0] == OutputDescriptionTyped("loss", [], True, torch.float32, None)
    assert desc.inputs[1].dtype is None  # original untouched
    with pytest.raises(ValueError, match=r"unknown input name\(s\) \['y'\]; the inputs are \['x', 'label'\]"):
        desc.with_input_dtypes({"y": torch.int64})
    with pytest.raises(ValueError, match=r"expected 2 output dtypes \(for \['loss', 'probs'\]\), got 1"):
        desc.with_output_dtypes([torch.float32])
    with pytest.raises(TypeError, match="input dtypes must be torch.dtype; got 'x': 'float32'"):
        desc.with_input_dtypes({"x": "float32"})


# --- check_inputs ----------------------------------------------------------------------------


@pytest.fixture
def typed() -> ModelDescription:
    return validate_model_desc(DESC, require_loss=True).with_input_dtypes([torch.float32, torch.int64])


def test_check_inputs_accepts_matching_tensors(typed):
    check_inputs(typed, [torch.zeros(4, 784), torch.zeros(4, dtype=torch.int64)])


def test_check_inputs_count(typed):
    with pytest.raises(ValueError, match=r"expected 2 input\(s\) \['x', 'label'\], got 1"):
        check_inputs(typed, [torch.zeros(4, 784)])


def test_check_inputs_type(typed):
    with pytest.raises(TypeError, match=r"input 'label' \(position 1\) must be a torch.Tensor, got list"):
        check_inputs(typed, [torch.zeros(4, 784), [1, 2, 3, 4]])


def test_check_inputs_dtype(typed):
    with pytest.raises(TypeError, match="input 'label' must have dtype torch.int64, got torch.float32"):
        check_inputs(typed, [torch.zeros(4, 784), torch.zeros(4)])


def test_check_inputs_rank(typed):
    with pytest.raises(ValueError, match=r"input 'x': expected rank 2 \(shape \['batch', 784\]\), got rank 1"):
        check_inputs(typed, [torch.zeros(784), torch.zeros(4, dtype=torch.int64)])


def test_check_inputs_fixed_dim(typed):
    with pytest.raises(ValueError, match="input 'x' axis 1: expected size 784, got 785"):
        check_inputs(typed, [torch.zeros(4, 785), torch.zeros(4, dtype=torch.int64)])


def test_check_inputs_symbolic_dim_consistency_names_both(typed):
    with pytest.raises(
        ValueError, match="dim 'batch' must have one size across inputs, got 'x' axis 0 = 4, 'label' axis 0 = 5"
    ):
        check_inputs(typed, [torch.zeros(4, 784), torch.zeros(5, dtype=torch.int64)])
