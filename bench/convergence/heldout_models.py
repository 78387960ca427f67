"""Models of held-out tasks unlike the suite's others (bench/convergence/tasks.py): a convnet with
batch norm, whose running statistics DDP broadcasts from rank 0 and whose gradients pass through
a normalisation, and a recurrent language model, whose gradients flow back through time through
one shared weight matrix."""
from __future__ import annotations

import torch
import torch.nn as nn


def bn_cnn(width: int = 24, classes: int = 10) -> nn.Module:
    """Four conv layers with batch norm (two strided) and global average pooling, for 16x16."""
    def block(cin, cout, stride):
        return [nn.Conv2d(cin, cout, 3, padding=1, stride=stride, bias=False),
                nn.BatchNorm2d(cout), nn.ReLU()]
    return nn.Sequential(
        *block(1, width, 1), *block(width, 2 * width, 2), *block(2 * width, 2 * width, 1),
        *block(2 * width, 4 * width, 2), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
        nn.Linear(4 * width, classes))


class GRULanguageModel(nn.Module):
    """A character-level GRU: embedding, ``layers`` GRU layers, a linear head."""

    def __init__(self, vocab: int, d: int, hidden: int, layers: int):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.rnn = nn.GRU(d, hidden, layers, batch_first=True)
        self.head = nn.Linear(hidden, vocab)

    def forward(self, idx):
        out, _ = self.rnn(self.tok(idx))
        return self.head(out)
