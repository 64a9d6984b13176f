"""The HTML report checked in a real headless Chromium: DOM, tables, images, screenshot.

The report is built from the committed fixture evidence (``tests/fixtures/evidence``);
the browser must show the verdict board within the first screen, every
section and table the page declares, and decode every image; the screenshot
stays beside the page in pytest's temporary folder (its path is printed).
Skips without Chromium unless ``RTV_REQUIRE_BROWSER=1`` (``.ci/run`` sets it
after installing Debian's ``chromium`` and ``chromium-driver``). The
negative controls feed the checker pages with a broken image and a missing
table (a hand-made page, and the real report with both broken): the checker
must report exactly those. The benchmark's trace links are followed from the
served page (real ``torch.profiler`` traces of both traced arms, and a
negative control that is JSON but not a trace).

Slow: a browser and a rendered report cost about 6 s of ``make test``'s 60; CI's
slow tier runs them, with ``RTV_REQUIRE_BROWSER=1``.
"""

from __future__ import annotations

import base64
import functools
import gzip
import json
import os
import re
import struct
import threading
import zlib
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from reports import render_report
from tests.reports.browser import BrowserSession, find_browser
from validation.errors import SetupError
from validation.evidence import make_record, write_once

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def browser():
    """One Chromium for the module's pages (each check loads its own page)."""
    try:
        found = find_browser()
    except SetupError as error:
        if os.environ.get("RTV_REQUIRE_BROWSER") == "1":
            pytest.fail(f"RTV_REQUIRE_BROWSER=1 but {error}")
        pytest.skip(f"no browser: {error.cause}")
    with BrowserSession(found) as session:
        yield session


def _png(width: int, height: int) -> str:
    """A valid grey PNG as a data URI, made here (no fixture file, no plotting library)."""

    def chunk(tag: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + tag + body + struct.pack(">I", zlib.crc32(tag + body))

    rows = b"".join(b"\x00" + b"\x80" * width for _ in range(height))
    data = (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0))
        + chunk(b"IDAT", zlib.compress(rows))
        + chunk(b"IEND", b"")
    )
    return "data:image/png;base64," + base64.b64encode(data).decode()


def _page(folder: Path, *, broken_image: bool, drop_table: bool) -> Path:
    second = "" if drop_table else '<table id="t2"><tr><th>a</th></tr><tr><td>2</td></tr></table>'
    image = "missing-plot.png" if broken_image else _png(7, 5)
    page = folder / "page.html"
    page.write_text(
        f'<html><body><section id="board"><table id="t1"><tr><th>a</th></tr><tr><td>1</td></tr></table>'
        f'</section>{second}<img alt="plot" src="{image}"></body></html>'
    )
    return page


