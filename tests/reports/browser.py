"""A rendered HTML page, checked in a real headless Chromium: what a person would see.

:class:`BrowserSession` starts one headless Chromium (Debian's ``chromium``
through ``chromedriver``, driven by Selenium) for any number of pages; its
``check`` opens a local HTML file, waits for it to load, and reads from the live
DOM: that each required element is present and shown, that each expected
table rendered with at least one data row, and that every image decoded
(``naturalWidth > 0``). It saves a screenshot beside the caller's output,
so a person can look at what was checked. Its ``open_traces`` follows a
served page's links to Chrome traces (``*.trace.json.gz``) from inside the
page, as a person's click would fetch them, and says which hold valid trace
JSON (an object with a ``traceEvents`` list).

The browser runs with no network (background services, sync and QUIC off;
this machine reaches only package registries) and a fresh profile folder.
:func:`find_browser` says where Chromium and its driver are, or why the
check cannot run (a :class:`~validation.errors.SetupError` with the fix).
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from validation.errors import SetupError

__all__ = ["Browser", "BrowserSession", "PageCheck", "TraceLink", "find_browser"]

_FLAGS = (
    "--headless=new",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
    "--window-size=1280,900",
)
# One round trip: the facts the checks need, read from the rendered DOM.
_READ_DOM = """
const shown = el => !!el && el.getClientRects().length > 0 && getComputedStyle(el).visibility !== 'hidden';
return {
  ids: Object.fromEntries(arguments[0].map(id => [id, shown(document.getElementById(id))])),
  tables: Object.fromEntries(arguments[1].map(id => {
    const el = document.getElementById(id);
    const table = el && (el.tagName === 'TABLE' ? el : el.querySelector('table'));
    return [id, table && shown(table) ? Array.from(table.rows).filter(row => row.querySelector('td')).length : -1];
  })),
  fold: Object.fromEntries(arguments[2].map(id => {
    const el = document.getElementById(id);
    return [id, shown(el) && el.getBoundingClientRect().bottom <= window.innerHeight];
  })),
  images: Array.from(document.images).map(img => [img.getAttribute('alt') || img.src.slice(0, 80),
                                                   img.complete ? img.naturalWidth : 0]),
};
"""

# Follows every trace link of the page from inside it: fetch, gunzip (DecompressionStream), parse.
_OPEN_TRACES = """
const done = arguments[arguments.length - 1];
const links = Array.from(document.querySelectorAll('a[href$=".trace.json.gz"]'));
Promise.all(links.map(async link => {
  try {
    const response = await fetch(link.href);
    if (!response.ok) return [link.getAttribute('href'), link.textContent, -1, `HTTP ${response.status}`];
    const text = await new Response(response.body.pipeThrough(new DecompressionStream('gzip'))).text();
    const trace = JSON.parse(text);
    const events = trace && Array.isArray(trace.traceEvents) ? trace.traceEvents.length : -1;
    return [link.getAttribute('href'), link.textContent, events, events < 0 ? 'no traceEvents list' : ''];
  } catch (error) {
    return [link.getAttribute('href'), link.textContent, -1, String(error)];
  }
})).then(done);
"""


@dataclass(frozen=True)
class TraceLink:
    """One trace link the page showed, followed: ``events`` is ``len(traceEvents)``, -1 when ``failure`` says why not."""

    href: str
    text: str
    events: int
    failure: str


@dataclass(frozen=True)
class Browser:
    """Paths of the Chromium binary and the matching chromedriver."""

    chromium: Path
    driver: Path


@dataclass(frozen=True)
class PageCheck:
    """What :meth:`BrowserSession.check` saw. ``failures`` is empty when the page rendered as expected."""

    page: Path
    screenshot: Path
    shown_ids: dict[str, bool]
    table_rows: dict[str, int]  # -1: no such table on the page
    images: list[tuple[str, int]]  # (alt or src, naturalWidth)
    failures: list[str] = field(default_factory=list)
    first_screen: dict[str, bool] = field(default_factory=dict)  # id -> wholly inside the first screen

    @property
    def passed(self) -> bool:
        return not self.failures


def find_browser() -> Browser:
    """Chromium and chromedriver on PATH; :class:`SetupError` saying how to install them otherwise."""
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    if chromium is None or driver is None:
        missing = [name for name, path in (("chromium", chromium), ("chromedriver", driver)) if path is None]
        raise SetupError(
            f"no headless browser: {' and '.join(missing)} not found on PATH",
            fix="apt-get install chromium chromium-driver (Debian's packages)",
        )
    try:
        import selenium  # noqa: F401
    except ImportError:
        raise SetupError(
            "the browser check needs selenium, which is not installed", fix="pip install -e '.[test]'"
        ) from None
    return Browser(Path(chromium), Path(driver))


def _failures(
    shown: dict[str, bool], rows: dict[str, int], images: list[tuple[str, int]], fold: dict[str, bool]
) -> list[str]:
    failures = [f"element #{name} expected on the page, not shown" for name, ok in shown.items() if not ok]
    failures += [f"element #{name} expected within the first screen, not there" for name, ok in fold.items() if not ok]
    for name, count in rows.items():
        if count < 0:
            failures.append(f"table #{name} expected, not rendered")
        elif count == 0:
            failures.append(f"table #{name} rendered with no data rows")
    failures += [f"image {name!r} did not load (naturalWidth 0)" for name, width in images if width <= 0]
    return failures


class BrowserSession:
    """One headless Chromium, kept open for several :meth:`check` calls (a start costs about a second).

    Use as a context manager; each check loads its page fresh in the same
    window and profile (local files only, so nothing carries between pages
    but the browser's own start-up).
    """

    def __init__(self, browser: Browser | None = None, *, timeout_s: float = 30.0) -> None:
        self.browser = browser or find_browser()
        self.timeout_s = timeout_s
        self._profile: tempfile.TemporaryDirectory[str] | None = None
        self._driver: Any = None

    def __enter__(self) -> BrowserSession:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service

        options = webdriver.ChromeOptions()
        options.binary_location = str(self.browser.chromium)
        self._profile = tempfile.TemporaryDirectory(prefix="rtv-chromium-")
        for flag in (*_FLAGS, f"--user-data-dir={self._profile.name}"):
            options.add_argument(flag)
        try:
            self._driver = webdriver.Chrome(options=options, service=Service(str(self.browser.driver)))
            self._driver.set_page_load_timeout(self.timeout_s)
        except BaseException:
            self._profile.cleanup()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self._driver.quit()
        finally:
            assert self._profile is not None
            self._profile.cleanup()

    def check(
        self,
        page: Path,
        *,
        required_ids: Sequence[str] = (),
        tables: Sequence[str] = (),
        first_screen: Sequence[str] = (),
        screenshot: Path,
    ) -> PageCheck:
        """Load ``page`` (a local HTML file) and check it; writes ``screenshot`` (PNG).

        ``required_ids``: ids of elements that must be present and shown;
        ``tables``: ids of tables (or of elements holding one) that must render
        with at least one data row; ``first_screen``: ids of elements that must
        lie wholly within the first screen (the window is 1280x900) without
        scrolling. Every ``<img>`` must decode. A page that renders wrongly is
        not an error: read ``failures``.
        """
        self._driver.get(Path(page).resolve().as_uri())
        facts = self._driver.execute_script(_READ_DOM, list(required_ids), list(tables), list(first_screen))
        screenshot.parent.mkdir(parents=True, exist_ok=True)
        self._driver.save_screenshot(str(screenshot))
        images = [(str(name), int(width)) for name, width in facts["images"]]
        shown = {k: bool(v) for k, v in facts["ids"].items()}
        rows = {k: int(v) for k, v in facts["tables"].items()}
        fold = {k: bool(v) for k, v in facts["fold"].items()}
        return PageCheck(Path(page), screenshot, shown, rows, images, _failures(shown, rows, images, fold), fold)

    def open_traces(self, url: str) -> list[TraceLink]:
        """Load ``url`` (served over HTTP: a ``file://`` page may not fetch) and follow each trace link on it.

        Each link ending ``.trace.json.gz`` is fetched by the page itself,
        gunzipped and parsed; a link that does not lead to a Chrome trace is
        not an error: read its ``failure``.
        """
        self._driver.set_script_timeout(self.timeout_s)
        self._driver.get(url)
        return [
            TraceLink(str(href), str(text), int(events), str(failure))
            for href, text, events, failure in self._driver.execute_async_script(_OPEN_TRACES)
        ]
