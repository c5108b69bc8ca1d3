"""One tensor passed as two inputs (a language model's ``labels=input_ids``) is two graph inputs, not one.

Tracing converts each real tensor to a fake one once, by identity: the same tensor given as ``input_ids`` and as
``label`` became one fake tensor, every use of it was recorded against the last placeholder, and the graph never
read ``input_ids``. The first step was right (both held the same values); every later step with its own labels
trained on the labels as inputs, silently.
"""

from __future__ import annotations

import copy

import pytest
import torch

from ort_trainer import ORTTrainer, optim

DESC = {"inputs": [("input_ids", ["batch", "seq"]), ("label", ["batch", "seq"])], "outputs": [("loss", [], True)]}


class TinyLM(torch.nn.Module):
    def __init__(self, vocab: int = 20, width: int = 8):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, width)
        self.head = torch.nn.Linear(width, vocab)

    def forward(self, input_ids):
        return self.head(torch.tanh(self.embed(input_ids)))


def _loss(logits, label):
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), label.reshape(-1))


@pytest.mark.parametrize("mode", ["train", "eval"])
def test_one_tensor_given_as_two_inputs_leaves_later_steps_with_their_own_inputs(mode):
    torch.manual_seed(0)
    model = TinyLM()
    reference = copy.deepcopy(model)
    trainer = ORTTrainer(model, DESC, optim.SGDConfig(lr=0.5), loss_fn=_loss, options={"utils": {"engine": "autograd"}})
    opt = torch.optim.SGD(reference.parameters(), lr=0.5)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 20, (3, 5), generator=g)
    steps = [(ids, ids)]  # the first step: one tensor for both inputs
    steps += [(torch.randint(0, 20, (3, 5), generator=g), torch.randint(0, 20, (3, 5), generator=g)) for _ in range(3)]
    for inputs, labels in steps:
        if mode == "train":
            got = trainer.train_step(inputs, labels)
            want = _loss(reference(inputs), labels)
            opt.zero_grad()
            want.backward()
            opt.step()
        else:
            got = trainer.eval_step(inputs, labels)
            with torch.no_grad():
                want = _loss(reference(inputs), labels)
        torch.testing.assert_close(got.detach(), want.detach(), atol=1e-6, rtol=1e-5)
    weights = trainer.state_dict(pytorch_format=True)
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(weights[name], value, atol=1e-6, rtol=1e-5, msg=name)
