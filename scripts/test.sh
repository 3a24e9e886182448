#!/usr/bin/env bash
# The README's second command: the test suite (runs scripts/setup.sh --tests first if the machine
# was not set up for the tests).
# Tests marked `gpu` or `benchmark_smoke` are deselected unless AGENTRL_TEST_MARKERS says otherwise ("" on
# a GPU box; "not gpu" adds the engine benchmarks' smoke runs, about 20 minutes more on 2 cores).
# Three pytest runs side by side: the tests of modules that start engines, serve or sandboxes
# (marked `system` by tests/conftest.py) in two lanes, each one test after another (the second lane
# holds the long runs of LANE2: an engine's start-up imports vLLM in one process after another, so
# one lane leaves about a third of two cores idle), and the in-process tests beside them at a lower
# CPU priority, so they fill what the system tests leave idle; the other runs' reports follow the
# first's. Arguments (a file, -k ...) give one system lane. AGENTRL_TEST_SPLIT=0 runs everything in
# one pytest instead. Each run lists its 25 slowest tests and its time per test file at the end, so
# a CI log says where the suite's time goes.
set -euo pipefail
cd "$(dirname "$0")/.."
# a machine set up by the quickstart lacks what only the tests need (the dev extra, .venv-verifiers)
case "$(cat .venv/.agentrl-installed 2>/dev/null)" in
  *cpu,dev) [ -x .venv-verifiers/bin/python ] || bash scripts/setup.sh --tests ;;
  *) bash scripts/setup.sh --tests ;;
esac
bash scripts/docker-up.sh
markers=${AGENTRL_TEST_MARKERS-not gpu and not benchmark_smoke}
pytest=(.venv/bin/python -m pytest -q --durations=25)
if [ "${AGENTRL_TEST_SPLIT-1}" = 0 ]; then
  exec "${pytest[@]}" -m "$markers" "$@"
fi
with() { if [ -n "$markers" ]; then echo "($markers) and $1"; else echo "$1"; fi; }
base=$(mktemp -d /tmp/agentrl-tests.XXXXXX)
# (the files of LoRA policies and roles last, one after another: they share one engine, tests/conftest.py)
LANE2=(tests/test_chaos.py tests/test_partition.py tests/test_full_disk.py tests/test_own_environment.py
       tests/test_self_distill.py tests/test_moe_e2e.py tests/test_moe_smollm2.py tests/test_curriculum_vllm.py
       tests/test_benchmark_runs.py
       tests/test_tinker_sampling.py tests/test_lora_vllm.py
       tests/test_multi_agent_vllm.py tests/test_textarena_roles_vllm.py tests/test_verifiers_roles_vllm.py
       tests/test_scaffold_roles_vllm.py)
nice -n 10 "${pytest[@]}" -m "$(with "not system")" --basetemp="$base/in-process" "$@" > "$base/in-process.log" 2>&1 &
beside=$!
lane2=
if [ $# = 0 ]; then
  "${pytest[@]}" -m "$(with system)" --basetemp="$base/system-2" "${LANE2[@]}" > "$base/system-2.log" 2>&1 &
  lane2=$!
fi
trap 'kill "$beside" $lane2 2>/dev/null || true' EXIT INT TERM
set +e
if [ -n "$lane2" ]; then
  "${pytest[@]}" -m "$(with system)" "${LANE2[@]/#/--ignore=}"
else
  "${pytest[@]}" -m "$(with system)" "$@"
fi
system=$?
system2=5
if [ -n "$lane2" ]; then
  echo "[test] waiting for the second lane of system tests (its report follows)"
  wait "$lane2"
  system2=$?
fi
echo "[test] waiting for the in-process tests run beside (their report follows)"
wait "$beside"
in_process=$?
set -e
if [ -n "$lane2" ]; then
  echo "[test] ================== the second lane of system tests ==================="
  cat "$base/system-2.log"
fi
echo "[test] ======================== the in-process tests ========================"
cat "$base/in-process.log"
rm -rf "$base"
# 5: this selection holds no test of the kind (e.g. one file given); not a failure
ok() { [ "$1" = 0 ] || [ "$1" = 5 ]; }
ok "$system" && ok "$system2" && ok "$in_process" && \
  ! { [ "$system" = 5 ] && [ "$system2" = 5 ] && [ "$in_process" = 5 ]; } || {
  echo "[test] FAILED: system tests exit $system and $system2, in-process tests exit $in_process" >&2; exit 1; }
echo "[test] passed: system tests exit $system and $system2, in-process tests exit $in_process"
