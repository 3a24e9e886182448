"""Generic tool-use transcripts: the warm-start that teaches a pretrained model the tool-call format.

SmolLM2-135M-Instruct never writes a valid ``<tool_call>`` on its own (../shared/MACHINE.md), so an
environment of one's own gets no learning signal from it. These transcripts show it the format on
small, unrelated tools (string and number operations, a lookup table), one or two of them
offered per transcript: read the tool list, call the right tool with the arguments taken from the
question, then answer with what the tool returned. No tool here is any environment's tool, and
none reverses text (the new-user test's environment does), so what RL then learns on an
environment is that environment's.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

WORDS = (
    "apple river garden stone pencil window planet silver rocket forest candle bridge orange "
    "mirror summer winter market island button jacket ladder meadow rabbit shadow tunnel violin "
    "wallet yellow anchor basket castle dragon engine falcon guitar harbor kitten lemon magnet "
    "needle oyster parrot quartz saddle tiger umbrella velvet walnut zebra copper dinner fabric "
    "hammer insect jungle kettle lizard monkey napkin pepper puzzle ribbon socket spider tomato"
).split()

CAPITALS = {"France": "Paris", "Japan": "Tokyo", "Kenya": "Nairobi", "Peru": "Lima", "Norway": "Oslo",
            "Egypt": "Cairo", "Canada": "Ottawa", "Chile": "Santiago", "Spain": "Madrid",
            "Ghana": "Accra", "Cuba": "Havana", "Nepal": "Kathmandu", "Poland": "Warsaw"}

SYSTEMS = (
    "Use the tool, then answer with the result.",
    "Call a tool to find the answer, then reply with it.",
    "You have tools. Use one, then give the answer.",
    "Answer using the tools you are given.",
)


@dataclass(frozen=True)
class Tool:
    names: tuple[str, ...]  # the names it goes by; a transcript may also give it a made-up one
    description: str
    params: dict[str, tuple[str, str]]  # name -> (JSON type, description)
    run: Callable[..., Any]
    ask: Callable[[random.Random], tuple[str, dict[str, Any]]]  # a question and the call's arguments

    def schema(self, name: str) -> dict[str, Any]:
        props = {k: {"type": t, "description": d} for k, (t, d) in self.params.items()}
        return {"type": "function", "function": {"name": name, "description": self.description,
                                                 "parameters": {"type": "object", "properties": props,
                                                                "required": list(self.params)}}}


def _word(rng: random.Random) -> str:
    return rng.choice(WORDS)


def _ask_upper(rng: random.Random) -> tuple[str, dict[str, Any]]:
    w = _word(rng)
    return f"Write '{w}' in capital letters.", {"text": w}


def _ask_length(rng: random.Random) -> tuple[str, dict[str, Any]]:
    w = _word(rng)
    return f"How many characters does '{w}' have?", {"text": w}


def _ask_count(rng: random.Random) -> tuple[str, dict[str, Any]]:
    w = _word(rng)
    letter = rng.choice(w) if rng.random() < 0.8 else rng.choice("abcdefghijklmnopqrstuvwxyz")
    return f"How many times does '{letter}' appear in '{w}'?", {"text": w, "letter": letter}


def _ask_add(rng: random.Random) -> tuple[str, dict[str, Any]]:
    a, b = rng.randint(2, 999), rng.randint(2, 99)
    return f"What is {a} plus {b}?", {"a": a, "b": b}


def _ask_multiply(rng: random.Random) -> tuple[str, dict[str, Any]]:
    x, y = rng.randint(2, 999), rng.randint(2, 99)
    return f"What is {x} times {y}?", {"x": x, "y": y}


def _ask_sort(rng: random.Random) -> tuple[str, dict[str, Any]]:
    w = _word(rng)
    return f"Sort the letters of '{w}' alphabetically.", {"word": w}


def _ask_capital(rng: random.Random) -> tuple[str, dict[str, Any]]:
    c = rng.choice(sorted(CAPITALS))
    return f"What is the capital of {c}?", {"country": c}


def _ask_repeat(rng: random.Random) -> tuple[str, dict[str, Any]]:
    w, n = _word(rng), rng.randint(2, 4)
    return f"Repeat '{w}' {n} times.", {"word": w, "times": n}


TEXT = {"text": ("string", "the text.")}
TOOLS = (
    Tool(
        ("upper", "to_upper", "capitalize_all", "shout"),
        "Write a text in capital letters.",
        TEXT,
        lambda text: text.upper(),
        _ask_upper,
    ),
    Tool(
        ("length", "char_count", "strlen", "size_of"),
        "Count the characters of a text.",
        TEXT,
        lambda text: len(text),
        _ask_length,
    ),
    Tool(
        ("count", "count_letter", "occurrences", "tally"),
        "Count how often a letter occurs in a text.",
        {"text": ("string", "the text to search."), "letter": ("string", "one character.")},
        lambda text, letter: text.count(letter),
        _ask_count,
    ),
    Tool(
        ("add", "sum_two", "plus", "adder"),
        "Add two integers.",
        {"a": ("integer", "the first number."), "b": ("integer", "the second number.")},
        lambda a, b: a + b,
        _ask_add,
    ),
    Tool(
        ("multiply", "times", "product", "mul"),
        "Multiply two integers.",
        {"x": ("integer", "a number."), "y": ("integer", "another number.")},
        lambda x, y: x * y,
        _ask_multiply,
    ),
    Tool(
        ("sort_letters", "alphabetize", "order_chars", "sorted_word"),
        "Sort the letters of a word alphabetically.",
        {"word": ("string", "the word.")},
        lambda word: "".join(sorted(word)),
        _ask_sort,
    ),
    Tool(
        ("capital", "capital_of", "lookup_capital", "city"),
        "Look up the capital city of a country.",
        {"country": ("string", "the country's name.")},
        lambda country: CAPITALS[country],
        _ask_capital,
    ),
    Tool(
        ("repeat", "duplicate", "echo_n", "say_times"),
        "Repeat a word several times, joined by spaces.",
        {"word": ("string", "the word."), "times": ("integer", "how many times.")},
        lambda word, times: " ".join([word] * times),
        _ask_repeat,
    ),
)


def _made_up_name(rng: random.Random) -> str:
    stem = "".join(rng.choice("bcdfghjklmnprstvwz") + rng.choice("aeiou") for _ in range(rng.randint(1, 3)))
    return f"{rng.choice(('tool', 'fn', 'do', 'get', 'run'))}_{stem}"


def tool_use_transcript(rng: random.Random) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """One transcript (messages, tool schemas): a question, one call to the right tool among the one or
    two offered, the tool's output, and an answer that repeats it. Tools go by one of their names
    or, in 40% of transcripts, by made-up ones, so the name in the call has to be read from the list."""
    offered = rng.sample(TOOLS, rng.randint(1, 2))
    names = [rng.choice(t.names) if rng.random() < 0.6 else _made_up_name(rng) for t in offered]
    if len(set(names)) < len(names):
        names = [f"{n}_{i}" for i, n in enumerate(names)]
    pick = rng.randrange(len(offered))
    question, args = offered[pick].ask(rng)
    result = str(offered[pick].run(**args))
    answer = result if rng.random() < 0.6 else f"The answer is {result}."
    call = {
        "id": "call_0",
        "type": "function",
        "function": {"name": names[pick], "arguments": json.dumps(args)},
    }
    messages = [
        {"role": "system", "content": rng.choice(SYSTEMS)},
        {"role": "user", "content": question},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_0", "content": result},
        {"role": "assistant", "content": answer},
    ]
    return messages, [t.schema(n) for t, n in zip(offered, names, strict=True)]
