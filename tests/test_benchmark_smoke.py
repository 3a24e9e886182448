"""Every benchmark that needs no engine reaches its final JSON line, with the keys the docs quote.

Each benchmark below runs as a subprocess of this interpreter, from the repository root, in its
shortest mode (a few samples, steps, requests or seconds; a tiny model where one is asked for).
The test checks that it exits 0 and that the LAST line of its stdout is a JSON object holding the
keys that README.md and docs/*.md quote for that benchmark's figures, and that the numeric ones
are finite numbers. It asserts nothing about speed: the figures of so short a run mean nothing;
what is checked is that the whole path to the final line still works (a benchmark that crashed at
its final ``json.dumps``, or whose samples lacked a field the learner's step came to read, fails
here instead of at the next measurement).

Not here, because each starts vLLM engines, sandboxes or a whole ``agentrl run`` for minutes:
``async_vs_sync``, ``chaos``, ``delta_sync``, ``distill``, ``first_hour``, ``learning``,
``lora_sync``, ``moe_replay``, ``sampling_parity``, ``sandbox``, ``scaffolds``, ``weight_sync``,
``scoring_pace`` (two ``agentrl run`` of ``async_vs_sync``'s workload, with and without a judge), and
``tinker_cookbook`` (tinker-cookbook is not in the project's extras, and a short run takes minutes).
"""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.benchmark_helpers import ROOT, smoke

ROUTES = ("chat", "responses", "messages")

# (script, arguments, keys that must be present, keys whose values must be finite numbers).
# A key of the last kind may be a tuple: a path into nested objects. "{tmp}" is the test's tmp_path.
BENCHMARKS: list[tuple[str, list[str], list[str], list[str | tuple[str, ...]]]] = [
    (
        "agent_loops",
        ["--concurrency", "20", "--duration", "2", "--ramp", "0.5", "--warmup", "0.5",
         "--engine-ms", "50", "--tool-median-ms", "20"],
        # README.md (agent loops) and docs/environments.md (*Scale: the agent-loop benchmark*)
        ["concurrent_episodes", "in_flight_at_end", "leaked_sessions", "errors", "local_render"],
        ["episodes_per_s", "loop_lag_p50_ms", "loop_lag_p99_ms", "loop_lag_max_ms",
         "rss_mb_per_1k_episodes", "agent_cpu_ms_per_model_call", "gc_full_collections",
         "gc_pause_total_ms"],
    ),
    (
        "buffer",
        ["--samples", "1024", "--fetches", "2", "--dir", "{tmp}/buffer"],  # 1,024: one round
        # README.md (buffer) and docs/buffer.md (*Benchmark*)
        ["sync", "samples", "put_chunk"],
        ["put_samples_per_s", "get_samples_per_s", "batch_fetch_ms_p50", "batch_fetch_ms_p90",
         "bytes_per_sample", "put_samples_per_s_one_per_call", "put_samples_per_s_lists",
         "get_samples_per_s_lists", "batch_fetch_ms_p50_lists", "put_samples_per_cpu_s",
         "get_samples_per_cpu_s", "batch_fetch_cpu_ms_p50", "load_avg_1m"],
    ),
    (
        "grpo_offline",
        ["--steps", "1", "--prompts", "2", "--group", "4", "--eval-prompts", "1", "--eval-samples", "2"],
        # docs/learner.md (*Does it learn?*: reward before -> after)
        ["model", "optimizer"],
        ["reward_before", "reward_after", "eval_samples", "samples_per_step", "minutes"],
    ),
    (
        "large_body",
        ["--seconds", "1"],
        # docs/operating.md: the small requests' p50/p99 in each phase, the big ones' statuses
        ["big_statuses_during_50mib", "big_statuses_during_4mib"],
        [f"small_{q}_ms_{phase}" for phase in ("baseline", "during_50mib", "during_4mib")
         for q in ("p50", "p99")] + ["load_avg"],
    ),
    (
        "learner",
        ["--model", "tiny", "--samples", "2", "--tokens", "64", "--steps", "1", "--warmup", "0"],
        # README.md (learner), docs/learner.md (*Tests and benchmark*) and the script's docstring
        ["model"],
        ["tokens_per_s", "plain_torch_tokens_per_s", "overhead_ratio", "cpu_overhead_ratio",
         "learner_step_s", "plain_step_s"],
    ),
    (
        "tinker_service",
        ["--model", "tiny", "--samples", "2", "--tokens", "64", "--steps", "1", "--warmup", "0"],
        # docs/tinker.md (*Throughput*) and the script's docstring
        ["model", "lora_rank"],
        ["service_tokens_per_s", "learner_tokens_per_s", "ratio", "service_step_s", "learner_step_s"],
    ),
    (
        "learner_memory",
        ["--settings", "tiny:256", "--limit-gb", "4"],
        # README.md (learner memory) and docs/learner.md; the SmolLM2 figures are null in this mode
        ["peak_gb", "peak_gb_smollm2_8k", "growth_8k_to_16k", "growth_2k_to_8k",
         "growth_vocab152k_2k_to_8k", "activation_checkpointing"],
        [("peak_gb", "tiny:256"), ("step_s", "tiny:256")],
    ),
    (
        "router_overhead",
        ["--requests", "50", "--concurrency", "1,4", "--loadgen-procs", "1"],
        # README.md (router) and docs/router.md (*Overhead*): the chat figures under their old
        # names, then each dialect's added p50 and completions/s
        ["levels", "routes"],
        ["added_latency_p50_ms", "added_latency_p99_ms", "router_req_per_s", "direct_req_per_s",
         "router_req_per_cpu_s", "load_avg_1m"]
        + [f"{route}_{key}" for route in ROUTES for key in ("added_p50_ms", "req_per_s")],
    ),
]


def _lookup(result: dict[str, Any], key: str | tuple[str, ...]) -> Any:
    value: Any = result
    for part in (key,) if isinstance(key, str) else key:
        assert isinstance(value, dict) and part in value, f"missing {key!r} in {result}"
        value = value[part]
    return value


@pytest.mark.slow
@pytest.mark.parametrize(("name", "args", "keys", "numbers"), BENCHMARKS, ids=[b[0] for b in BENCHMARKS])
def test_benchmark_reaches_its_json_line(name: str, args: list[str], keys: list[str],
                                         numbers: list[str | tuple[str, ...]], tmp_path: Path) -> None:
    cmd = [sys.executable, f"benchmarks/{name}.py", *(a.replace("{tmp}", str(tmp_path)) for a in args)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    result, why = smoke.final_line(proc, keys)  # exit 0, a JSON object as the last line, the keys in it
    assert result is not None, f"{' '.join(cmd[1:])}: {why}"
    for key in numbers:
        value = _lookup(result, key)
        assert isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value), (
            f"{name}: {key!r} is {value!r}, not a finite number"
        )
