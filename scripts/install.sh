#!/usr/bin/env bash
# Installs equivariance_probe and everything its tests need, offline but for the package
# registries. Idempotent: re-running installs nothing new.
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1
# A CPU build of torch 2.13.0 lies on this machine's disk; a bare `torch` would pull a
# multi-GB CUDA build, so it is pinned and installed first.
python -m pip install -q torch==2.13.0
python -m pip install -q -e ".[test]"
# TransformerLens 2.x (legacy HookedTransformer) needs transformers 4.x and numpy 1.x,
# so its adapter is tested in a second environment.
bash scripts/setup_legacy_env.sh
