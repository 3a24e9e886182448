#!/usr/bin/env bash
# The README's first command: set this machine up, then train on one machine with the defaults.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# The quickstart's model: the tiny model warm-started on arithmetic transcripts (cached; the first
# build takes 10-20 minutes on 2 cores and logs its progress).
.venv/bin/agentrl model build tiny-agent >/dev/null
exec .venv/bin/agentrl run "$@"
