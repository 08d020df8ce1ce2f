"""The report, opened offline in headless Chromium, draws its CircuitsVis views.

Chromium runs with every host name unresolvable (``--host-resolver-rules``), so a page that
needed the network would not draw. ``scripts/install.sh`` installs Debian's ``chromium`` where
apt-get exists; elsewhere these tests are skipped with the reason.
"""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest
import torch

from equivariance_probe import EquivarianceProbe, head_views, render_report

from synthetic import SyntheticAdapter
from test_heads import POSITIONAL, PREVIOUS_TOKEN, built_heads

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(CHROMIUM is None, reason="Chromium is not installed (apt-get install chromium; scripts/install.sh does it)"),
]
#: Rendered by CircuitsVis' AttentionHeads component (the bundle's own text has no closing tag after it).
RENDERED = "Head Selector (hover to view, click to lock)</h3>"


def chromium(page, profile, *extra: str) -> subprocess.CompletedProcess:
    command = [
        CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update", "--disable-sync", "--no-first-run", f"--user-data-dir={profile}",
        "--host-resolver-rules=MAP * ~NOTFOUND",  # offline: no host name resolves
        "--virtual-time-budget=15000", *extra, page.as_uri(),
    ]
    return subprocess.run(command, capture_output=True, text=True, timeout=180)


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    folder = tmp_path_factory.mktemp("browser")
    adapter = SyntheticAdapter(built_heads, n_layers=2, n_heads=4, max_context=64)
    probe = EquivarianceProbe(adapter)
    tokens = torch.randint(0, 1000, (4, 32), generator=torch.Generator().manual_seed(0))
    result = probe.run(tokens, keep_pattern=True, progress=False)
    views = head_views(probe, tokens[0], heads=[POSITIONAL, PREVIOUS_TOKEN], result=result)
    path = folder / "report.html"
    render_report(result, views=views).save(path)
    return folder, path


def test_report_has_no_external_resources(report):
    _, path = report
    page = path.read_text()
    assert not re.search(r"""<(script|link|img|iframe)[^>]*(src|href)\s*=\s*["']?(https?:)?//""", page, re.I)
    assert "unpkg.com" not in page and not re.search(r"""from\s*["']https?://""", page)


def test_report_draws_every_view_offline(report, tmp_path):
    folder, path = report
    dom = chromium(path, tmp_path / "profile", "--dump-dom").stdout
    # one view = attention+prior and log-ratio: two AttentionHeads elements, each with a canvas per head
    assert dom.count(RENDERED) == 2, "the CircuitsVis views did not draw"
    assert len(re.findall(r"<canvas", dom)) >= 2 + 1 + 2
    assert "L0H0 attention" in dom and "uniform prior (full causal)" in dom and "L0H1 log(a/u)" in dom
    screenshot = folder / "report.png"
    chromium(path, tmp_path / "profile2", "--window-size=1200,3000", f"--screenshot={screenshot}")
    assert screenshot.stat().st_size > 10_000


def test_the_shift_report_reads_on_a_page_of_its_own_width(tmp_path):
    """Opened at 1200 pixels, nothing widens the page past it: tables fit, long ones fold, and a figure wider than
    the page scrolls inside its own box at its own size (the attribution of many components), so its labels keep
    the size they were drawn at."""
    from test_shift import design, run

    from equivariance_probe import random_init_like
    from equivariance_probe.display.shift import render_shift_report
    from synthetic import tiny_gemma3

    model = tiny_gemma3().to(torch.float64)
    segments, contexts = design()
    options = {"attribution": True, "attribution_heads": [0, 1, 2], "patch": True}
    trained = run(model, segments, contexts, **options)
    baseline = run(random_init_like(model, seed=1), segments, contexts, **options)
    # Three variants side by side: the attribution figure is about 1,450 pixels wide, wider than the page.
    page = str(render_shift_report(trained, {"random_init": baseline, "random_init again": baseline}))  # Markup
    measured = str.replace(page, "</body>", "<script>document.body.insertAdjacentHTML('beforeend', '<p id=\"width\">' + "
                                       "document.documentElement.scrollWidth + ' ' + Math.max(...Array.from("
                                       "document.images, image => image.naturalWidth - image.width)) + "
                                       "'</p>')</script></body>")
    path = tmp_path / "shift_report.html"
    path.write_text(measured, encoding="utf-8")
    dom = chromium(path, tmp_path / "profile", "--window-size=1200,3000", "--dump-dom").stdout
    found = re.search(r'<p id="width">(\d+) (-?\d+)</p>', dom)
    assert found, dom[-2000:]
    width, shrunk = map(int, found.groups())
    assert width <= 1200 and shrunk == 0, (width, shrunk)  # no image drawn smaller than its pixels
    assert "figure img{max-width:none}" in page and "overflow-x:auto" in page
    assert dom.count("<details>") >= 2 and "<pre>" not in dom
    screenshot = tmp_path / "shift_report.png"
    chromium(path, tmp_path / "profile2", "--window-size=1200,4000", f"--screenshot={screenshot}")
    assert screenshot.stat().st_size > 10_000
