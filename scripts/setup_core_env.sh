#!/usr/bin/env bash
# Builds .venv-core: the package's core install alone (`pip install equivariance-probe`, no extra) beside
# torch, so that tests/core checks what a user who brings their own model gets: the import, a probe of
# a model built from a config, and the named error (with its pip command) for anything an extra brings.
# Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venv-core
export PIP_DISABLE_PIP_VERSION_CHECK=1
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
# The CPU build of torch on this machine's disk; a bare `torch` would pull a CUDA build.
"$VENV/bin/python" -m pip install -q torch==2.13.0
"$VENV/bin/python" -m pip install -q -e . pytest
