"""GET /dashboard: the built-in page for finance and on-call, served by the gateway itself.

The page is a static shell (HTML, CSS, a small script drawing SVG charts): it holds no data. It asks for
an admin key, keeps it in the browser tab's sessionStorage, and reads everything through the admin API
with that key, so what it shows is exactly what the admin key may see.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from litestar import Response, get

PAGE = Path(__file__).resolve().parent.parent / "dashboard" / "index.html"


@lru_cache(maxsize=1)
def _page() -> bytes:
    return PAGE.read_bytes()


@get("/dashboard", tags=["operations"], media_type="text/html")
async def dashboard() -> Response[bytes]:
    return Response(_page(), media_type="text/html; charset=utf-8",
                    headers={"cache-control": "no-store", "x-frame-options": "DENY",
                             "content-security-policy": "default-src 'self'; script-src 'self' 'unsafe-inline'; "
                                                        "style-src 'unsafe-inline'; img-src 'self' data:"})
