#!/usr/bin/env bash
# Builds .venv-ndif: the NDIF server (PyPI `ndif`, its Ray/FastAPI/Redis dependencies) beside
# nnsight, so the remote tests (tests/ndif) run the probe against a real server on localhost.
# A separate environment keeps Ray and the server's pins out of the main one. Idempotent.
#
# ndif 0.1.2 declares Python >= 3.12 but every file runs on 3.11; `pip install "ndif[api,ray]"`
# with --ignore-requires-python then picks a numpy that needs 3.12, so its dependencies are
# installed first and ndif itself with --no-deps. redis-server (the server's queue) comes from
# Debian, only where apt-get exists and it is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venv-ndif
export PIP_DISABLE_PIP_VERSION_CHECK=1
if ! command -v redis-server >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1; then
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null) \
        || echo "redis-server could not be installed: the NDIF server tests will be skipped" >&2
fi
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install -q)
# The CPU build of torch on this machine's disk; a bare `torch` would pull a CUDA build.
"${PIP[@]}" torch==2.13.0
# nnsight at the main environment's version. transformers 5.15.0 (the oldest ndif accepts), not the main
# environment's 5.24: from some 5.2x on, check_task() names a pipeline's class by its dotted path, and
# nnsight 0.8.1 then sources no tokenizer for a meta model, so neither client nor ndif's sandbox
# runner can build a model named by a folder or hub id ("Impossible to guess which tokenizer"). einops: a core
# dependency of the package (installed below with --no-deps), which NDIF's servers have too (ndif's `ext` extra).
"${PIP[@]}" "ray[default]" fastapi "uvicorn[standard]" gunicorn python-multipart redis click python-dotenv \
    pyyaml boto3 pydantic zstandard accelerate peft "transformers==5.15.0" "nnsight==0.8.1" pytest scipy einops
"${PIP[@]}" --no-deps --ignore-requires-python ndif==0.1.2
"${PIP[@]}" --no-deps -e .
