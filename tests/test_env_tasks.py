"""Task sources: iterables, JSONL files, Hugging Face datasets (only when `datasets` is installed)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from agentrl.env.tasks import TaskSourceError, from_hf, from_iterable, from_jsonl, load_tasks

HAS_DATASETS = importlib.util.find_spec("datasets") is not None


def test_an_iterable_source_gives_ids_to_records_without_one_and_re_iterates() -> None:
    src = from_iterable([{"q": "a"}, {"id": "mine", "q": "b"}], name="toy")
    assert list(src) == [{"q": "a", "id": "toy-0"}, {"id": "mine", "q": "b"}]
    assert list(src) == list(src)


def test_a_jsonl_file_is_read_lazily_on_each_iteration_and_blank_lines_are_skipped(tmp_path: Path) -> None:
    path = tmp_path / "math.jsonl"
    path.write_text(
        json.dumps({"question": "1+1", "answer": 2}) + "\n\n" + json.dumps({"question": "2+2"}) + "\n"
    )
    src = from_jsonl(path)
    assert [t["id"] for t in src] == ["math-0", "math-1"]
    path.write_text(json.dumps({"question": "3+3"}) + "\n")  # re-read, not cached
    assert [t["question"] for t in src] == ["3+3"]


def test_a_bad_jsonl_line_names_its_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"a": 1}\n{"a": \n')
    with pytest.raises(TaskSourceError, match=r"bad\.jsonl:2: not valid JSON"):
        list(from_jsonl(path))
    with pytest.raises(TaskSourceError, match="does not exist"):
        from_jsonl(tmp_path / "missing.jsonl")
    path.write_text("[1, 2]\n")
    with pytest.raises(TaskSourceError, match="record 0 is a list"):
        list(from_jsonl(path))


def test_map_and_take_reshape_a_source_without_reading_it_twice() -> None:
    src = from_iterable([{"x": i} for i in range(10)]).map(lambda t: {**t, "question": f"x={t['x']}"}).take(3)
    assert [t["question"] for t in src] == ["x=0", "x=1", "x=2"]


def test_load_tasks_picks_the_source_from_the_spec(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text('{"q": 1}\n')
    assert [t["q"] for t in load_tasks(str(path))] == [1]
    assert [t["q"] for t in load_tasks(path)] == [1]
    assert [t["q"] for t in load_tasks([{"q": 2}])] == [2]
    with pytest.raises(TaskSourceError, match="cannot read tasks"):
        load_tasks(42)  # type: ignore[arg-type]


def test_a_built_in_environment_takes_its_tasks_from_a_jsonl_file(tmp_path: Path) -> None:
    import agentrl

    path = tmp_path / "code.jsonl"
    path.write_text(json.dumps({"name": "sq", "spec": "sq(x) returns x*x", "tests": ["sq(3) == 9"]}) + "\n")
    env = agentrl.make("coding", tasks=str(path))
    assert [t["id"] for t in env.tasks("train")] == ["code-0"]


if HAS_DATASETS:
    def test_a_hugging_face_dataset_is_a_task_source(tmp_path: Path) -> None:
        path = tmp_path / "hf.jsonl"
        path.write_text('{"question": "a"}\n{"question": "b"}\n')
        src = from_hf("json", split="train", data_files=str(path))
        assert [t["question"] for t in src] == ["a", "b"]
else:
    def test_without_the_datasets_package_a_hugging_face_source_says_what_to_install() -> None:
        with pytest.raises(TaskSourceError, match="pip install datasets"):
            from_hf("gsm8k")
        with pytest.raises(TaskSourceError, match="pip install datasets"):
            load_tasks("hf:gsm8k:main")
