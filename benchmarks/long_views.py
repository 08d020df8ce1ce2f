"""Views of long windows: page size and the time until headless Chromium has drawn them.

    python benchmarks/long_views.py [--lengths 1024,4096,8192] [--full 1024] [--timeout 120] [--out long_views_out]

A tiny random GPT-2 built from a config with 8,192 positions (2 layers of 4 heads, eager attention) reads the
packaged corpus' articles, one after the other, tokenised by the packaged Gemma 3 tokenizer (so the tokens
are real text). For each length ``T`` it writes ``head_views(..., overview=True)`` of 4 heads (as many as a
report's views by default): the
overview of positions ``0..T-1`` (256 blocks per side) above the CircuitsVis views of the last 128
positions, in one offline page; and, for ``--full``, the plain CircuitsVis views of every position (the way
to see a long window before the overview), for comparison.

Each page is opened in a fresh headless Chromium (no host name resolves) driven through the DevTools
protocol: the clock starts when the page is asked for and stops when the overview's canvases are drawn
(the overview marks its element ``data-drawn``) and when CircuitsVis has drawn every detail figure (its
"Head Selector" headings), polled every 50 ms; a page not drawn after ``--timeout`` seconds is reported
as such. Prints a Markdown table and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

import torch

from equivariance_probe import EquivarianceProbe, head_views, load_corpus
from equivariance_probe.sources.models import load_tokenizer

HEADS = [(0, 0), (0, 1), (1, 0), (1, 1)]
DETAIL = 128
#: Seconds between two looks at the page (looking more often starves the page of idle time)
POLL_S = 0.25
#: Drawn figures: CircuitsVis' AttentionHeads heading, and the overview's mark.
DRAWN = """(() => {
  const overview = document.querySelector('.block-overview[data-drawn]');
  const figures = Array.from(document.querySelectorAll('h3')).filter(e => e.textContent.startsWith('Head Selector')).length;
  return JSON.stringify({overview: overview ? Number(overview.getAttribute('data-drawn')) : null, figures: figures,
                         expected: document.querySelectorAll('.circuitsvis-view').length});
})()"""


def tiny_model(n_positions: int, vocab_size: int) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_head=4, n_embd=64, n_positions=n_positions, vocab_size=vocab_size,
                        attn_implementation="eager")
    return GPT2LMHeadModel(config).eval()


def document_ids(tokenizer, n_tokens: int) -> list[int]:
    ids: list[int] = []
    for text in load_corpus(n_docs=None, min_chars=1):
        ids += tokenizer(text)["input_ids"]
        if len(ids) >= n_tokens:
            return ids[:n_tokens]
    raise SystemExit(f"the packaged corpus holds fewer than {n_tokens} tokens")


class Browser:
    """A fresh headless Chromium with its DevTools port, one page, offline."""

    def __init__(self, chromium: str, profile: Path) -> None:
        import websocket  # websocket-client

        self.process = subprocess.Popen(
            [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-extensions",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             f"--user-data-dir={profile}", "--host-resolver-rules=MAP * ~NOTFOUND", "--remote-debugging-port=0",
             "--window-size=1400,1000", "about:blank"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        port = None
        while port is None:
            line = self.process.stderr.readline()
            if not line:
                raise RuntimeError("Chromium ended before opening its DevTools port")
            if "DevTools listening on ws://" in line:
                port = int(line.split("ws://", 1)[1].split("/", 1)[0].rsplit(":", 1)[1])
        targets = json.load(urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list"))
        page = next(t for t in targets if t["type"] == "page")
        self.socket = websocket.create_connection(page["webSocketDebuggerUrl"], timeout=600, suppress_origin=True)
        self.next_id = 0

    def call(self, method: str, **params) -> dict:
        self.next_id += 1
        self.socket.send(json.dumps({"id": self.next_id, "method": method, "params": params}))
        while True:
            message = json.loads(self.socket.recv())
            if message.get("id") == self.next_id:
                return message.get("result", {})

    def close(self) -> None:
        self.socket.close()
        self.process.kill()
        self.process.wait()


def draw_times(chromium: str, page: Path, timeout: float) -> dict:
    """Seconds from asking for the page until the overview and every CircuitsVis figure are drawn."""
    import websocket

    with tempfile.TemporaryDirectory() as profile:
        browser = Browser(chromium, Path(profile))
        try:
            start = time.perf_counter()
            browser.call("Page.navigate", url=page.as_uri())
            times = {"overview_s": None, "detail_s": None, "overview_in_page_ms": None}
            while time.perf_counter() - start < timeout:
                # A page that keeps Chromium's main thread busy answers late: wait no longer than the timeout.
                browser.socket.settimeout(max(1.0, timeout - (time.perf_counter() - start)))
                try:
                    answer = browser.call("Runtime.evaluate", expression=DRAWN, returnByValue=True)
                except websocket.WebSocketTimeoutException:
                    break
                state = json.loads(answer.get("result", {}).get("value") or "{}")
                now = round(time.perf_counter() - start, 2)
                if state.get("overview") is not None and times["overview_s"] is None:
                    times["overview_s"], times["overview_in_page_ms"] = now, state["overview"]
                if state.get("expected") and state["figures"] >= state["expected"]:
                    times["detail_s"] = now
                    break
                time.sleep(POLL_S)
            times["timed_out"] = times["detail_s"] is None
            return times
        finally:
            browser.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="1024,4096,8192")
    parser.add_argument("--full", default="1024", help="lengths also written as plain CircuitsVis views of every position")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for a page to draw")
    parser.add_argument("--out", default="long_views_out")
    args = parser.parse_args()
    chromium = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    if chromium is None:
        raise SystemExit("Chromium is not installed (apt-get install chromium)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    lengths = [int(n) for n in args.lengths.split(",")]
    full = [int(n) for n in args.full.split(",") if n]

    tokenizer = load_tokenizer()
    probe = EquivarianceProbe(tiny_model(max(lengths + full), len(tokenizer)), tokenizer=tokenizer)
    ids = document_ids(tokenizer, max(lengths + full))
    rows = []
    for kind, n in [("overview", n) for n in lengths] + [("full", n) for n in full]:
        start = time.perf_counter()
        if kind == "overview":
            views = head_views(probe, ids[:n], heads=HEADS, overview=True, start=n - DETAIL, stop=n)
        else:
            views = head_views(probe, ids[:n], heads=HEADS, start=0, stop=n)
        page = views.save(out / f"{kind}_{n}.html")
        built = time.perf_counter() - start
        row = {"view": kind, "positions": n, "build_s": round(built, 1), "page_mb": round(page.stat().st_size / 1e6, 2),
               "overview_mb": None if views.overview is None else round(len(views.overview.body_html().encode()) / 1e6, 2),
               **draw_times(chromium, page, args.timeout)}
        print(row, flush=True)
        rows.append(row)

    print("\n| view | positions | built in | page | of which the overview | overview drawn | CircuitsVis figures drawn |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        what = ("overview (256 blocks per side) + CircuitsVis of the last 128 positions" if row["view"] == "overview"
                else "CircuitsVis of every position (no overview)")
        overview = "—" if row["overview_mb"] is None else f"{row['overview_mb']:.2f} MB"
        drawn = "—" if row["overview_s"] is None else f"{row['overview_s']:.1f} s"
        detail = f"not within {args.timeout:.0f} s" if row["timed_out"] else f"{row['detail_s']:.1f} s"
        print(f"| {what} | {row['positions']:,} | {row['build_s']:.1f} s | {row['page_mb']:.2f} MB | {overview} | {drawn} "
              f"| {detail} |")
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
