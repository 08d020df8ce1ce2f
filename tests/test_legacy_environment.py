"""Runs the TransformerLens 2.x (HookedTransformer) tests in their own environment.

TransformerLens 2.x needs transformers 4.x and numpy 1.x, which cannot share an
environment with TransformerLens 4.x, so `scripts/setup_legacy_env.sh` builds
`.venv-legacy` and this test runs `tests/legacy` there.
"""

from __future__ import annotations

import pytest

from synthetic import run_suite_in_environment


@pytest.mark.legacy
def test_legacy_hooked_transformer_suite_passes():
    run_suite_in_environment("venv-legacy", "legacy", "setup_legacy_env.sh")
