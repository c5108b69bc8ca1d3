"""Tiny models shared by the tests: small enough for a 2-core CI machine."""

from __future__ import annotations

import torch

MLP_DESC = {"inputs": [("x", ["batch", 20]), ("label", ["batch"])], "outputs": [("loss", [], True)]}
CNN_DESC = {"inputs": [("x", ["batch", 1, 8, 8]), ("label", ["batch"])], "outputs": [("loss", [], True)]}
LM_DESC = {"inputs": [("tokens", ["batch", "seq"]), ("label", ["batch", "seq"])], "outputs": [("loss", [], True)]}


class MLP(torch.nn.Module):
    def __init__(self, d_in: int = 20, hidden: int = 16, d_out: int = 4):
        super().__init__()
        self.fc1 = torch.nn.Linear(d_in, hidden)
        self.fc2 = torch.nn.Linear(hidden, d_out)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


class KthValue(torch.nn.Module):
    """A layer then ``torch.kthvalue``: an op with no ONNX translation, to see how an export failure is reported."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)

    def forward(self, x):
        return torch.kthvalue(self.fc(x), 2, dim=1).values  # no ONNX translation


class CNN(torch.nn.Module):
    """Conv -> BatchNorm -> ReLU -> Linear: exercises running statistics."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(
            1, 4, 3, bias=False
        )  # a bias before BatchNorm has ~0 gradient: Adam amplifies noise
        self.bn = torch.nn.BatchNorm2d(4)
        self.fc = torch.nn.Linear(4 * 6 * 6, 3)

    def forward(self, x):
        return self.fc(torch.relu(self.bn(self.conv(x))).flatten(1))


class TinyLM(torch.nn.Module):
    """Embedding + transformer encoder layers + vocabulary head; dropout configurable."""

    def __init__(self, vocab: int = 50, d_model: int = 16, layers: int = 1, dropout: float = 0.0, heads: int = 2):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, d_model)
        layer = torch.nn.TransformerEncoderLayer(
            d_model, heads, dim_feedforward=2 * d_model, dropout=dropout, batch_first=True
        )
        self.encoder = torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = torch.nn.Linear(d_model, vocab)

    def forward(self, tokens):
        return self.head(self.encoder(self.embed(tokens)))


def lm_loss(logits, label):
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), label.reshape(-1))


def mlp_batches(steps: int, batch: int = 8, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, 20, generator=g), torch.randint(0, 4, (batch,), generator=g)) for _ in range(steps)]


def cnn_batches(steps: int, batch: int = 6, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(batch, 1, 8, 8, generator=g), torch.randint(0, 3, (batch,), generator=g)) for _ in range(steps)
    ]


def lm_batches(steps: int, batch: int = 4, seq: int = 8, vocab: int = 50, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        tokens = torch.randint(0, vocab, (batch, seq + 1), generator=g)
        out.append((tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()))
    return out
