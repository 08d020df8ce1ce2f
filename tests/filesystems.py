"""Real file systems for the tests of full and read-only disks: a tmpfs mounted for the test's life."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest


def tmpfs(folder: Path, options: str) -> Iterator[Path]:
    """A real tmpfs mounted on ``folder`` with ``options`` (``size=1m``, ``ro,size=64k``), unmounted afterwards;
    the test is skipped, with the reason, where none can be mounted (it needs root and mount(8))."""
    folder.mkdir(exist_ok=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(folder)], capture_output=True,
                             text=True) if shutil.which("mount") else None
    if mounted is None or mounted.returncode != 0:
        pytest.skip("cannot mount a tmpfs here (needs root and mount(8)): "
                    f"{mounted.stderr.strip() if mounted else 'no mount command'}; the injected error covers it")
    try:
        yield folder
    finally:
        subprocess.run(["umount", str(folder)], check=True)
