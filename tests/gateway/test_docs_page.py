"""The docs page (/docs) shares its origin with the dashboard, which keeps an admin key in sessionStorage: it runs
no script and loads nothing from anywhere (it loaded Swagger UI's scripts from a CDN, with no integrity check and no
Content-Security-Policy), yet still lists every operation of the document it links to."""

from __future__ import annotations

import base64
import hashlib
import re
from html.parser import HTMLParser

import httpx

from gateway.routes.openapi import _reference
from tests.conftest import Gateway


class _Page(HTMLParser):
    """The page's tags with their attributes, its inline styles, and its text."""

    def __init__(self) -> None:
        super().__init__()
        self.tags: list[tuple[str, dict[str, str | None]]] = []
        self.styles: list[str] = []
        self.text: list[str] = []
        self._in_style = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append((tag, dict(attrs)))
        self._in_style = tag == "style"

    def handle_endtag(self, tag: str) -> None:
        self._in_style = False

    def handle_data(self, data: str) -> None:
        (self.styles if self._in_style else self.text).append(data)


def _csp(header: str) -> dict[str, list[str]]:
    return {name: values for name, *values in (part.split() for part in header.split(";") if part.strip())}


def test_the_docs_page_runs_no_script_and_loads_nothing(gateway: Gateway) -> None:
    r = httpx.get(f"{gateway.url}/docs", timeout=30)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    page = _Page()
    page.feed(r.text)
    assert not [t for t, _ in page.tags if t in ("script", "iframe", "object", "embed", "link", "img", "form")]
    assert not [a for _, attrs in page.tags for a in attrs if a.startswith("on")]  # no inline event handler
    urls = [v for _, attrs in page.tags for k, v in attrs.items() if k in ("src", "href")]
    assert urls == ["openapi.json"]  # the document, on this origin (from /docs and /docs/ alike)
    csp = _csp(r.headers["content-security-policy"])
    assert csp["default-src"] == ["'none'"] and "script-src" not in csp and csp["frame-ancestors"] == ["'none'"]
    hashes = {f"'sha256-{base64.b64encode(hashlib.sha256(s.encode()).digest()).decode()}'" for s in page.styles}
    assert set(csp["style-src"]) == hashes  # the page's one style, and nothing else
    assert r.headers["x-content-type-options"] == "nosniff"
    document = httpx.get(f"{gateway.url}/openapi.json", timeout=30).json()
    assert httpx.get(f"{gateway.url}/docs/openapi.json", timeout=30).json() == document
    text = " ".join(page.text)
    for path, operations in document["paths"].items():
        for op in operations.values():
            assert path in text and op["summary"] in text


def test_what_the_page_shows_is_text_never_markup() -> None:
    doc = {"info": {"title": "<script>x()</script>", "version": "1"}, "paths": {"/a/{b}": {"get": {
        "responses": {}, "summary": "<img src=x onerror=alert(1)>", "description": "a & b", "tags": ["<b>t</b>"]}}}}
    html = _reference(doc)
    assert "<script" not in html and "<img" not in html and "<b>" not in html
    assert "&lt;img src=x onerror=alert(1)&gt;" in html and "a &amp; b" in html and re.search(r"/a/\{b\}", html)
