"""serve restarts in place: on its run directory it brings the engines back to the last published
weights and version before it answers, instead of coming back at version 0 with the base weights
(which left a resumed learner rejecting every new sample as stale)."""

from __future__ import annotations

import asyncio
import json
import urllib.request
from pathlib import Path

import pytest

from agentrl.client import get_json
from tests.conftest import ServeProcess as Serve
from tests.conftest import free_port, start_vllm

pytestmark = [pytest.mark.vllm]


def test_a_restarted_serve_comes_back_at_the_last_published_version(
    tmp_path: Path, tiny_tools_model: str
) -> None:
    from safetensors.torch import load_file

    from agentrl.weights.transfer import publish, serialize_state_dict

    engine = start_vllm(tiny_tools_model, tmp_path / "engine-logs")
    try:
        run_dir, port = tmp_path / "run", free_port()
        config = tmp_path / "serve.toml"
        config.write_text(f"""model = "tiny-tools"
run_dir = "{run_dir}"
endpoint_only = true
[engine]
urls = ["{engine.url}"]
[router]
port = {port}
""")
        state = load_file(str(Path(tiny_tools_model) / "model.safetensors"))
        state = {k: v + 0.01 if k.endswith("norm.weight") else v for k, v in state.items()}  # a new policy
        first = Serve(config, tmp_path / "serve1.out", port)
        try:
            first.wait_serving()
            token = (run_dir / "admin_token").read_text().strip()
            asyncio.run(publish(serialize_state_dict(state), 1, first.base, token))
            assert get_json(f"{first.base}/admin/status", token)[1]["version"] == 1
        finally:
            assert first.stop() == 0, (tmp_path / "serve1.out").read_text()[-3000:]

        second = Serve(config, tmp_path / "serve2.out", port)
        try:
            second.wait_serving()
            code, status = get_json(f"{second.base}/admin/status", token)
            body = json.dumps({"model": "tiny-tools", "max_tokens": 4,
                               "messages": [{"role": "user", "content": "What is 2 + 2?"}]}).encode()
            req = urllib.request.Request(f"{second.base}/v1/chat/completions", data=body,
                                         headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=120) as r:
                reply = json.loads(r.read())
        finally:
            assert second.stop() == 0, (tmp_path / "serve2.out").read_text()[-3000:]
        log = (tmp_path / "serve2.out").read_text()
        assert code == 200 and status["version"] == 1, (status, log[-3000:])
        assert [e["version"] for e in status["engines"]] == [1], status["engines"]
        assert "restoring policy version 1" in log, log[-3000:]
        assert reply["choices"][0]["message"]["role"] == "assistant"
    finally:
        engine.stop()
