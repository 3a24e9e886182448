#!/usr/bin/env bash
# The README's second command: the test suite (runs scripts/setup.sh --tests first if the machine
# was not set up for the tests).
# Tests marked `gpu` are deselected unless AGENTRL_TEST_MARKERS says otherwise (e.g. "" on a GPU box).
# Two pytest runs side by side: the tests of modules that start engines, serve or sandboxes
# (marked `system` by tests/conftest.py) one after another, and the in-process tests beside them at
# a lower CPU priority, so they fill what the system tests leave idle; the second run's report
# follows the first's. AGENTRL_TEST_SPLIT=0 runs everything in one pytest instead. Each run lists
# its 25 slowest tests and its time per test file at the end, so a CI log says where the suite's
# time goes.
set -euo pipefail
cd "$(dirname "$0")/.."
# a machine set up by the quickstart lacks what only the tests need (the dev extra, .venv-verifiers)
case "$(cat .venv/.agentrl-installed 2>/dev/null)" in
  *cpu,dev) [ -x .venv-verifiers/bin/python ] || bash scripts/setup.sh --tests ;;
  *) bash scripts/setup.sh --tests ;;
esac
bash scripts/docker-up.sh
markers=${AGENTRL_TEST_MARKERS-not gpu}
pytest=(.venv/bin/python -m pytest -q --durations=25)
if [ "${AGENTRL_TEST_SPLIT-1}" = 0 ]; then
  exec "${pytest[@]}" -m "$markers" "$@"
fi
with() { if [ -n "$markers" ]; then echo "($markers) and $1"; else echo "$1"; fi; }
base=$(mktemp -d /tmp/agentrl-tests.XXXXXX)
nice -n 10 "${pytest[@]}" -m "$(with "not system")" --basetemp="$base/in-process" "$@" > "$base/in-process.log" 2>&1 &
beside=$!
trap 'kill "$beside" 2>/dev/null || true' EXIT INT TERM
set +e
"${pytest[@]}" -m "$(with system)" "$@"
system=$?
echo "[test] waiting for the in-process tests run beside (their report follows)"
wait "$beside"
in_process=$?
set -e
echo "[test] ======================== the in-process tests ========================"
cat "$base/in-process.log"
rm -rf "$base"
# 5: this selection holds no test of the kind (e.g. one file given); not a failure
ok() { [ "$1" = 0 ] || [ "$1" = 5 ]; }
ok "$system" && ok "$in_process" && ! { [ "$system" = 5 ] && [ "$in_process" = 5 ]; } || {
  echo "[test] FAILED: system tests exit $system, in-process tests exit $in_process" >&2; exit 1; }
echo "[test] passed: system tests exit $system, in-process tests exit $in_process"
