"""The built-in tiny model: offline, deterministic, and a chat template that renders tools."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from agentrl.models.tiny import build_tiny_model


def _digest(folder: Path) -> dict[str, str]:
    return {
        f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(folder.iterdir()) if f.is_file()
    }


def test_the_tiny_model_builds_byte_for_byte_the_same_twice(tmp_path):
    a = build_tiny_model(tmp_path / "a")
    b = build_tiny_model(tmp_path / "b")
    assert _digest(a) == _digest(b)
    assert "model.safetensors" in _digest(a) and "tokenizer.json" in _digest(a)


def test_the_chat_template_renders_tools_tool_calls_and_tool_results(tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(build_tiny_model(tmp_path / "m"))
    tools = [{"type": "function", "function": {"name": "python", "description": "run code",
                                               "parameters": {"type": "object", "properties": {}}}}]
    messages = [
        {"role": "user", "content": "What is 3 + 4?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "python", "arguments": '{"code": '
                                                                                         '"print(3 '
                                                                                         '+ 4)"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "7"},
    ]
    text = tok.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    assert '<tools>\n{"type": "function", "function": {"name": "python"' in text
    assert (
        '<tool_call>\n{"name": "python", "arguments": {"code": "print(3 + 4)"}}\n</tool_call><|im_end|>'
        in text
    )
    assert "<|im_start|>user\n<tool_response>\n7\n</tool_response><|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")
    # Prefix-stable: the conversation so far renders as a prefix of the longer one.
    shorter = tok.apply_chat_template(messages[:2], tools=tools, tokenize=False)
    assert text.startswith(shorter)


def test_warm_start_transcripts_answer_without_the_tool_at_the_asked_rate():
    import json
    import random

    from agentrl.models.warmstart import _episode_messages

    def kinds(direct_frac: float) -> list[str]:
        rng = random.Random(0)
        out = []
        for _ in range(400):
            msgs = _episode_messages(rng, "sys", direct_frac)
            question = msgs[1]["content"]
            value = eval(question[len("What is "):-1])  # noqa: S307 - digits and operators only
            if len(msgs) == 3:  # system, user, a direct answer with the right value
                assert msgs[2] == {"role": "assistant", "content": f"The answer is {value}."}
                out.append("direct")
            else:
                call = msgs[2]["tool_calls"][0]["function"]
                assert json.loads(call["arguments"]) == {"code": f"print({question[len('What is '):-1]})"}
                assert msgs[3]["content"] == str(value)
                out.append("tool")
        return out

    assert set(kinds(0.0)) == {"tool"}
    assert set(kinds(1.0)) == {"direct"}
    assert 150 < kinds(0.5).count("direct") < 250


def test_a_model_folder_is_built_once_per_recipe_and_a_failed_build_leaves_the_last_one(tmp_path):
    from agentrl.models import _build_once

    builds = []

    def build(tmp):
        tmp.mkdir()
        (tmp / "weights").write_text(str(len(builds)))
        builds.append(tmp)
        return {"loss": 0.5}

    out = tmp_path / "m"
    assert _build_once(out, {"steps": 10}, build) == out
    assert _build_once(out, {"steps": 10}, build) == out  # the stamp matches: not built again
    assert len(builds) == 1 and (out / "weights").read_text() == "0"
    assert json.loads((out / "agentrl_warmstart.json").read_text()) == {"steps": 10, "loss": 0.5}
    _build_once(out, {"steps": 20}, build)  # another recipe: built again
    assert len(builds) == 2 and (out / "weights").read_text() == "1"

    def broken(tmp):
        tmp.mkdir()
        raise RuntimeError("killed mid-build")

    with pytest.raises(RuntimeError):
        _build_once(out, {"steps": 30}, broken)
    assert (out / "weights").read_text() == "1"  # the last finished build is still there
    _build_once(out, {"steps": 30}, build)  # and the half-built folder does not get in the way
    assert (out / "weights").read_text() == "2"


def test_a_second_process_asking_for_a_model_being_built_waits_and_does_not_build_it_again(tmp_path):
    import os
    import subprocess
    import sys

    from agentrl.models import exclusive_build

    out = tmp_path / "models" / "tiny"
    code = ("import logging; logging.basicConfig(level=logging.INFO)\n"
            "from agentrl.models import resolve_model; print(resolve_model('tiny'))")
    env = {**os.environ, "AGENTRL_HOME": str(tmp_path)}
    with exclusive_build(out):  # this process is building it: the other must wait, not build beside it
        other = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True)
        assert other.stderr is not None
        for line in iter(other.stderr.readline, ""):  # its log, up to the line that says it waits
            if "waiting for it to finish" in line:
                break
        else:
            pytest.fail(f"the second process ended without waiting for the build (exit {other.wait()})")
        build_tiny_model(out)
        built = (out / "model.safetensors").stat().st_mtime_ns
    stdout, stderr = other.communicate(timeout=300)
    assert other.returncode == 0, stderr[-2000:]
    assert stdout.strip() == str(out)
    assert (out / "model.safetensors").stat().st_mtime_ns == built  # found done, not built again
    assert (out / "tokenizer.json").exists()


@pytest.mark.parametrize(("accuracies", "kept", "tries"), [([0.3, 0.7, 0.9], 1, 2), ([0.2, 0.4, 0.3], 1, 3),
                                                          ([0.6], 0, 1)])
def test_tiny_arith_tries_the_next_seed_until_its_copying_holds_and_keeps_the_best(
        tmp_path, monkeypatch, caplog, accuracies, kept, tries):
    import agentrl.models as models
    import agentrl.models.tiny as tiny
    import agentrl.models.warmstart as warmstart

    seeds: list[int] = []

    def fake_warm_start(folder, *, steps, copy_steps, seed):
        (Path(folder) / "weights").write_text(f"seed {seed}")
        seeds.append(seed)
        return {"loss": 0.1 * seed, "seconds": 1.0}

    monkeypatch.setattr(tiny, "build_tiny_model", lambda folder, overwrite: Path(folder).mkdir(parents=True))
    monkeypatch.setattr(warmstart, "warm_start", fake_warm_start)
    monkeypatch.setattr(warmstart, "copy_accuracy", lambda folder: accuracies[seeds[-1]])
    out = models.build_tiny_arith_model(tmp_path / "tiny-arith")
    assert seeds == list(range(tries))
    assert (out / "weights").read_text() == f"seed {kept}"
    stamp = json.loads((out / "agentrl_warmstart.json").read_text())
    assert stamp["seed"] == kept and stamp["copy_accuracy"] == accuracies[kept]
    assert stamp["min_copy_accuracy"] == models.ARITH_RECIPE["min_copy_accuracy"]
    assert [p.name for p in tmp_path.iterdir()] == ["tiny-arith"]  # no try folder left behind
    assert ("no try reached" in caplog.text) == (max(accuracies) < models.ARITH_RECIPE["min_copy_accuracy"])
