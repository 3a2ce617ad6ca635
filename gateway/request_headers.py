"""A model request's headers as the pipeline reads them (`RequestContext.headers`): one value a name.

A name sent more than once was read two ways: the pipeline's dict kept its last value, Litestar's `headers.get` (which
the key's check uses) its first. So `Idempotency-Key: a` then `Idempotency-Key: b` keyed the request on `b` silently,
and `Cache-Control: no-store` followed by a second Cache-Control line was lost: the answer was stored. A header that
takes one value and is sent more than once is refused by name (400 `duplicate_header`, before anything is spent);
Cache-Control, whose directives HTTP lets a client split across lines (RFC 9110 section 5.3), is joined with commas.
Other repeated names keep their last value: nothing of ours reads them. Cache-Control, joined, is then read here:
a directive the cache does not honour (cache/request_key.py `parse_cache_control`: all but `no-cache`, `no-store`,
`max-age=0`) is refused by name (400 `invalid_header`) before the tenant's gate, the body, the quota or a tier;
it was dropped, and `max-age=0` or a misspelt `no-cahce` got a stored answer. What it honours is read once, here:
the headers handed on (`ReadHeaders`) carry the directives to the cache's lookup and store, which read them, not the
header again. An Idempotency-Key that cannot be one (`check_idempotency_key`) is refused here too, before the body is
read; it was refused only once the body had been parsed.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

from cache.request_key import CacheControlRefused, ReadHeaders, parse_cache_control
from gateway.errors import InvalidRequest

# the headers a model route reads that take one value (the key, Idempotency-Key, the data version, the session)
SINGLE = ("authorization", "x-api-key", "idempotency-key", "x-tiergate-data-version", "x-tiergate-session")
JOINED = ("cache-control",)  # a list of directives, which a client may send on several lines
MAX_IDEMPOTENCY_KEY_CHARS = 255


def request_headers(request: Any) -> ReadHeaders:
    """The request's headers by lower-case name, with Cache-Control's honoured directives (`ReadHeaders`, which the
    cache reads instead of the header); a 400 if one of SINGLE was sent more than once, or Cache-Control has a
    directive the cache does not honour, or an Idempotency-Key is not one."""
    headers = {k.lower(): v for k, v in request.headers.items()}
    raw = request.scope["headers"]
    if len(headers) != len(raw):  # a name sent twice (rare): one pass more over the head
        _repeated(raw, headers)
    if (key := headers.get("idempotency-key")) is not None:
        check_idempotency_key(key)
    try:
        directives = parse_cache_control(value) if (value := headers.get("cache-control")) else frozenset()
    except CacheControlRefused as exc:
        raise InvalidRequest(str(exc), param="cache-control", code="invalid_header") from None
    return ReadHeaders(headers, directives)  # the directives read here are the cache's: not parsed again


def check_idempotency_key(key: str) -> None:
    """A 400 for an Idempotency-Key that is not 1 to MAX_IDEMPOTENCY_KEY_CHARS printable ASCII characters."""
    if not 1 <= len(key) <= MAX_IDEMPOTENCY_KEY_CHARS or not key.isascii() or not key.isprintable():
        raise InvalidRequest(f"Idempotency-Key must be 1 to {MAX_IDEMPOTENCY_KEY_CHARS} printable ASCII characters",
                             param="Idempotency-Key", code="invalid_idempotency_key")


def _repeated(raw: Sequence[tuple[bytes, bytes]], headers: dict[str, str]) -> None:
    counts = Counter(name.decode("latin-1").lower() for name, _ in raw)
    for name in SINGLE:
        if counts[name] > 1:
            raise InvalidRequest(f"the {name} header was sent {counts[name]} times; it takes one value: send it once",
                                 param=name, code="duplicate_header")
    for name in JOINED:
        if counts[name] > 1:
            headers[name] = ", ".join(value.decode("latin-1") for key, value in raw
                                      if key.decode("latin-1").lower() == name)
