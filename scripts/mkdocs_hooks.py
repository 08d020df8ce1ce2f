"""mkdocs hooks of the documentation site (mkdocs.yml ``hooks:``).

The example notebooks live in ``examples/`` and are shown by the site through the links in
``docs/notebooks/``. Their links to the documentation are written for where the notebooks are
read in the repository (GitHub, Jupyter): ``../docs/methods.md`` from ``examples/``. mkdocs does not
rewrite links inside a rendered notebook, so on the site each such link is pointed here at the
page it names (``../../methods/`` from ``notebooks/quickstart/``), anchors kept.
"""

from __future__ import annotations

import posixpath
import re
from typing import Any

#: A link from a notebook in examples/ to a page of docs/: ``href="../docs/guide/remote.md#anchor"``.
_DOCS_LINK = re.compile(r'href="\.\./docs/([^"#]+)\.md(#[^"]*)?"')


def on_post_page(output: str, page: Any, config: Any) -> str:
    """Point a notebook page's repository links to docs/ at the site's pages (directory URLs, the default)."""
    if not page.file.src_uri.endswith(".ipynb"):
        return output
    page_folder = page.url.rstrip("/") or "."

    def site_link(match: re.Match[str]) -> str:
        target = match.group(1).removesuffix("index").rstrip("/") or "."
        return f'href="{posixpath.relpath(target, page_folder)}/{match.group(2) or ""}"'

    return _DOCS_LINK.sub(site_link, output)
