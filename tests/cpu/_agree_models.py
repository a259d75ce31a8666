"""The model of the rank-agreement tests (CPU: test_rank_agreement.py; GPU:
tests/gpu/divergence_worker.py): three weights of distinct shapes, so each gather is
recognisable by its bytes (held by a child module whose forward never runs: every
read gathers on use, in the compiled graph), and a forward that reads the third only
where ``extra`` is set (one rank's Python taking another path)."""

from __future__ import annotations

import torch
from torch import nn


class Weights(nn.Module):
    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(d, d))
        self.w2 = nn.Parameter(torch.randn(d, d) * 0.1)
        self.w3 = nn.Parameter(torch.randn(d * 3 // 4, d))


class ThreePart(nn.Module):
    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.p = Weights(d)
        self.extra = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x @ self.p.w1
        if self.extra:
            x = x + (self.p.w3.sum(0) * 0.0)  # EXTRA-READ: only one rank reads w3
        return (x @ self.p.w2).sum()
