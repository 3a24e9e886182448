#!/bin/sh
# Entry point of the agentrl images.
# 1. The admin token comes from a file (a Docker or Kubernetes secret) named by
#    $AGENTRL_ADMIN_TOKEN_FILE and is passed on in $AGENTRL_ADMIN_TOKEN, so it never appears on a
#    command line (where every user of the host could read it in the process list).
# 2. `docker run IMAGE serve ...` runs `agentrl serve ...`; any other program (torchrun, ray, sh) runs as given.
set -eu
if [ -n "${AGENTRL_ADMIN_TOKEN_FILE:-}" ]; then
  if [ ! -r "$AGENTRL_ADMIN_TOKEN_FILE" ]; then
    echo "agentrl-entrypoint: cannot read the admin token file $AGENTRL_ADMIN_TOKEN_FILE" >&2
    exit 2
  fi
  AGENTRL_ADMIN_TOKEN="$(tr -d '[:space:]' < "$AGENTRL_ADMIN_TOKEN_FILE")"
  export AGENTRL_ADMIN_TOKEN
fi
case "${1:-}" in
  "" | -* | serve | learn | run | config | model | sandbox | envs | status | plot | eval | view | doctor | tinker)
    exec agentrl "$@" ;;
  *)
    exec "$@" ;;
esac
