#!/usr/bin/env bash
# Start a Docker engine that leaves the host network alone, unless one already answers.
# Idempotent: exits 0 at once when `docker info` works. The engine runs in a session of its own, so
# a Ctrl-C in the terminal that started it (the quickstart's) does not stop it.
set -euo pipefail
if docker info >/dev/null 2>&1; then exit 0; fi
state=${AGENTRL_DOCKER_STATE:-/var/lib/agentrl-docker}
mkdir -p "$state/data" "$state/exec"
echo "[setup] starting dockerd (data-root $state/data, no iptables, no bridge)"
setsid nohup dockerd --iptables=false --ip-masq=false --bridge=none --storage-driver=overlay2 \
  --data-root "$state/data" --exec-root "$state/exec" -H unix:///var/run/docker.sock \
  >"$state/dockerd.log" 2>&1 &
for _ in $(seq 1 100); do
  if docker info >/dev/null 2>&1; then echo "[setup] dockerd ready"; exit 0; fi
  sleep 0.2
done
echo "[setup] dockerd did not start; see $state/dockerd.log" >&2
tail -20 "$state/dockerd.log" >&2
exit 1