def test_a_complete_page_passes_and_leaves_a_screenshot(browser, tmp_path):
    page = _page(tmp_path, broken_image=False, drop_table=False)
    seen = browser.check(page, required_ids=["board"], tables=["t1", "t2"], screenshot=tmp_path / "shot.png")
    assert seen.failures == []
    assert seen.images == [("plot", 7)]
    assert seen.table_rows == {"t1": 1, "t2": 1}
    assert (tmp_path / "shot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_negative_control_broken_image_and_missing_table_fail(browser, tmp_path):
    page = _page(tmp_path, broken_image=True, drop_table=True)
    seen = browser.check(
        page, required_ids=["board", "verdict-board"], tables=["t1", "t2"], screenshot=tmp_path / "shot.png"
    )
    assert not seen.passed
    assert "table #t2 expected, not rendered" in seen.failures
    assert "image 'plot' did not load (naturalWidth 0)" in seen.failures
    assert "element #verdict-board expected on the page, not shown" in seen.failures
    assert len(seen.failures) == 3


FIXTURE_EVIDENCE = Path(__file__).parents[1] / "fixtures" / "evidence"


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The HTML report of the committed fixture evidence (one real quick ``rtv run`` and ``rtv bench``).

    The benchmark record is rewritten to link real ``torch.profiler`` traces
    of both traced arms and one non-trace (the negative control: JSON, no
    ``traceEvents``), beside the report as ``rtv bench`` keeps them.
    """
    folder = tmp_path_factory.mktemp("report")
    (folder / "traces").mkdir()
    for path in FIXTURE_EVIDENCE.glob("*.json"):
        if path.name != "benchmark.json":
            (folder / "run").mkdir(exist_ok=True)
            (folder / "run" / path.name).write_bytes(path.read_bytes())
    record = json.loads((FIXTURE_EVIDENCE / "benchmark.json").read_text())
    traces = {
        arm: _real_trace(folder / "traces" / f"small-{arm.replace('@', '-')}.trace.json.gz")
        for arm in ("plain", "retain@s0")
    }
    not_a_trace = folder / "traces" / "small-replay-s0.trace.json.gz"
    not_a_trace.write_bytes(gzip.compress(b'{"events": []}'))
    record["measurements"]["groups"][0]["traces"] = {**traces, "replay@s0": str(not_a_trace)}
    write_once(
        folder / "run" / "benchmark.json",
        make_record(
            record["kind"], config=record["config"], checks=record["checks"], measurements=record["measurements"]
        ),
    )
    return render_report(folder / "run", folder / "report" / "index.md", title="fixture run").html


def _real_trace(path: Path) -> str:
    """A real ``torch.profiler`` Chrome trace of a tiny matmul, gzipped as ``rtv bench`` keeps them."""
    import torch
    from torch.profiler import profile

    with profile() as session:
        torch.ones(4, 4) @ torch.ones(4, 4)
    session.export_chrome_trace(str(path.with_suffix("")))
    path.write_bytes(gzip.compress(path.with_suffix("").read_bytes()))
    return str(path)


@pytest.fixture(scope="module")
def served(report: Path) -> str:
    """The report's URL, its folder served over HTTP on loopback (a ``file://`` page may not fetch its links)."""
    handler = functools.partial(_QuietHandler, directory=str(report.parents[1]))
    with ThreadingHTTPServer(("127.0.0.1", 0), handler) as server:
        threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        yield f"http://127.0.0.1:{server.server_address[1]}/report/{report.name}"
        server.shutdown()


class _QuietHandler(SimpleHTTPRequestHandler):
    def log_message(self, *args: object) -> None:  # keep pytest's output to the test's own
        pass


def _ids(html: str) -> tuple[list[str], list[str]]:
    """Every section id and every table id the page declares (what the browser must show)."""
    return re.findall(r'<section id="([^"]+)"', html), re.findall(r'<table id="([^"]+)"', html)


def test_the_report_renders_in_a_browser_board_first_every_table_and_image(browser, report: Path) -> None:
    sections, tables = _ids(report.read_text())
    kinds = {json.loads(p.read_text())["kind"] for p in FIXTURE_EVIDENCE.glob("*.json")}
    assert "verdict-board" in sections and "verdict-board-table" in tables and len(sections) >= 2 + len(kinds)
    seen = browser.check(
        report,
        required_ids=sections,
        tables=tables,
        first_screen=["verdict-board-table"],
        screenshot=report.with_name("report.png"),
    )
    print(f"screenshot of the checked report: {seen.screenshot}")
    assert seen.failures == []
    assert seen.table_rows["verdict-board-table"] == len(kinds), "one board row per record"
    assert len(seen.images) == report.read_text().count("<img ") >= 4 and all(w > 0 for _, w in seen.images)


def test_negative_control_the_report_with_a_broken_image_and_a_missing_table_fails(
    browser, report: Path, tmp_path: Path
) -> None:
    html = report.read_text()
    sections, tables = _ids(html)
    dropped = tables[-1]
    start = html.index(f'<table id="{dropped}"')
    broken = html[:start] + html[html.index("</table>", start) + len("</table>") :]
    broken = re.sub(r'<img src="data:image/png;base64,[^"]+"', '<img src="plots/missing.png"', broken, count=1)
    page = tmp_path / "broken.html"
    page.write_text(broken)
    seen = browser.check(
        page,
        required_ids=sections,
        tables=tables,
        first_screen=["verdict-board-table"],
        screenshot=tmp_path / "broken.png",
    )
    assert sorted(seen.failures) == sorted(
        [f"table #{dropped} expected, not rendered", f"image {seen.images[0][0]!r} did not load (naturalWidth 0)"]
    )


def test_the_reports_trace_links_open_as_chrome_traces_of_both_arms(browser, served: str) -> None:
    links = {Path(link.href).name: link for link in browser.open_traces(served)}
    assert sorted(links) == [
        "small-plain.trace.json.gz",
        "small-replay-s0.trace.json.gz",
        "small-retain-s0.trace.json.gz",
    ]
    for name in ("small-plain.trace.json.gz", "small-retain-s0.trace.json.gz"):
        assert links[name].failure == "" and links[name].events > 0, links[name]
        assert "torch.profiler trace of" in links[name].text
    assert links["small-replay-s0.trace.json.gz"].failure == "no traceEvents list", "negative control"
