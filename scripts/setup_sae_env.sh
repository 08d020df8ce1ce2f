#!/usr/bin/env bash
# Builds .venv-sae: the environment a sparse-autoencoder researcher has -- sae-lens 6 (which requires
# transformer-lens<4: TransformerLens 4 removed the HookedTransformer that sae-lens extends) with TransformerLens
# 3.9 -- and this package installed into it with its [transformer-lens] extra, in one resolution, so that the extra
# resolving there is itself checked. tests/sae run in it (tests/test_sae_environment.py). Idempotent. Measured on
# 2 shared cores: 15 minutes the first time (2.0 GB, 124 packages: sae-lens brings datasets, plotly, nltk and
# wandb), a minute and a half once built; its tests take about a minute.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venv-sae
export PIP_DISABLE_PIP_VERSION_CHECK=1
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install -q)
# The CPU build of torch on this machine's disk; a bare `torch` would pull a CUDA build.
"${PIP[@]}" torch==2.13.0
# One resolution: sae-lens, TransformerLens 3.9 and the package's extra must agree.
"${PIP[@]}" torch==2.13.0 sae-lens "transformer-lens==3.9.*" -e ".[transformer-lens]" pytest
