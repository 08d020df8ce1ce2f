"""Runs tests/core in the core install's own environment (.venv-core, built by scripts/setup_core_env.sh):
the package's built wheel without any extra, as a researcher who brings their own model installs it."""

from __future__ import annotations

from synthetic import run_suite_in_environment


def test_the_core_install_probes_a_model_and_names_every_missing_extra():
    run_suite_in_environment("venv-core", "core", "setup_core_env.sh", installed=True)
