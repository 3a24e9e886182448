"""Task sources: where an environment's task records come from.

A task is a JSON-able dict passed to ``Environment.reset``. Sources are re-iterable (every
``iter()`` starts from the beginning, re-reading files), lazy (a JSONL file of millions of lines
is streamed, never loaded whole) and give every record an ``"id"`` (kept when present, else
``"<source>-<index>"``) so episodes and samples can name their task.

- :func:`from_iterable`: any iterable of dicts (a list, a generator function's result is read once);
- :func:`from_jsonl`: a JSON-lines file (blank lines skipped; a bad line raises with its number);
- :func:`from_hf`: a Hugging Face ``datasets`` dataset, when that package is installed;
- :func:`load_tasks`: picks one of these from a spec (a path, ``"hf:NAME[:CONFIG]"``, or an iterable).
"""

from __future__ import annotations

import itertools
import json
import logging
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from agentrl.errors import AgentrlError

log = logging.getLogger(__name__)

Task = dict[str, Any]


class TaskSourceError(AgentrlError, ValueError):
    """A task source could not be read (bad file, bad record, missing optional package)."""


class TaskSource:
    """A re-iterable, lazily read sequence of task dicts with ids; ``map`` and ``take`` chain."""

    def __init__(self, opener: Callable[[], Iterable[Any]], name: str,
                 transform: Callable[[Task], Task] | None = None, limit: int | None = None) -> None:
        self._opener = opener
        self.name = name
        self._transform = transform
        self._limit = limit

    def __iter__(self) -> Iterator[Task]:
        records = self._opener()
        if self._limit is not None:
            records = itertools.islice(records, self._limit)
        for i, rec in enumerate(records):
            if not isinstance(rec, Mapping):
                raise TaskSourceError(f"{self.name}: record {i} is a {type(rec).__name__}, not a dict")
            task = dict(rec)
            task.setdefault("id", f"{self.name}-{i}")
            yield self._transform(task) if self._transform else task

    def map(self, fn: Callable[[Task], Task]) -> TaskSource:
        """A source whose records are ``fn(record)`` (e.g. renaming a dataset's columns)."""
        inner = self._transform
        return TaskSource(self._opener, self.name, (lambda t: fn(inner(t))) if inner else fn, self._limit)

    def take(self, n: int) -> TaskSource:
        """The first ``n`` records."""
        return TaskSource(
            self._opener, self.name, self._transform, n if self._limit is None else min(n, self._limit)
        )

    def __repr__(self) -> str:
        return f"TaskSource({self.name!r})"


def from_iterable(records: Iterable[Mapping[str, Any]], name: str = "task") -> TaskSource:
    """Any iterable of dicts. A list re-iterates; a one-shot iterator is read once (then empty)."""
    return TaskSource(lambda: iter(records), name)


def _read_jsonl(path: Path) -> Iterator[Any]:
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield json.loads(line)
            except json.JSONDecodeError as e:
                raise TaskSourceError(f"{path}:{lineno}: not valid JSON: {e.msg}") from e


def from_jsonl(path: str | Path) -> TaskSource:
    """Records of a JSON-lines file, one object per line, read lazily on each iteration."""
    p = Path(path)
    if not p.is_file():
        raise TaskSourceError(f"task file {p} does not exist")
    return TaskSource(lambda: _read_jsonl(p), p.stem)


def from_hf(name: str, split: str = "train", config: str | None = None, *, streaming: bool = False,
            **kwargs: Any) -> TaskSource:
    """A Hugging Face dataset's rows (``datasets.load_dataset(name, config, split=split, ...)``)."""
    try:
        import datasets  # noqa: F401 - optional dependency, imported only here
    except ImportError as e:
        raise TaskSourceError(
            f"reading tasks from the Hugging Face dataset {name!r} needs the `datasets` package: "
            f"pip install datasets (or use a JSONL file or any iterable of dicts)"
        ) from e

    def open_rows() -> Iterable[Any]:
        import datasets

        return datasets.load_dataset(name, config, split=split, streaming=streaming, **kwargs)

    return TaskSource(open_rows, f"{name.rsplit('/', 1)[-1]}-{split}")


def load_tasks(spec: str | Path | Iterable[Mapping[str, Any]], split: str = "train") -> TaskSource:
    """A task source from a spec: ``"hf:NAME[:CONFIG]"``, a ``.jsonl`` path, or an iterable."""
    if isinstance(spec, TaskSource):
        return spec
    if isinstance(spec, str) and spec.startswith("hf:"):
        parts = spec[3:].split(":", 1)
        return from_hf(parts[0], split=split, config=parts[1] if len(parts) > 1 else None)
    if isinstance(spec, (str, Path)):
        return from_jsonl(spec)
    if isinstance(spec, Iterable):
        return from_iterable(spec)
    raise TaskSourceError(f"cannot read tasks from a {type(spec).__name__}; give a list of dicts, a .jsonl "
                          f"path or 'hf:NAME'")
