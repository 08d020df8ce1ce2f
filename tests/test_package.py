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


def test_public_api_is_exported_and_listed_in_the_readme():
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    for name in equivariance_probe.__all__:
        assert hasattr(equivariance_probe, name), name
        if name != "__version__":
            assert f"`{name}`" in readme, f"{name} is not listed in the README"
