"""Synthetic transcripts in the project's tool-call format (tokenizer corpus and warm-start data)."""

from __future__ import annotations

import json
import random

# the models are warm-started on the arithmetic environment's own problems (models import
# environments, never the other way round)
from environments.arithmetic.problems import arithmetic_problem

__all__ = ["arithmetic_problem", "arithmetic_transcript_text"]


def arithmetic_transcript_text(rng: random.Random) -> str:
    expr, value = arithmetic_problem(rng)
    call = json.dumps({"name": "python", "arguments": {"code": f"print({expr})"}})
    return (
        f"<|im_start|>user\nWhat is {expr}?<|im_end|>\n<|im_start|>assistant\n<tool_call>\n{call}\n"
        f"</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n{value}\n</tool_response><|im_end|>\n"
        f"<|im_start|>assistant\nThe answer is {value}.<|im_end|>\n"
    )
