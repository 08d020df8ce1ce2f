"""The package as a user installs it: .venv-core holds the wheel built from the source distribution
(scripts/setup_core_env.sh), not the source tree, so these tests fail when a file the package needs is left out."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DIST = Path(sys.prefix) / "dist"


def built(pattern: str) -> Path:
    found = sorted(DIST.glob(pattern))
    if len(found) != 1:
        pytest.fail(f"expected one {pattern} in {DIST}, found {[p.name for p in found]}: run scripts/setup_core_env.sh")
    return found[0]


def tracked_package_files() -> set[str]:
    """The package's files under version control: everything the package may read at run time (its modules and
    any data beside them); tests and docs live outside it."""
    listed = subprocess.run(["git", "ls-files", "equivariance_probe"], cwd=ROOT, capture_output=True, text=True)
    if listed.returncode != 0:
        pytest.skip(f"not a git checkout ({listed.stderr.strip()[:200]}): the tracked files cannot be listed")
    return {line for line in listed.stdout.splitlines() if line}


def test_the_package_is_imported_from_the_installed_wheel_not_the_source_tree():
    import equivariance_probe

    where = Path(equivariance_probe.__file__).resolve()
    assert ROOT / "equivariance_probe" not in where.parents, f"imported from the source tree: {where}"
    assert Path(sys.prefix).resolve() in where.parents
    installer = importlib.metadata.distribution("equivariance-probe")
    # An editable install records its source folder in direct_url.json as a "dir_info" with "editable": true.
    direct = installer.read_text("direct_url.json") or ""
    assert '"editable": true' not in direct, direct


def test_every_tracked_package_file_is_in_the_wheel_and_in_the_source_distribution():
    import tarfile

    tracked = tracked_package_files()
    assert tracked and all(not name.startswith("equivariance_probe/tests") for name in tracked)
    with zipfile.ZipFile(built("equivariance_probe-*.whl")) as wheel:
        in_wheel = set(wheel.namelist())
        missing = sorted(tracked - in_wheel)
        assert not missing, f"the wheel leaves out {missing}: declare them as package data in pyproject.toml"
        # A wheel built from an older tree would test that tree: the files must be these.
        stale = sorted(name for name in tracked if wheel.read(name) != (ROOT / name).read_bytes())
    assert not stale, f"the wheel holds other versions of {stale[:5]}: run scripts/setup_core_env.sh again"
    with tarfile.open(built("equivariance_probe-*.tar.gz")) as sdist:
        in_sdist = {name.split("/", 1)[1] for name in sdist.getnames() if "/" in name}
    missing = sorted(tracked - in_sdist)
    assert not missing, f"the source distribution leaves out {missing}"


def test_the_version_has_one_source():
    import equivariance_probe

    assert importlib.metadata.version("equivariance-probe") == equivariance_probe.__version__
    printed = subprocess.run([sys.executable, "-m", "equivariance_probe.cli", "--version"], capture_output=True, text=True)
    assert printed.stdout.split() == ["equivariance-probe", equivariance_probe.__version__], printed.stdout + printed.stderr
