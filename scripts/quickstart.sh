#!/usr/bin/env bash
# The README's first command: set this machine up, then train on one machine with the defaults.
set -euo pipefail
cd "$(dirname "$0")/.."
# First what cannot work (no way to run a sandbox, taken ports, a read-only or full disk): stop
# before installing anything. agentrl doctor needs only the standard library, so the system Python
# runs it before the venv exists; what setup installs is a warning there.
PY=${PYTHON:-python3}
"$PY" -c 'import sys; sys.exit(sys.version_info < (3, 11))' \
  || { echo "[quickstart] agentrl needs Python 3.11 or newer; set PYTHON=/path/to/python3.11" >&2; exit 1; }
"$PY" -m agentrl.cli doctor --before-setup "$@" \
  || { echo "[quickstart] stopped before installing anything: fix the lines marked missing above" >&2; exit 1; }
bash scripts/setup.sh
# The quickstart's model: the tiny model warm-started on arithmetic transcripts. The project ships
# it (agentrl/models/shipped/): copied into the cache in a second, not built.
t=$SECONDS
.venv/bin/agentrl model build tiny-agent >/dev/null
echo "[quickstart] phase model took $((SECONDS - t)) s"
exec .venv/bin/agentrl run "$@"
