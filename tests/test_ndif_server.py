"""Runs the remote-path tests against a real NDIF server, in their own environment.

The NDIF server (PyPI ``ndif``: Redis queue, Ray, FastAPI) needs Ray and transformers 5.15 beside
nnsight, which the main environment does not carry, so ``scripts/setup_ndif_env.sh`` builds
``.venv-ndif`` and this test runs ``tests/ndif`` there (about two minutes: each test module starts its
own stack, the tiny models deploy, the probe's and the shift test's remote runs are compared with local
ones, every process is stopped by its id).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PYTHON = ROOT / ".venv-ndif" / "bin" / "python"


def test_probe_against_a_local_ndif_server():
    if not PYTHON.exists():
        pytest.skip("no .venv-ndif: run scripts/setup_ndif_env.sh to test remote runs against an NDIF server")
    if shutil.which("redis-server") is None:
        pytest.skip("no redis-server (the NDIF server's queue): apt-get install redis-server")
    environment = {**os.environ, "PYTHONPATH": str(ROOT)}
    completed = subprocess.run(
        [str(PYTHON), "-m", "pytest", "-q", "-p", "no:cacheprovider", str(ROOT / "tests" / "ndif")],
        cwd=ROOT, capture_output=True, text=True, timeout=900, env=environment,
    )
    print(completed.stdout[-5000:])
    assert completed.returncode == 0, completed.stdout[-5000:] + completed.stderr[-3000:]
    assert " passed" in completed.stdout and "skipped" not in completed.stdout
