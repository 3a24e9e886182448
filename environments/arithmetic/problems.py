"""The arithmetic environment's task generator (the built-in models' warm-start data draws from it too)."""

from __future__ import annotations

import random


def arithmetic_problem(rng: random.Random) -> tuple[str, int]:
    """A small expression and its value, e.g. ("37 * 12 + 5", 449)."""
    a, b, c = rng.randint(2, 99), rng.randint(2, 99), rng.randint(1, 99)
    op1, op2 = rng.choice("+-*"), rng.choice("+-")
    expr = f"{a} {op1} {b} {op2} {c}" if rng.random() < 0.6 else f"{a} {op1} {b}"
    return expr, int(eval(expr))  # noqa: S307 - expr is built above from digits and operators


def sized_problem(rng: random.Random, digits: int) -> tuple[str, int]:
    """Two or three operands of ``digits`` digits each (the mixed-difficulty tasks of
    ``arithmetic`` with ``digits``): harder to copy into the tool and back the longer they are."""
    lo, hi = 10 ** (digits - 1) if digits > 1 else 2, 10 ** digits - 1
    a, b, c = rng.randint(lo, hi), rng.randint(lo, hi), rng.randint(lo, hi)
    op1, op2 = rng.choice("+-*"), rng.choice("+-")
    expr = f"{a} {op1} {b} {op2} {c}" if rng.random() < 0.6 else f"{a} {op1} {b}"
    return expr, int(eval(expr))  # noqa: S307 - expr is built above from digits and operators
