"""The HTML report checked in a real headless Chromium (issue 17): DOM, tables, images, screenshot.

Skips without Chromium unless ``RTV_REQUIRE_BROWSER=1`` (``.ci/run`` sets it
after installing Debian's ``chromium`` and ``chromium-driver``). The
negative control feeds the checker a page with a broken image and a
missing table: the checker must report both.
"""

from __future__ import annotations

import base64
import os
import struct
import zlib
from pathlib import Path

import pytest

from tests.reports.browser import check_page, find_browser
from validation.errors import SetupError


@pytest.fixture(scope="module")
def browser():
    try:
        return find_browser()
    except SetupError as error:
        if os.environ.get("RTV_REQUIRE_BROWSER") == "1":
            pytest.fail(f"RTV_REQUIRE_BROWSER=1 but {error}")
        pytest.skip(f"no browser: {error.cause}")


def _png(width: int, height: int) -> str:
    """A valid grey PNG as a data URI, made here (no fixture file, no plotting library)."""
    def chunk(tag: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + tag + body + struct.pack(">I", zlib.crc32(tag + body))

    rows = b"".join(b"\x00" + b"\x80" * width for _ in range(height))
    data = (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b""))
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
    seen = check_page(page, required_ids=["board"], tables=["t1", "t2"], screenshot=tmp_path / "shot.png",
                      browser=browser)
    assert seen.failures == []
    assert seen.images == [("plot", 7)]
    assert seen.table_rows == {"t1": 1, "t2": 1}
    assert (tmp_path / "shot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_negative_control_broken_image_and_missing_table_fail(browser, tmp_path):
    page = _page(tmp_path, broken_image=True, drop_table=True)
    seen = check_page(page, required_ids=["board", "verdict-board"], tables=["t1", "t2"],
                      screenshot=tmp_path / "shot.png", browser=browser)
    assert not seen.passed
    assert "table #t2 expected, not rendered" in seen.failures
    assert "image 'plot' did not load (naturalWidth 0)" in seen.failures
    assert "element #verdict-board expected on the page, not shown" in seen.failures
    assert len(seen.failures) == 3
