"""Test helper for the learner's math tests, whose expected values are computed by hand: float64
tensors (so the comparisons can be tight) and one tolerance-checked comparison."""

from __future__ import annotations

import math

import torch

e = math.exp
F64 = torch.float64


def t(x: object, grad: bool = False) -> torch.Tensor:
    return torch.tensor(x, dtype=F64, requires_grad=grad)


def close(actual: torch.Tensor | float, expected: object, tol: float = 1e-9) -> None:
    torch.testing.assert_close(
        torch.as_tensor(actual, dtype=F64), torch.as_tensor(expected, dtype=F64).detach(), rtol=tol, atol=tol
    )
