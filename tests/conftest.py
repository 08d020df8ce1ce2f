"""Shared pytest configuration: markers, and the tiny models and corpora many tests read from disk.

Nothing here downloads anything: models are built from configs with seeded random weights and
saved with a word-level tokenizer (:func:`synthetic.save_tiny_model_with_tokenizer`).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

import pytest
import torch

from synthetic import save_tiny_model_with_tokenizer, write_text_corpus

#: The markers of this suite (the one place they are described).
MARKERS = {
    "slow": "needs the packaged Gemma 3 270M or another real model (minutes; CI runs these too); "
            "deselect with -m 'not slow'",
    "legacy": "runs in the TransformerLens 2.x environment (.venv-legacy)",
    "browser": "renders HTML in headless Chromium (skipped when Chromium is absent)",
}


if not torch.cuda.is_available():
    # Without a GPU, Triton kernels run in Triton's CPU interpreter; it is chosen when a kernel is
    # defined, so before any test imports the kernel module.
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_configure(config: pytest.Config) -> None:
    for name, description in MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {description}")


@pytest.fixture(autouse=True)
def _close_figures():
    """Close every pyplot figure a test opened: pyplot keeps them until closed, and the suite draws hundreds.
    A closed figure still saves and draws, so a test that holds one keeps it."""
    yield
    pyplot = sys.modules.get("matplotlib.pyplot")
    if pyplot is not None:
        pyplot.close("all")


@pytest.fixture(scope="session")
def tiny_model_folder(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., str]:
    """``tiny_model_folder(kind="gpt2" | "gemma3", n_positions=64)``: a tiny random model and its tokenizer,
    saved with ``save_pretrained``; built once per session for each ``(kind, n_positions)``. Read it only."""
    built: dict[tuple[str, int], str] = {}

    def folder(kind: str = "gpt2", n_positions: int = 64) -> str:
        key = (kind, n_positions)
        if key not in built:
            built[key] = save_tiny_model_with_tokenizer(tmp_path_factory.mktemp(f"{kind}-{n_positions}"), kind=kind,
                                                        n_positions=n_positions)
        return built[key]

    return folder


@pytest.fixture(scope="session")
def text_corpus(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., str]:
    """``text_corpus(n_docs=4, words=80)``: a new folder of plain-text documents from the tiny tokenizer's words
    (the same text for the same arguments; a test may add files to its own folder)."""

    def folder(n_docs: int = 4, words: int = 80) -> str:
        return write_text_corpus(tmp_path_factory.mktemp("corpus"), n_docs=n_docs, words=words)

    return folder
