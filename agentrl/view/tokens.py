"""Token ids as text, one token at a time, with the run's own tokenizer.

The view shows the ids the engine sampled, so each id is decoded on its own (never the text
re-tokenised): a character that spans several byte-level tokens shows as U+FFFD in each of them,
and the raw token (``convert_ids_to_tokens``) is kept for the hover. Special tokens are decoded too
(``skip_special_tokens=False``) and flagged, so the template's ``<|im_start|>`` and the model's
end-of-turn token are visible.

The tokenizer loads from a local folder only (``local_files_only``): the view never reaches a
model hub. Loading it costs seconds (transformers), so :class:`Detokenizer` loads lazily, once,
and caches every id it has decoded (bounded by the vocabulary).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger(__name__)


class Detokenizer:
    """``pieces(ids)`` -> per-token (text, raw token, special) with the model folder's tokenizer."""

    def __init__(self, model_path: str | Callable[[], str | None] | None) -> None:
        """``model_path``: the folder, or a function that finds it (called once, on first use)."""
        self._locate = model_path
        self.model_path: str | None = model_path if isinstance(model_path, str) else None
        self._tok: PreTrainedTokenizerBase | None = None
        self._error: str | None = None
        self._lock = threading.Lock()
        self._cache: dict[int, tuple[str, str, bool]] = {}
        self._special: frozenset[int] = frozenset()

    @property
    def error(self) -> str | None:
        """Why token text is unavailable (None when the tokenizer loaded, or has not been tried yet)."""
        if self._error is None and self._tok is None and not self.model_path:
            return "no model folder is known for this run: tokens show as ids"
        return self._error

    def _load(self) -> PreTrainedTokenizerBase | None:
        with self._lock:
            if self._tok is not None or self._error is not None:
                return self._tok
            if callable(self._locate):
                try:
                    self.model_path = self._locate()
                except Exception as e:
                    log.warning("could not find the run's model folder", exc_info=True)
                    self._error = f"could not find the run's model: {type(e).__name__}: {e}"
                    return None
            if not self.model_path:  # not known yet (serve still starting) or not at all: ask again later
                return None
            try:
                from transformers import AutoTokenizer

                self._tok = AutoTokenizer.from_pretrained(self.model_path, local_files_only=True)
                self._special = frozenset(int(i) for i in self._tok.all_special_ids)
                added = getattr(self._tok, "added_tokens_decoder", {}) or {}
                self._special |= {int(i) for i, t in added.items() if getattr(t, "special", False)}
            except Exception as e:  # a folder without a tokenizer, a hub name not cached here, ...
                self._error = f"could not load the tokenizer from {self.model_path}: {type(e).__name__}: {e}"
                log.warning("%s", self._error)
            return self._tok

    def pieces(self, ids: list[int]) -> list[tuple[str, str, bool]] | None:
        """(text, raw token, special) per id, or None when no tokenizer is available."""
        tok = self._load()
        if tok is None:
            return None
        out = []
        for i in ids:
            piece = self._cache.get(i)
            if piece is None:
                try:
                    text = tok.decode([i], skip_special_tokens=False)
                    raw = tok.convert_ids_to_tokens(i)
                except Exception:  # an id outside the vocabulary: show it as such
                    text, raw = f"<id {i}>", ""
                piece = (str(text), str(raw or ""), i in self._special)
                self._cache[i] = piece
            out.append(piece)
        return out
