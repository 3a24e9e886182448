"""Every benchmark that starts engines or sandboxes reaches its final JSON line, with the keys the docs
quote: ``benchmarks/smoke.py``'s list, each in its shortest mode.

``tests/test_benchmark_smoke.py`` runs the benchmarks that need no engine; this file runs those with
a vLLM engine or sandboxes of their own (and ``first_hour``: a fresh clone and venv to the
quickstart's first step), ``tests/test_benchmark_runs.py`` those made of whole ``agentrl run``s, one
after another as ``scripts/test.sh`` runs system tests (each file in its own lane). They are marked
``benchmark_smoke``, which CI's run deselects (about 20 minutes more on 2 cores: run them before a
release with ``AGENTRL_TEST_MARKERS="not gpu" bash scripts/test.sh``). Each runs as
a subprocess of this interpreter from the repository root with ``TMPDIR`` in a folder of its own
(``smoke.run_one``), so what a benchmark leaves in the temporary folder is removed with it.
The test checks that it exits 0 and that the LAST line of its stdout is a JSON object holding the
keys README.md and docs/*.md quote; it asserts nothing about the figures, which mean nothing in
so short a run. ``chaos`` is not here: ``tests/test_chaos.py`` runs it at its defaults (20 trials).
"""

from __future__ import annotations

import pytest

from tests.benchmark_helpers import COVERED_ELSEWHERE, RUNS, run_benchmark, smoke

pytestmark = [pytest.mark.vllm, pytest.mark.docker, pytest.mark.slow, pytest.mark.benchmark_smoke]

ENGINE_BENCHMARKS = [b for b in smoke.BENCHMARKS if b[0] not in COVERED_ELSEWHERE | RUNS]


@pytest.mark.timeout(1500)
@pytest.mark.parametrize(("name", "args", "keys"), ENGINE_BENCHMARKS, ids=[b[0] for b in ENGINE_BENCHMARKS])
def test_engine_benchmark_reaches_its_json_line(name: str, args: list[str], keys: list[str]) -> None:
    run_benchmark(name, args, keys)
