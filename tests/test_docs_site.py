"""The documentation site builds from the repository with warnings as errors, and every reference resolves.

``mkdocs build --strict`` fails on a broken link or anchor between pages, a page missing from
the navigation, or a docstring that griffe cannot read; the API page documents every public
name; the code's and README's pointers into ``docs/methods.md`` name anchors that exist.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

import equivariance_probe

ROOT = Path(__file__).resolve().parent.parent
METHODS = ROOT / "docs" / "methods.md"


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    pytest.importorskip("mkdocs", reason="the site needs the docs extra: pip install -e '.[docs]'")
    pytest.importorskip("mkdocstrings_handlers.python", reason="the site needs the docs extra: pip install -e '.[docs]'")
    out = tmp_path_factory.mktemp("site")
    built = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)], cwd=ROOT,
                           capture_output=True, text=True, timeout=600, env={**__import__("os").environ,
                                                                             "NO_MKDOCS_2_WARNING": "1"})
    assert built.returncode == 0, f"mkdocs build --strict failed:\n{built.stdout[-3000:]}\n{built.stderr[-6000:]}"
    return out


def test_the_site_builds_strictly_with_every_page(site):
    pages = {p.relative_to(site).as_posix() for p in site.rglob("index.html")}
    for page in ("index.html", "getting-started/index.html", "methods/index.html", "guide/studies/index.html",
                 "guide/heads/index.html", "guide/remote/index.html", "guide/cost/index.html",
                 "notebooks/quickstart/index.html", "notebooks/heads/index.html", "notebooks/compare/index.html",
                 "notebooks/remote/index.html", "reference/api/index.html"):
        assert page in pages, page


def test_the_api_reference_documents_every_public_name(site):
    page = (site / "reference" / "api" / "index.html").read_text(encoding="utf-8")
    for name in equivariance_probe.__all__:
        if name != "__version__":
            assert f'id="equivariance_probe.{name}"' in page, f"{name} is not documented in the API reference"


#: What a page loads as it opens: a stylesheet, a script, an image, a frame or a web font.
LOADED = re.compile(r"<(?:link|script|img|iframe)\b[^>]*\b(?:href|src)=\"(https?:)?//[^\"]+\"[^>]*>|"
                    r"@import\s+url\(\s*[\"']?(?:https?:)?//|fonts\.(?:googleapis|gstatic)\.com")


def test_every_page_works_offline(site):
    """No page loads anything from the internet as it opens (material's default fetches its fonts from
    Google Fonts; mkdocs.yml turns that off): links to other sites are fine, loads are not."""
    pages = list(site.rglob("*.html")) + list(site.rglob("*.css"))
    assert len(pages) > 20
    loads = {page.relative_to(site).as_posix(): match.group(0)[:160] for page in pages
             for match in LOADED.finditer(page.read_text(encoding="utf-8", errors="replace"))}
    assert not loads, loads
    assert 'href="https://squidfunk.github.io/mkdocs-material/"' in (site / "index.html").read_text(encoding="utf-8")


def test_the_executed_notebooks_are_pages_with_their_outputs(site):
    page = (site / "notebooks" / "heads" / "index.html").read_text(encoding="utf-8")
    assert "circuitsvis-view" in page and "head-ranking" in page


def test_the_notebooks_links_resolve_in_the_repository_and_on_the_site(site):
    """A notebook's links are written for the repository (``../docs/methods.md`` from ``examples/``,
    where GitHub and Jupyter show it); on the site a hook points them at its pages."""
    import json

    for notebook in sorted((ROOT / "examples").glob("*.ipynb")):
        text = "".join("".join(cell["source"]) for cell in json.loads(notebook.read_text())["cells"]
                       if cell["cell_type"] == "markdown")
        for target in re.findall(r"\]\(((?!https?:|#)[^)#]+)(?:#[^)]*)?\)", text):
            assert (notebook.parent / target).exists(), f"{notebook.name} links to {target}, not in the repository"
        page = site / "notebooks" / notebook.stem / "index.html"
        for target in re.findall(r'href="((?!https?:|#|mailto:|data:)[^"#]+)', page.read_text(encoding="utf-8")):
            assert (page.parent / target).resolve().exists(), f"the site's {notebook.stem} page links to {target}"


def anchors(markdown: str) -> set[str]:
    """The ids of a page's headings: explicit ``{#id}`` attributes."""
    return set(re.findall(r"\{#([\w-]+)\}", markdown))


