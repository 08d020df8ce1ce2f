"""The package's table of contents: no framework at import, every public name exported and documented."""

import subprocess
import sys
from pathlib import Path

import equivariance_probe


def test_import_loads_no_framework():
    code = (
        "import sys, equivariance_probe; "
        "print(','.join(m for m in ('transformers', 'transformer_lens', 'nnsight', 'matplotlib', 'circuitsvis', 'scipy') "
        "if m in sys.modules))"
    )
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert loaded == ""


def test_public_api_is_exported_and_listed_in_the_api_reference():
    root = Path(__file__).resolve().parents[1]
    listing = (root / "docs" / "reference" / "api.md").read_text()
    readme = (root / "README.md").read_text()
    assert "docs/reference/api.md" in readme  # the README points to the list
    for name in equivariance_probe.__all__:
        assert hasattr(equivariance_probe, name), name
        if name != "__version__":
            assert f"`{name}`" in listing, f"{name} is not listed in docs/reference/api.md"
            assert f"::: equivariance_probe.{name}\n" in listing, f"{name} has no entry in the API reference"
