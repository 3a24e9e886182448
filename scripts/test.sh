#!/usr/bin/env bash
# The README's second command: the test suite (needs scripts/setup.sh to have run once).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/docker-up.sh
exec .venv/bin/python -m pytest -q "$@"
