#!/usr/bin/env bash
# Builds .venv-core: the package's core install alone (`pip install equivariance-probe`, no extra) beside
# torch, so that tests/core checks what a user who brings their own model gets: the import, a probe of
# a model built from a config, and the named error (with its pip command) for anything an extra brings.
# The package goes in as a user gets it: the source distribution is built, the wheel is built from it, and
# the wheel is installed (not the source tree), so a module the distributions leave out fails tests/core.
# Idempotent: each run installs the wheel of the tree as it is now.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venv-core
DIST="$VENV/dist"
export PIP_DISABLE_PIP_VERSION_CHECK=1
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
# The CPU build of torch on this machine's disk; a bare `torch` would pull a CUDA build.
"$VENV/bin/python" -m pip install -q torch==2.13.0
# build, with the build system pyproject.toml names, installed here: the build runs without fetching it again.
"$VENV/bin/python" -m pip install -q build "setuptools>=77" wheel pytest
rm -rf "$DIST"
# Without --sdist/--wheel, build makes the sdist and then the wheel from the unpacked sdist, as a release does.
"$VENV/bin/python" -m build --no-isolation --outdir "$DIST" . >/dev/null
"$VENV/bin/python" -m pip uninstall -q -y equivariance-probe 2>/dev/null || true
"$VENV/bin/python" -m pip install -q "$DIST"/equivariance_probe-*.whl
