"""vLLM's `top_k` is honoured by tiers whose server samples by it (our engines, `dialect: vllm`), and OpenAI's API has
no such field: a request that sets it never reaches a plain `openai` tier, where OpenAI would refuse it (a 400 the
tenant got as the tier's) and a lenient server would drop it unsaid. Named, such a tier is a 400 naming `top_k` before
anything is spent; `auto` and a cascade pass it over; a plan with no tier that can is refused by name. -1 and 0 turn
top_k off and go anywhere, left out of the body. Chat and text completions alike, through a real gateway in front of
stubs that record the bodies they get."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import Gateway
from tests.gateway.dialect_tiers import dialect_gateway, key_of

USER = [{"role": "user", "content": "hello"}]


@pytest.fixture
def gw(tmp_path: Path, prepared_models: Path) -> Iterator[Gateway]:
    with dialect_gateway(tmp_path, prepared_models) as gateway:
        yield gateway


def post(gw: Gateway, path: str, body: dict[str, Any], key: str | None = None) -> Any:
    with gw.client(key or gw.tenant_key) as c:
        return c.post(path, json={"max_tokens": 3, **body})


@pytest.mark.parametrize(("path", "body"), [("/v1/chat/completions", {"messages": USER}),
                                            ("/v1/completions", {"prompt": "hello"})])
def test_top_k_named_for_a_plain_openai_tier_is_refused_by_name_before_anything_is_spent(
        gw: Gateway, path: str, body: dict[str, Any]) -> None:
    r = post(gw, path, {"model": "mid", "top_k": 5, **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "top_k" and error["code"] == "unsupported_parameter", error
    assert error["type"] == "invalid_request_error" and "'mid'" in error["message"]
    assert gw.stub.requests == [] and gw.ledger_rows() == []  # nothing sent, nothing reserved or billed
    served = post(gw, path, {"model": "full", "top_k": 5, **body})  # a vLLM samples by it: sent as asked
    assert served.status_code == 200, served.text
    assert gw.stub.requests[-1]["top_k"] == 5 and gw.stub.requests[-1]["model"] == "stub-full"


@pytest.mark.parametrize("off", [-1, 0])
def test_top_k_turned_off_goes_anywhere_and_is_left_out(gw: Gateway, off: int) -> None:
    for path, body in (("/v1/chat/completions", {"messages": USER}), ("/v1/completions", {"prompt": "hello"})):
        r = post(gw, path, {"model": "mid", "top_k": off, **body})
        assert r.status_code == 200, r.text
        assert "top_k" not in gw.stub.requests[-1]  # a strict server would refuse the field, whatever its value


def test_auto_keeps_top_k_off_a_plain_openai_tier(gw: Gateway) -> None:
    plain = post(gw, "/v1/chat/completions", {"model": "auto", "messages": USER})
    assert plain.headers["x-tiergate-tier"] == "mid"  # the plan's default
    sampled = post(gw, "/v1/chat/completions", {"model": "auto", "top_k": 5, "messages": USER})
    assert sampled.status_code == 200, sampled.text
    assert sampled.headers["x-tiergate-tier"] == "small"  # the cheapest that samples by it, as with tools
    assert gw.mute.requests[-1]["top_k"] == 5  # type: ignore[attr-defined]
    assert [b["model"] for b in gw.stub.requests] == ["stub-mid"]  # the first request's only


def test_a_plan_with_no_tier_that_samples_by_top_k_is_refused_by_name(gw: Gateway) -> None:
    r = post(gw, "/v1/chat/completions", {"model": "auto", "top_k": 5, "messages": USER}, key_of(gw, "plain"))
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_k", r.text
    assert gw.stub.requests == []


def test_a_cascade_does_not_retry_top_k_on_a_plain_openai_tier(gw: Gateway) -> None:
    """`small` answers nothing, so the cascade retries on the next dearer tier: `full`, not `mid`."""
    r = post(gw, "/v1/chat/completions", {"model": "auto", "top_k": 5, "messages": USER}, key_of(gw, "cascading"))
    assert r.status_code == 200, r.text
    assert [b["model"] for b in gw.mute.requests] == ["stub-small"]  # type: ignore[attr-defined]
    assert [(b["model"], b["top_k"]) for b in gw.stub.requests] == [("stub-full", 5)]
    assert r.headers["x-tiergate-tier"] == "full"
