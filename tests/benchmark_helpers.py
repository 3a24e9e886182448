"""What the benchmark tests share (a test helper, no tests): ``benchmarks/smoke.py``, loaded by path
(``benchmarks/`` holds scripts, not a package; nothing is added to ``sys.path``), with its list of
benchmarks and their keys, and :func:`run_benchmark`, which runs one entry of that list."""

from __future__ import annotations

import importlib.util
import shutil
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("benchmarks_smoke", ROOT / "benchmarks" / "smoke.py")
assert _spec is not None and _spec.loader is not None
smoke = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(smoke)

COVERED_ELSEWHERE = {"chaos"}  # tests/test_chaos.py runs benchmarks/chaos.py with its defaults
# made of whole `agentrl run`s (two each for the comparisons): tests/test_benchmark_runs.py
RUNS = {"async_vs_sync", "multi_agent", "multi_agent_stragglers", "scoring_pace", "learning", "curriculum",
        "distill"}


def run_benchmark(name: str, args: list[str], keys: list[str]) -> None:
    """One benchmark in its shortest mode, its output and ``TMPDIR`` in a folder of the system's
    temporary folder (pytest's are too long a path for the unix sockets some benchmarks' parts
    bind), removed once it passed (``first_hour`` leaves a clone and a venv there: 3.6 GB)."""
    root = Path(tempfile.mkdtemp(prefix="agentrl-bench-"))
    ok, why = smoke.run_one(name, args, keys, root, timeout_s=1400)
    assert ok, f"benchmarks/{smoke.SCRIPTS.get(name, name)}.py {' '.join(args)} (output in {root}): {why}"
    shutil.rmtree(root, ignore_errors=True)
