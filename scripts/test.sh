#!/usr/bin/env bash
# The README's second command: the test suite (needs scripts/setup.sh to have run once).
# Tests marked `gpu` are deselected unless AGENTRL_TEST_MARKERS says otherwise (e.g. "" on a GPU box).
# The 25 slowest tests and the time per test file are listed at the end, so a CI log says where the
# suite's time goes.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/docker-up.sh
exec .venv/bin/python -m pytest -q --durations=25 -m "${AGENTRL_TEST_MARKERS-not gpu}" "$@"
