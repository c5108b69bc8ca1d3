"""What users do to a module whose parameters are views of the trainer's flat buffers (issue S, point 2).

ONNX Runtime reads the flat buffers through pointers bound once (DLPack). A move of their storage in place
(``model.share_memory()``, a ``torch.multiprocessing`` Queue carrying ``model.state_dict()``) is followed: the
next step rebinds and trains on, equal to PyTorch. What unlinks the module from what the trainer trains
(``.half()``, ``.double()``, ``.to(dtype)``, ``p.data = ...``, a buffer replaced, a second ORTTrainer over the
same module, ``requires_grad_`` changed) raises at the next step, naming the tensor and the cause.
"""

from __future__ import annotations

import copy
from multiprocessing.reduction import ForkingPickler

import pytest
import torch

from ort_trainer import ORTTrainer, optim
from tests.models import CNN, CNN_DESC, MLP, MLP_DESC, cnn_batches, mlp_batches

ce = torch.nn.functional.cross_entropy


def _pair(seed: int = 0, model_cls=MLP, desc=MLP_DESC):
    torch.manual_seed(seed)
    model = model_cls()
    reference = copy.deepcopy(model)
    trainer = ORTTrainer(model, desc, optim.SGDConfig(lr=0.1), loss_fn=ce)
    return model, reference, trainer


def _lockstep(trainer, reference, batches, opt):
    for *inputs, label in batches:
        got = trainer.train_step(*inputs, label)
        opt.zero_grad()
        expected = ce(reference(*inputs), label)
        expected.backward()
        opt.step()
        torch.testing.assert_close(got, expected.detach(), atol=1e-5, rtol=1e-5)


def _moves_storage_by_share_memory(model):
    model.share_memory()


def _moves_storage_by_a_queue(model):
    queue = torch.multiprocessing.Queue()
    queue.put(model.state_dict())  # pickled on the queue's feeder thread: the storages move to shared memory
    received = queue.get(timeout=60)
    assert received.keys() == model.state_dict().keys()
    queue.close()
    queue.join_thread()


def _moves_storage_by_pickling_for_a_process(model):
    ForkingPickler.dumps(model.state_dict())  # what a Queue / Pipe / Pool does with a tensor


@pytest.mark.parametrize(
    "move", [_moves_storage_by_share_memory, _moves_storage_by_a_queue, _moves_storage_by_pickling_for_a_process]
)
def test_storage_moved_in_place_is_followed_and_training_stays_equal_to_torch(move):
    model, reference, trainer = _pair(seed=1, model_cls=CNN, desc=CNN_DESC)  # BatchNorm: shared float buffers too
    opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    batches = cnn_batches(5)
    _lockstep(trainer, reference, batches[:2], opt)
    before = trainer.trainer_state.store.params.data_ptr()
    move(model)
    assert trainer.trainer_state.store.params.data_ptr() != before  # the flat buffer itself moved
    assert model.conv.weight.is_shared()
    _lockstep(trainer, reference, batches[2:], opt)
    evaluated = trainer.eval_step(*batches[0])
    reference.eval()
    torch.testing.assert_close(evaluated, ce(reference(batches[0][0]), batches[0][1]).detach(), atol=1e-5, rtol=1e-5)
    for name, value in reference.state_dict().items():
        if value.is_floating_point():  # the module still shows the trained state
            torch.testing.assert_close(model.state_dict()[name], value, atol=1e-5, rtol=1e-5, msg=name)


def test_storage_moved_before_the_first_step_trains_like_torch():
    model, reference, trainer = _pair(seed=2)
    model.share_memory()
    _lockstep(trainer, reference, mlp_batches(3), torch.optim.SGD(reference.parameters(), lr=0.1))


