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


def test_the_version_has_one_source_and_the_changelog_starts_at_it():
    import re
    import tomllib

    root = Path(__file__).resolve().parents[1]
    project = tomllib.loads((root / "pyproject.toml").read_text())
    assert "version" not in project["project"] and project["project"]["dynamic"] == ["version"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "equivariance_probe.__version__"}
    releases = re.findall(r"^## (\d+\.\d+\.\d+)$", (root / "CHANGELOG.md").read_text(), flags=re.M)
    assert releases and releases[0] == equivariance_probe.__version__, releases


def test_every_deprecation_the_package_mentions_is_named_in_the_changelog():
    """Names that were never released are removed, not deprecated: a mention of a deprecation in the package must
    be one the changelog's "Deprecated" section names (by the name the line gives in backticks)."""
    import re

    root = Path(__file__).resolve().parents[1]
    changelog = (root / "CHANGELOG.md").read_text()
    deprecated = changelog.split("### Deprecated", 1)[1].split("\n## ", 1)[0]
    for path in sorted((root / "equivariance_probe").rglob("*.py")):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"DeprecationWarning|deprecat", line):
                named = re.findall(r"``([A-Za-z_][\w.]*)``", line)
                assert any(f"`{name}`" in deprecated for name in named), (
                    f"{path.relative_to(root)}:{number} mentions a deprecation the changelog does not name: {line.strip()}")
