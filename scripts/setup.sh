#!/usr/bin/env bash
# Sets a fresh machine up for kaitian: torch (CPU wheel), the build tools, kaitian
# itself (C++ extension built against the installed torch), the test
# dependencies and a running Docker engine. Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

log() { printf '[setup] %s\n' "$*"; }

if ! "$PY" -c 'import torch, sys; sys.exit(torch.__version__.split("+")[0] != "2.13.0")' 2>/dev/null; then
  log "installing torch 2.13.0 (CPU)"
  "$PY" -m pip install -q torch==2.13.0
fi
log "installing build tools and kaitian (editable, no build isolation)"
"$PY" -m pip install -q "setuptools>=64" wheel ninja
"$PY" -m pip install -q --no-build-isolation -e '.[test]'

bash scripts/docker-engine.sh
log "ready"
