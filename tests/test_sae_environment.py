"""Runs tests/sae in the environment a sparse-autoencoder researcher has (.venv-sae, built by
scripts/setup_sae_env.sh): sae-lens 6, which requires TransformerLens below 4, beside TransformerLens 3.9 and this
package installed with its [transformer-lens] extra. Skipped, with the reason, where the environment could not be
built (scripts/install.sh tolerates that, as for the NDIF one)."""

from __future__ import annotations

from synthetic import run_suite_in_environment


def test_the_probe_runs_beside_sae_lens_on_transformer_lens_3_9():
    run_suite_in_environment("venv-sae", "sae", "setup_sae_env.sh", required_in_ci=False)