@pytest.mark.parametrize(
    ("convert", "dtype"),
    [
        (lambda m: m.half(), "torch.float16"),
        (lambda m: m.double(), "torch.float64"),
        (lambda m: m.to(torch.bfloat16), "torch.bfloat16"),
    ],
)
@pytest.mark.parametrize("built", [True, False])
def test_a_dtype_conversion_of_the_module_raises_naming_the_parameter_and_the_dtype(convert, dtype, built):
    model, _, trainer = _pair(seed=3)
    batch = mlp_batches(1)[0]
    if built:
        trainer.train_step(*batch)
    weights = trainer.state_dict(pytorch_format=True)
    convert(model)
    with pytest.raises(TypeError, match=rf"fc1\.weight.*{dtype}.*share_module_parameters") as caught:
        trainer.train_step(*batch)
    assert "float32" in str(caught.value)
    with pytest.raises(TypeError, match=r"fc1\.weight"):
        trainer.eval_step(*batch)
    after = trainer.state_dict(pytorch_format=True)
    for name, value in weights.items():  # nothing ran: the trainer's state is as it was
        assert torch.equal(after[name], value), name


def test_replacing_a_parameters_data_raises_naming_it():
    model, _, trainer = _pair(seed=4)
    batch = mlp_batches(1)[0]
    trainer.train_step(*batch)
    model.fc2.bias.data = torch.zeros(4)
    with pytest.raises(ValueError, match=r"fc2\.bias.*no longer a view of this trainer's buffer"):
        trainer.train_step(*batch)


def test_replacing_a_parameter_object_or_a_buffer_raises_naming_it():
    model, _, trainer = _pair(seed=5)
    batch = mlp_batches(1)[0]
    model.fc1.weight = torch.nn.Parameter(model.fc1.weight.detach().clone())
    with pytest.raises(ValueError, match=r"fc1\.weight"):
        trainer.train_step(*batch)

    torch.manual_seed(6)
    cnn = CNN()
    cnn_trainer = ORTTrainer(cnn, CNN_DESC, optim.SGDConfig(lr=0.1), loss_fn=ce)
    cnn_trainer.train_step(*cnn_batches(1)[0])
    cnn.bn.running_mean = torch.zeros(4)
    with pytest.raises(ValueError, match=r"bn\.running_mean"):
        cnn_trainer.train_step(*cnn_batches(1)[0])


def test_a_second_trainer_over_the_module_takes_it_and_the_first_raises():
    model, reference, first = _pair(seed=7)
    batches = mlp_batches(4)
    opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    _lockstep(first, reference, batches[:1], opt)
    second = ORTTrainer(model, MLP_DESC, optim.SGDConfig(lr=0.1), loss_fn=ce)
    with pytest.raises(ValueError, match=r"another ORTTrainer.*fc1\.weight|fc1\.weight.*another ORTTrainer"):
        first.train_step(*batches[1])
    _lockstep(second, reference, batches[1:], opt)  # the second starts from the first's trained weights
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(model.state_dict()[name], value, atol=1e-5, rtol=1e-5, msg=name)


@pytest.mark.parametrize("built", [True, False])
def test_changing_requires_grad_after_construction_raises(built):
    model, _, trainer = _pair(seed=8)
    batch = mlp_batches(1)[0]
    if built:
        trainer.train_step(*batch)
    model.fc1.requires_grad_(False)
    with pytest.raises(ValueError, match=r"requires_grad.*fc1\.bias.*fc1\.weight.*frozen_weights"):
        trainer.train_step(*batch)
    model.fc1.requires_grad_(True)  # set back: the trainer trains on
    trainer.train_step(*batch)


def test_a_module_that_is_not_shared_is_the_users_to_change():
    torch.manual_seed(9)
    model = MLP()
    trainer = ORTTrainer(
        model, MLP_DESC, optim.SGDConfig(lr=0.1), loss_fn=ce, options={"utils": {"share_module_parameters": False}}
    )
    batch = mlp_batches(1)[0]
    loss = trainer.train_step(*batch)
    model.half()
    model.fc1.requires_grad_(False)
    assert torch.isfinite(trainer.train_step(*batch)) and torch.isfinite(loss)
