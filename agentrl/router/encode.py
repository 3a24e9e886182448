"""A rendered prompt's text to ids, one piece between added tokens at a time, with pieces cached.

A fast tokenizer first cuts its input at the added tokens it matches before normalisation
(``normalized=False``: ``<|im_start|>``, ``<|im_end|>`` ...), then normalises, pre-tokenises and
encodes each piece between them on its own. So the ids of a text are the ids of its pieces and
cut tokens in order, and a piece seen before need not be encoded again: the system turn with its
tool schemas, the role headers, a tool's usual answers. On a chat prompt that is most of the text;
encoding was the largest cost of a locally rendered call (0.26 ms of 0.9, benchmarks/agent_loops.py).

Invariant: :meth:`PieceEncoder.encode` returns what ``tokenizer.encode(text,
add_special_tokens=False).ids`` returns. It holds for tokenizers whose pre-normalisation added
tokens strip no whitespace around them and match anywhere (no ``lstrip``, ``rstrip`` or
``single_word``), and that split on them at all; for any other, and for one whose check on probe
texts fails at load, every text is encoded whole. The router's calibration against the engine's
render covers it as well.
"""

from __future__ import annotations

import logging
import re
from typing import Any

log = logging.getLogger(__name__)

MAX_PIECES = 4096  # cached pieces at most (the cache is emptied when full: hot pieces come back at once)
MAX_CACHED_CHARS = 4 << 20  # characters over all cached pieces at most
MAX_PIECE_CHARS = 32 << 10  # a longer piece (a long document, a big tool output) is encoded, not kept

_PROBES = (
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nhi  there \n\n<|im_end|>",
    "<|im_end|><|im_start|> leading space, é and e\u0301, 𝄞, 中文<|im_end|>\n",
    "<tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n</tool_call><|im_end|>\u0301 trailing",
    "  <|endoftext|>\t\n<s></s>[INST] x [/INST]<|eot_id|><|start_header_id|>user<|end_header_id|>\n\n",
)


class PieceEncoder:
    """``encode(text)``: the backend tokenizer's ids for ``text`` (no special tokens added), from
    cached pieces where it can. ``on``: whether it cuts into pieces (else it encodes whole)."""

    def __init__(self, tokenizer: Any) -> None:
        self._backend = tokenizer.backend_tokenizer
        self._cache: dict[str, list[int]] = {}
        self._cached_chars = 0
        self._cut: re.Pattern[str] | None = None
        self._ids: dict[str, int] = {}
        why = self._pieces_allowed(tokenizer)
        if why is None:
            for text in (*_PROBES, *self._token_probes()):
                if self.encode(text) != self._whole(text):
                    why = f"encoding by pieces differs from the whole on {text[:40]!r}"
                    break
        if why is not None:
            log.info("encoding rendered prompts whole: %s", why)
            self._cut = None
        self._cache.clear()
        self._cached_chars = 0

    @property
    def on(self) -> bool:
        return self._cut is not None

    def _pieces_allowed(self, tokenizer: Any) -> str | None:
        """None when the tokenizer cuts at its pre-normalisation added tokens and nothing else
        happens at a cut (the cut pattern set up), else why not."""
        if getattr(self._backend, "encode_special_tokens", False):
            return "the tokenizer does not split on its special tokens"
        added = getattr(tokenizer, "added_tokens_decoder", None)
        if not isinstance(added, dict):
            return "the tokenizer lists no added tokens"
        for token_id, tok in added.items():
            if getattr(tok, "normalized", True):
                continue  # matched inside each piece after normalisation, as in a whole encode
            if any(getattr(tok, flag, False) for flag in ("lstrip", "rstrip", "single_word")):
                return f"the added token {tok.content!r} strips whitespace or matches single words"
            self._ids[tok.content] = int(token_id)
        if not self._ids:
            return "the tokenizer has no added tokens matched before normalisation"
        # longest first: at one position the longest token wins, as the tokenizer's own matching does
        alternatives = sorted(self._ids, key=len, reverse=True)
        self._cut = re.compile("(" + "|".join(map(re.escape, alternatives)) + ")")
        return None

    def _token_probes(self) -> list[str]:
        tokens = sorted(self._ids)
        return [" x ".join(tokens), "".join(tokens) + "\n" + "\n".join(tokens) + " "]

    def _whole(self, text: str) -> list[int]:
        return self._backend.encode(text, add_special_tokens=False).ids

    def encode(self, text: str) -> list[int]:
        if self._cut is None:
            return self._whole(text)
        ids: list[int] = []
        cache, token_ids = self._cache, self._ids
        for i, piece in enumerate(self._cut.split(text)):
            if i % 2:  # the cut pattern's group: an added token
                ids.append(token_ids[piece])
            elif piece:
                got = cache.get(piece)
                if got is None:
                    got = self._whole(piece)
                    self._keep(piece, got)
                ids += got
        return ids

    def _keep(self, piece: str, ids: list[int]) -> None:
        if len(piece) > MAX_PIECE_CHARS:
            return
        if len(self._cache) >= MAX_PIECES or self._cached_chars + len(piece) > MAX_CACHED_CHARS:
            self._cache.clear()
            self._cached_chars = 0
        self._cache[piece] = ids
        self._cached_chars += len(piece)