def test_every_pointer_into_the_methods_names_an_anchor_that_exists():
    known = anchors(METHODS.read_text())
    sources = [*ROOT.joinpath("equivariance_probe").rglob("*.py"), *ROOT.joinpath("tests").glob("*.py"),
               ROOT / "README.md", *ROOT.joinpath("docs").rglob("*.md")]
    cited = {(path.name, anchor) for path in sources
             for anchor in re.findall(r"methods\.md#([\w-]+)", path.read_text(encoding="utf-8"))}
    assert len(cited) >= 10
    assert not [c for c in cited if c[1] not in known], "pointers to anchors docs/methods.md lacks"
    assert not re.search(r"METHODS\.md", "".join(p.read_text(encoding="utf-8") for p in sources if p != Path(__file__)))


def section_numbers(markdown: str) -> dict[str, int]:
    """The number of the section each ``{#id}`` of the methods lies in: a numbered ``## N. Title {#id}`` heading's own,
    and that of the numbered heading above it for a subsection's."""
    numbers, current = {}, None
    for line in markdown.splitlines():
        numbered = re.match(r"## (\d+)\. ", line)
        if line.startswith("## "):
            current = int(numbered.group(1)) if numbered else None
        for anchor in re.findall(r"\{#([\w-]+)\}", line):
            if current is not None:
                numbers[anchor] = current
    return numbers


#: A link whose text quotes a section of the methods, e.g. ``[Methods, section 9](../methods.md#probe)``.
_QUOTED_SECTION = re.compile(r"\[([^\]]*?(?:section|§)\s*(\d+)[^\]]*)\]\([^)]*methods\.md#([\w-]+)\)", re.IGNORECASE)


def quoted_sections(text: str) -> list[tuple[str, int, str]]:
    """``(link text, quoted number, anchor)`` of every link into the methods whose text quotes a section number."""
    return [(words, int(number), anchor) for words, number, anchor in _QUOTED_SECTION.findall(text)]


def test_a_section_number_quoted_in_a_link_is_that_of_its_anchor():
    numbers = section_numbers(METHODS.read_text())
    assert numbers["probe"] == 9 and numbers["shift-sink-mass"] == 7 and numbers["intervals"] == 6
    sources = [ROOT / "README.md", *ROOT.joinpath("docs").rglob("*.md"), *ROOT.joinpath("equivariance_probe").rglob("*.py")]
    quoted = [(path.name, *link) for path in sources for link in quoted_sections(path.read_text(encoding="utf-8"))]
    assert quoted, "no link quotes a section of the methods: the check has nothing to read"
    wrong = [f"{where}: [{words}] points at #{anchor}, in section {numbers.get(anchor)}"
             for where, words, number, anchor in quoted if numbers.get(anchor) != number]
    assert not wrong, wrong


def test_a_quoted_section_that_differs_from_its_anchor_is_caught():
    numbers = section_numbers(METHODS.read_text())
    (words, number, anchor), = quoted_sections("as in [Methods, section 8](../methods.md#probe), where")
    assert (number, anchor) == (8, "probe") and numbers[anchor] != number


def test_the_readme_is_a_first_page_whose_links_resolve():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    for target in re.findall(r"\]\(((?!https?:)[^)#]+)(?:#[^)]*)?\)", readme):
        assert (ROOT / target).exists(), f"the README links to {target}, which does not exist"
