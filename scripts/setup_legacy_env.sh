#!/usr/bin/env bash
# Builds .venv-legacy: TransformerLens 2.x (legacy HookedTransformer) with transformers 4.x
# and numpy 1.x, which cannot share an environment with TransformerLens 4.x. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venv-legacy
export PIP_DISABLE_PIP_VERSION_CHECK=1
[ -x "$VENV/bin/python" ] || python -m venv "$VENV"
"$VENV/bin/python" -m pip install -q torch==2.13.0
# A bare transformer-lens<3 resolves to a release that breaks on numpy 2; these pins install offline.
"$VENV/bin/python" -m pip install -q "transformer-lens<3" "datasets<4" "pyarrow<21" pytest scipy tqdm
"$VENV/bin/python" -m pip install -q --no-deps -e .
