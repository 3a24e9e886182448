#!/usr/bin/env bash
# The README's first command: set this machine up, then train on one machine with the defaults.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/agentrl run "$@"
