"""The router's piece encoder (agentrl.router.encode): the ids of a rendered prompt from cached pieces
between added tokens equal the tokenizer's own encode of the whole text, on real tokenizers."""

from __future__ import annotations

import random

import pytest
from tokenizers import AddedToken
from transformers import AutoTokenizer

from agentrl.models import resolve_model
from agentrl.router.encode import PieceEncoder


def _texts(tokens: list[str], n: int, seed: int) -> list[str]:
    """Chat-like texts: added tokens next to spaces, newlines, combining marks, emoji, CJK, digits."""
    rng = random.Random(seed)
    parts = [*tokens, " ", "  ", "\n", "\n\n", "\t", "user\n", "assistant\n", "e\u0301", "\u0301", "é",
             "中文", "𝄞", "1 + 1", "'s", "{\"a\": 1}", "<tool_call>", "</tool_call>", "<tool", "|>", "<|",
             "x"]
    return ["".join(rng.choice(parts) for _ in range(rng.randint(1, 40))) for _ in range(n)]


@pytest.mark.parametrize("model", ["tiny-tools", "smollm2-135m"])
def test_pieces_encode_as_the_whole(model: str) -> None:
    tok = AutoTokenizer.from_pretrained(resolve_model(model))
    enc = PieceEncoder(tok)
    assert enc.on  # ChatML special tokens, none stripping whitespace: cut into pieces
    tokens = [t.content for t in tok.added_tokens_decoder.values()]
    for text in _texts(tokens, 3000, seed=1):
        assert enc.encode(text) == tok.backend_tokenizer.encode(text, add_special_tokens=False).ids, text
    # the second time from the cache, the same
    for text in _texts(tokens, 300, seed=1):
        assert enc.encode(text) == tok.backend_tokenizer.encode(text, add_special_tokens=False).ids, text


def test_a_token_that_strips_whitespace_encodes_whole() -> None:
    tok = AutoTokenizer.from_pretrained(resolve_model("tiny-tools"))
    tok.add_tokens([AddedToken("<mark>", lstrip=True, normalized=False, special=True)], special_tokens=True)
    enc = PieceEncoder(tok)
    assert not enc.on
    text = "<|im_start|>user\nhi   <mark> there<|im_end|>"
    assert enc.encode(text) == tok.backend_tokenizer.encode(text, add_special_tokens=False).ids


def test_the_cache_stays_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("agentrl.router.encode.MAX_PIECES", 8)
    tok = AutoTokenizer.from_pretrained(resolve_model("tiny-tools"))
    enc = PieceEncoder(tok)
    for i in range(100):
        text = f"<|im_start|>tool\n{i}<|im_end|>\n"
        assert enc.encode(text) == tok.backend_tokenizer.encode(text, add_special_tokens=False).ids
        assert len(enc._cache) <= 8
    long = "<|im_start|>user\n" + "word " * 10_000 + "<|im_end|>"
    assert enc.encode(long) == tok.backend_tokenizer.encode(long, add_special_tokens=False).ids
    assert all(len(p) <= 32 << 10 for p in enc._cache)
