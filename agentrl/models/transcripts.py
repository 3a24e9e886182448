"""Synthetic transcripts in the project's tool-call format (tokenizer corpus and warm-start data)."""

from __future__ import annotations

import json
import random


def arithmetic_problem(rng: random.Random) -> tuple[str, int]:
    """A small expression and its value, e.g. ("37 * 12 + 5", 449)."""
    a, b, c = rng.randint(2, 99), rng.randint(2, 99), rng.randint(1, 99)
    op1, op2 = rng.choice("+-*"), rng.choice("+-")
    expr = f"{a} {op1} {b} {op2} {c}" if rng.random() < 0.6 else f"{a} {op1} {b}"
    return expr, int(eval(expr))  # noqa: S307 - expr is built above from digits and operators


def arithmetic_transcript_text(rng: random.Random) -> str:
    expr, value = arithmetic_problem(rng)
    call = json.dumps({"name": "python", "arguments": {"code": f"print({expr})"}})
    return (
        f"<|im_start|>user\nWhat is {expr}?<|im_end|>\n<|im_start|>assistant\n<tool_call>\n{call}\n"
        f"</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n{value}\n</tool_response><|im_end|>\n"
        f"<|im_start|>assistant\nThe answer is {value}.<|im_end|>\n"
    )
