#!/usr/bin/env bash
# The README's second command: the test suite (runs scripts/setup.sh --tests first if the machine
# was not set up for the tests).
# Tests marked `gpu` are deselected unless AGENTRL_TEST_MARKERS says otherwise (e.g. "" on a GPU box).
# The 25 slowest tests and the time per test file are listed at the end, so a CI log says where the
# suite's time goes.
set -euo pipefail
cd "$(dirname "$0")/.."
# a machine set up by the quickstart lacks what only the tests need (the dev extra, .venv-verifiers)
case "$(cat .venv/.agentrl-installed 2>/dev/null)" in
  *cpu,dev) [ -x .venv-verifiers/bin/python ] || bash scripts/setup.sh --tests ;;
  *) bash scripts/setup.sh --tests ;;
esac
bash scripts/docker-up.sh
exec .venv/bin/python -m pytest -q --durations=25 -m "${AGENTRL_TEST_MARKERS-not gpu}" "$@"
