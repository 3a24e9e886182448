#!/usr/bin/env bash
# The README's second command: the test suite (needs scripts/setup.sh to have run once).
# Tests marked `gpu` are deselected unless AGENTRL_TEST_MARKERS says otherwise (e.g. "" on a GPU box).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/docker-up.sh
exec .venv/bin/python -m pytest -q -m "${AGENTRL_TEST_MARKERS-not gpu}" "$@"
