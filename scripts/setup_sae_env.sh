#!/usr/bin/env bash
# Builds .venv-sae: the environment a sparse-autoencoder researcher has -- sae-lens 6 (which requires
# transformer-lens<4, as it imports HookedTransformer) with TransformerLens 3.9 -- and this package installed into
# it with its [transformer-lens] extra, so that resolving the extra there is itself checked. tests/sae run in it.
# Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venv-sae
export PIP_DISABLE_PIP_VERSION_CHECK=1
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install -q)
# The CPU build of torch on this machine's disk; a bare `torch` would pull a CUDA build.
"${PIP[@]}" torch==2.13.0
# One resolution: sae-lens, TransformerLens 3.9 and the package's extra must agree.
"${PIP[@]}" torch==2.13.0 sae-lens "transformer-lens==3.9.*" ".[transformer-lens]" pytest
