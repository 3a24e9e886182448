"""Every benchmark made of whole ``agentrl run``s reaches its final JSON line, with the keys the docs
quote, in its shortest mode (``tests/test_benchmark_engines.py`` says how; this file is the other
half of that list, so that ``scripts/test.sh`` can run each half in its own lane)."""

from __future__ import annotations

import pytest

from tests.benchmark_helpers import RUNS, run_benchmark, smoke

pytestmark = [pytest.mark.vllm, pytest.mark.docker, pytest.mark.slow, pytest.mark.benchmark_smoke]

RUN_BENCHMARKS = [b for b in smoke.BENCHMARKS if b[0] in RUNS]


@pytest.mark.timeout(1500)
@pytest.mark.parametrize(("name", "args", "keys"), RUN_BENCHMARKS, ids=[b[0] for b in RUN_BENCHMARKS])
def test_run_benchmark_reaches_its_json_line(name: str, args: list[str], keys: list[str]) -> None:
    run_benchmark(name, args, keys)
