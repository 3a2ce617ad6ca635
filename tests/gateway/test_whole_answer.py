"""gateway/routes/answering.py `WholeAnswer`: a whole JSON answer sent without Litestar's ASGIResponse, byte for byte
what Litestar's own Response sends (status, headers in order, body), and Litestar's way wherever the route or the
response asks for anything more."""

from __future__ import annotations

from typing import Any

import pytest
from litestar import Litestar, Response, get
from litestar.testing import TestClient

from gateway.routes.answering import WholeAnswer

ANSWER = {"id": "chatcmpl-1", "object": "chat.completion", "created": 1764979200, "model": "mid",
          "choices": [{"index": 0, "message": {"role": "assistant", "content": "Héllo \"there\"\n"},
                       "finish_reason": "stop", "logprobs": None}],
          "usage": {"prompt_tokens": 9, "completion_tokens": 3, "total_tokens": 12}}
HEADERS = {"x-tiergate-cache": "miss", "X-RateLimit-Remaining-Requests": "59", "retry-after": "1"}


@get("/plain", sync_to_thread=False)
def plain() -> Response[Any]:
    return Response(ANSWER, headers=HEADERS)


@get("/whole", sync_to_thread=False)
def whole() -> Response[Any]:
    return WholeAnswer(ANSWER, headers=HEADERS)


@get("/whole-with-cookie", sync_to_thread=False)
def whole_with_cookie() -> Response[Any]:
    return WholeAnswer(ANSWER, headers=HEADERS, cookies={"c": "1"})


def _raw(client: TestClient[Any], path: str) -> tuple[int, list[tuple[str, str]], bytes]:
    r = client.get(path)
    return r.status_code, list(r.headers.multi_items()), r.content


def test_a_whole_answer_is_sent_as_litestar_sends_it(monkeypatch: pytest.MonkeyPatch) -> None:
    with TestClient(Litestar([plain, whole, whole_with_cookie])) as client:
        expected = _raw(client, "/plain")
        assert _raw(client, "/whole") == expected
        calls: list[str] = []
        real = Response.to_asgi_response

        def spy(self: Response[Any], *args: Any, **kwargs: Any) -> Any:
            calls.append(type(self).__name__)
            return real(self, *args, **kwargs)
        monkeypatch.setattr(Response, "to_asgi_response", spy)
        assert _raw(client, "/whole") == expected
        assert calls == []  # Litestar's route handler called ours, which never fell back to Litestar's
        status, headers, body = _raw(client, "/whole-with-cookie")  # a cookie: Litestar's way, as before
        assert (status, body) == expected[::2] and ("set-cookie", "c=1; Path=/; SameSite=lax") in headers
        assert calls == ["WholeAnswer"]
