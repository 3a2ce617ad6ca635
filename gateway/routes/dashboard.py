"""GET /dashboard: the built-in page for finance and on-call, served by the gateway itself.

The page is a static shell (HTML, CSS, a small script drawing SVG charts): it holds no data. It asks for
an admin key, keeps it in the browser tab's sessionStorage, and reads everything through the admin API
with that key, so what it shows is exactly what the admin key may see.

It shows strings that tenants and upstreams choose (a tenant's name in a held guard's reason, a replica's error) and
writes every one as text. Its Content-Security-Policy is the second line: the page's one script and one style run
by their hashes, nothing else runs or loads (no inline handler, no style attribute, no other origin), so markup that
got into the page all the same could run nothing (`'unsafe-inline'` let an `onerror` run).
"""

from __future__ import annotations

import base64
import hashlib
import re
from functools import lru_cache
from pathlib import Path

from litestar import Response, get

PAGE = Path(__file__).resolve().parent.parent / "dashboard" / "index.html"


def _hashes(page: str, tag: str) -> str:
    """The CSP source of each inline `<tag>` element's text: 'sha256-…'."""
    texts = re.findall(rf"<{tag}>(.*?)</{tag}>", page, flags=re.DOTALL)
    return " ".join(f"'sha256-{base64.b64encode(hashlib.sha256(t.encode()).digest()).decode()}'" for t in texts)


@lru_cache(maxsize=1)
def _page() -> tuple[bytes, dict[str, str]]:
    page = PAGE.read_text()
    csp = (f"default-src 'none'; script-src {_hashes(page, 'script')}; style-src {_hashes(page, 'style')}; "
           "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
    return page.encode(), {"cache-control": "no-store", "content-security-policy": csp,
                           "x-content-type-options": "nosniff", "x-frame-options": "DENY",
                           "referrer-policy": "no-referrer"}


@get("/dashboard", tags=["operations"], media_type="text/html")
async def dashboard() -> Response[bytes]:
    body, headers = _page()
    return Response(body, media_type="text/html; charset=utf-8", headers=headers)
