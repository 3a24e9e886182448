#!/usr/bin/env bash
# Build the agentrl SWE sandbox image without any registry: the base image's recipe plus git, for
# software-engineering tasks that are git repositories (environments/swe).
# Usage: build.sh IMAGE_TAG
set -euo pipefail
AGENTRL_SANDBOX_PACKAGES=python3-minimal,python3,git exec bash "$(dirname "$0")/../base/build.sh" "${1:-agentrl/swe:latest}"
