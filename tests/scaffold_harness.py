"""Test helper: run a group of scaffold episodes through ``agentrl serve`` (the :class:`Serve`
composition, in this process) against the session's real vLLM engine, and check their samples.

What crosses to the engine is captured at the engine pool (every token-in generate request and the
ids it returned, streamed or not), so the checks compare samples with the engine's own ids, not
with what the router recorded about itself.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import free_port
from tests.router_harness import capture_generates, ids


@dataclass
class GroupRun:
    episodes: list[dict[str, Any]]  # episodes.jsonl lines
    samples: list[Any]  # what the orchestrator put into the buffer
    records: dict[str, list[dict[str, Any]]]  # session id -> call records (run_dir/sessions)
    generated: list[tuple[list[int], list[int], list[float]]]
    """(prompt ids, completion ids, logprobs) per generate"""
    router_counters: dict[str, float]
    instance_id: str | None
    containers_left: list[str] = field(default_factory=list)
    routes: set[str] = field(default_factory=set)
    """the router routes the calls came in on (chat, responses, ...)"""


async def _run(engine_url: str, run_dir: Path, *, env: str, group_size: int, scaffold: dict[str, str],
               env_overrides: dict[str, Any], env_config: dict[str, Any] | None,
               configure: Callable[[Any], None] | None = None) -> GroupRun:
    from agentrl.config import ServeConfig
    from agentrl.rollout.config import FunctionScaffold, ProgramScaffold
    from agentrl.serve import Serve

    cfg = ServeConfig(model="tiny-tools", run_dir=str(run_dir), admin_token="scaffold-test-admin",
                      max_episodes=group_size)
    cfg.engine.urls = [engine_url]
    cfg.router.port = free_port()
    cfg.env.name, cfg.env.group_size, cfg.env.max_concurrency = env, group_size, group_size
    cfg.env.config = env_config or {}
    for k, v in {"max_tokens": 48, "max_turns": 3, "episode_timeout_s": 120.0, **env_overrides}.items():
        setattr(cfg.env, k, v)
    cfg.buffer.batch_size = group_size
    cfg.sandbox.backend, cfg.sandbox.warm, cfg.sandbox.memory_mb = "docker", 0, 256
    if scaffold.get("agent"):
        cfg.scaffold = FunctionScaffold(agent=scaffold["agent"])
    elif scaffold.get("command"):
        cfg.scaffold = ProgramScaffold(command=scaffold["command"])
    if configure is not None:
        configure(cfg)
    cfg.check()
    serve = Serve(cfg)
    samples: list[Any] = []
    generated: list[tuple[list[int], list[int], list[float]]] = []
    try:
        await serve.start()
        # start() returns before the orchestrator's first step: wrap the seams it will use.
        real_put = serve.buffer.put

        async def put(batch: list[Any]) -> int:
            samples.extend(batch)
            return await real_put(batch)

        serve.buffer.put = put  # type: ignore[method-assign]
        generated = capture_generates(serve.pool)
        await asyncio.wait_for(serve.rollout_finished(), timeout=600)
        counters = dict(serve.router.counters)
        routes = {s.labels.get("route", "") for family in serve.router.metrics.request_seconds.collect()
                  for s in family.samples}
        instance = serve.sandbox_pool.instance_id if serve.sandbox_pool else None
    finally:
        await serve.close()
    episodes = [json.loads(x) for x in (run_dir / "episodes.jsonl").read_text().splitlines() if x.strip()]
    records: dict[str, list[dict[str, Any]]] = {}
    for p in sorted((run_dir / "sessions").glob("*.jsonl")):
        records[p.stem] = [json.loads(x) for x in p.read_text().splitlines() if x.strip()]
    left: list[str] = []
    if instance is not None:
        left = subprocess.run(["docker", "ps", "-aq", "--filter", f"label=agentrl.instance={instance}"],
                              capture_output=True, text=True, check=True).stdout.split()
    return GroupRun(episodes, samples, records, generated, counters, instance, left, routes)


def run_group(engine_url: str, run_dir: Path, *, env: str, group_size: int = 2, scaffold: dict[str, str],
              env_config: dict[str, Any] | None = None, configure: Callable[[Any], None] | None = None,
              **env_overrides: Any) -> GroupRun:
    """One group of ``group_size`` episodes of ``env`` played by ``scaffold`` ({"agent": ...} or
    {"command": ...}) through Serve; returns what it produced once serve has shut down.
    ``configure``: changes the ServeConfig before it is checked (policies, roles, LoRA)."""
    return asyncio.run(_run(engine_url, run_dir, env=env, group_size=group_size, scaffold=scaffold,
                            env_overrides=env_overrides, env_config=env_config, configure=configure))


def check_exact_samples(run: GroupRun) -> None:
    """The plumbing invariants every scaffold run must keep.

    - every model call went through an episode's session: each generate the engine served is one
      recorded call, and the router saw no other call;
    - each record's prompt and completion are a generate request and the ids the engine returned;
    - one sample per chain of calls that extend each other token for token, and each sample is the
      leaf's prompt plus completion with the loss mask (and the logprobs) exactly on the chain's
      sampled ids.
    """
    episode_ids = {e["episode_id"] for e in run.episodes}
    all_records = [r for sid, recs in run.records.items() if sid in episode_ids for r in recs]
    assert len(all_records) == len(run.generated), (len(all_records), len(run.generated))
    assert sum(len(v) for v in run.records.values()) == len(all_records), "a call outside the episodes"
    assert run.router_counters["calls"] == len(all_records) + run.router_counters["errors_4xx"]
    engine_calls = sorted((tuple(p), tuple(c), tuple(lp)) for p, c, lp in run.generated)
    record_calls = sorted((tuple(r["prompt_ids"]), tuple(r["completions"][0]["token_ids"]),
                           tuple(r["completions"][0]["logprobs"])) for r in all_records)
    assert record_calls == engine_calls  # ids and behaviour logprobs, exactly as the engine returned them
    by_episode: dict[str, list[Any]] = {}
    for s in run.samples:
        by_episode.setdefault(s.episode_id, []).append(s)
    assert set(by_episode) == episode_ids
    for ep in run.episodes:
        recs = {r["index"]: r for r in run.records.get(ep["episode_id"], [])}
        samples = [s for s in by_episode[ep["episode_id"]] if len(s.token_ids)]
        extended = {r["parent"] for r in recs.values() if r["parent"] is not None}
        leaves = [i for i in recs if i not in extended]
        assert len(samples) == len(leaves) == ep["num_samples"] if recs else ep["num_samples"] == 1
        assert ep["splits"] == sum(r["parent"] is None for r in recs.values()) - (1 if recs else 0)
        for s in samples:
            chain = s.info["calls"]
            leaf = recs[chain[-1]]
            tokens, mask = ids(s.token_ids), ids(s.loss_mask)
            assert tokens == leaf["prompt_ids"] + leaf["completions"][0]["token_ids"]
            want_mask = [0] * len(tokens)
            for i in chain:
                r = recs[i]
                start, comp = len(r["prompt_ids"]), r["completions"][0]["token_ids"]
                assert tokens[start:start + len(comp)] == comp  # the sampled ids, in place
                want_mask[start:start + len(comp)] = [1] * len(comp)
                got_lps = [float(x) for x in s.logprobs[start:start + len(comp)]]
                assert got_lps == pytest.approx(r["completions"][0]["logprobs"], rel=1e-6, abs=1e-6)
            assert mask == want_mask
            for a, b in zip(chain, chain[1:], strict=False):
                assert recs[b]["parent"] == a  # the chain extends call by call
            assert s.reward == ep["reward"]
    assert run.containers_left == []


def on_lora(roles: dict[str, Any], *policies: str) -> Callable[[Any], None]:
    """A :func:`run_group` ``configure`` for the shared LoRA engine (``tests/conftest.py``'s
    ``lora_engine``): its LoRA flags, the named ``policies`` (staleness bound 0) and the ``roles``'
    bindings (``env.roles``)."""
    from agentrl.serve.config import PolicyConfig

    def configure(cfg: Any) -> None:
        cfg.engine.lora_rank, cfg.engine.max_loras = 8, 3
        cfg.policies = {p: PolicyConfig(max_staleness=0) for p in policies}
        cfg.env.roles = dict(roles)

    return configure
