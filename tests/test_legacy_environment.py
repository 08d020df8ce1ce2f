"""Runs the TransformerLens 2.x (HookedTransformer) tests in their own environment.

TransformerLens 2.x needs transformers 4.x and numpy 1.x, which cannot share an
environment with TransformerLens 4.x, so `scripts/setup_legacy_env.sh` builds
`.venv-legacy` and this test runs `tests/legacy` there.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PYTHON = ROOT / ".venv-legacy" / "bin" / "python"


@pytest.mark.legacy
def test_legacy_hooked_transformer_suite_passes():
    if not PYTHON.exists():
        if os.environ.get("CI"):
            pytest.fail("CI must build the TransformerLens 2.x environment: run scripts/setup_legacy_env.sh")
        pytest.skip("no .venv-legacy: run scripts/setup_legacy_env.sh to test the HookedTransformer adapter")
    completed = subprocess.run(
        [str(PYTHON), "-m", "pytest", "-q", "-p", "no:cacheprovider", str(ROOT / "tests" / "legacy")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    print(completed.stdout[-5000:])
    assert completed.returncode == 0, completed.stdout[-5000:] + completed.stderr[-3000:]
    assert " passed" in completed.stdout
