"""Shared pytest configuration."""

from __future__ import annotations

import pytest


def pytest_configure(config: pytest.Config) -> None:
    # Also declared in pyproject.toml; registering here keeps `pytest -m "not slow"` warning-free
    # when the tests run from a checkout without the package's configuration.
    config.addinivalue_line("markers", "slow: loads the real Gemma 3 270M (minutes); deselect with -m 'not slow'")
    config.addinivalue_line("markers", "browser: renders HTML in headless Chromium (skipped when Chromium is absent)")
