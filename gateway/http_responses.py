"""The answers the gateway's HTTP protocol (gateway/http_limits.py) writes itself, with no app behind them: whole
HTTP responses in OpenAI's error shape, each closing its connection, built once at import; and the limits on a
request's head that their messages name."""

from __future__ import annotations

import json

MAX_HEAD_BYTES = 64 * 1024  # a request's line and headers
MAX_HEADERS = 100  # a request's header lines


def _error(status: bytes, message: str, code: str) -> bytes:
    """A whole HTTP response with OpenAI's error body, closing the connection."""
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                 "code": code}}).encode()
    return (b"HTTP/1.1 " + status + b"\r\ncontent-type: application/json\r\nconnection: close\r\ncontent-length: "
            + str(len(body)).encode() + b"\r\n\r\n" + body)


TIMEOUT_RESPONSE = _error(b"408 Request Timeout", "the request did not arrive whole in time; send it again, faster",
                          "request_timeout")
TOO_LARGE_RESPONSE = _error(b"431 Request Header Fields Too Large",
                            f"the request line and headers pass {MAX_HEAD_BYTES} bytes", "headers_too_large")
TOO_MANY_RESPONSE = _error(b"431 Request Header Fields Too Large",
                           f"the request has more than {MAX_HEADERS} headers", "too_many_headers")
ENCODED_RESPONSE = _error(b"415 Unsupported Media Type", "a Content-Encoding other than identity is not supported; "
                          "send the body uncompressed", "unsupported_content_encoding")
INVALID_RESPONSE = _error(b"400 Bad Request", "the request is not valid HTTP (its line, a header, both "
                          "Content-Length and Transfer-Encoding, or its chunked framing); nothing was run",
                          "invalid_http_request")
FRAMING_RESPONSE = _error(b"413 Request Entity Too Large", "the request body, with its chunked framing, passes "
                          "what this gateway reads of one request; send it in fewer, larger chunks",
                          "payload_too_large")
