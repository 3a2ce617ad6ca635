"""Cheap refusals come before expensive work: an embeddings request reserves an upper bound of its tokens before its
texts are counted, so a tenant over its limits is refused without a count (counted first, a 4 MiB body cost up to
19 s of the counting threads' CPU before its 429). The count that follows is exact, and so are usage, row and bill;
a request whose bound does not fit but whose count does is admitted at its count (gateway/embeddings_service.py)."""

from __future__ import annotations

from decimal import Decimal
from typing import Any

from gateway.embeddings_service import EmbeddingsService
from quotas.plans import Limits
from tests.conftest import Gateway

MODEL = "all-MiniLM-L6-v2"
LONG = "Embeddings map text to vectors; similar meanings land close together. " * 30  # 256 pieces, read


class CountSpy:
    """The service's embedder, with every text it is asked to count recorded."""

    def __init__(self, real: Any) -> None:
        self.real = real
        self.counted: list[str] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)

    def num_tokens(self, text: str) -> int:
        self.counted.append(text)
        return self.real.num_tokens(text)


class ReserveSpy:
    """The service's reserve stage, with each reservation asked recorded: (kind, tokens, admitted). Its `attempt`,
    which every reservation goes through (its floor's, by `floor`, too), is replaced on the stage itself."""

    def __init__(self, stage: Any) -> None:
        self.real_attempt = stage.attempt
        self.asked: list[tuple[str, int, bool]] = []
        stage.attempt = self.attempt

    async def attempt(self, ctx: Any, request_id: str, *, tokens: int, **kw: Any) -> Any:
        decision, reservation = await self.real_attempt(ctx, request_id, tokens=tokens, **kw)
        kind = "floor" if request_id.endswith(":floor") else "count" if kw.get("follows") else "bound"
        self.asked.append((kind, tokens, reservation is not None))
        return decision, reservation


def reserves(gateway: Gateway) -> ReserveSpy:
    svc: EmbeddingsService = gateway.app.state.embeddings
    return ReserveSpy(svc.reserve)


def spied(gateway: Gateway) -> CountSpy:
    with gateway.client(gateway.tenant_key) as c:  # the service is built on first use
        assert c.post("/v1/embeddings", json={"model": MODEL, "input": "warm up"}).status_code == 200
    svc: EmbeddingsService = gateway.app.state.embeddings
    spy = svc.embedder = CountSpy(svc.embedder)  # type: ignore[assignment]
    return spy


def key_with(gateway: Gateway, limits: Limits) -> str:
    return gateway.store.issue_key("acme", name="limited", limits=limits)[1]


def embed(gateway: Gateway, key: str, texts: list[str]) -> Any:
    with gateway.client(key) as c:
        return c.post("/v1/embeddings", json={"model": MODEL, "input": texts}, timeout=120)


def test_a_key_over_its_tpm_is_refused_before_its_texts_are_counted(gateway: Gateway) -> None:
    spy = spied(gateway)
    key = key_with(gateway, Limits(tpm=260))
    first = embed(gateway, key, [LONG])
    assert first.status_code == 200 and first.json()["usage"]["prompt_tokens"] == 256
    spy.counted.clear()
    big = [f"{i} " + "word " * 600 for i in range(16)]  # 48 KB (the tests' bodies are cut at 64 KiB): bound 16 x 256,
    # floor 32 > 4 left
    refused = embed(gateway, key, big)
    assert refused.status_code == 429, refused.text
    assert refused.json()["error"]["code"] == "rate_limit_tpm"
    assert spy.counted == []  # not one text counted
    assert len(gateway.ledger_rows()) == 2  # the warm-up and the first: the refusal wrote none


def test_a_key_with_its_budget_spent_is_refused_before_its_texts_are_counted(gateway: Gateway) -> None:
    spy = spied(gateway)
    key = key_with(gateway, Limits(budget_day_usd=Decimal("0")))
    refused = embed(gateway, key, [LONG] * 16)
    assert refused.status_code == 429, refused.text
    assert "budget" in refused.json()["error"]["message"]
    assert spy.counted == []


def test_a_request_whose_bound_does_not_fit_but_count_does_is_admitted_at_its_count(gateway: Gateway) -> None:
    spy = spied(gateway)
    asked = reserves(gateway).asked
    key = key_with(gateway, Limits(tpm=300))
    texts = ["hello world"] * 40  # bound 40 x 13 = 520 > 300; counted 40 x 4 = 160
    answer = embed(gateway, key, texts)
    assert answer.status_code == 200, answer.text
    assert answer.json()["usage"]["prompt_tokens"] == 160 and len(spy.counted) == 40
    assert asked == [("bound", 520, False), ("floor", 80, True), ("count", 160, True)]
    row = gateway.ledger_rows()[-1]
    assert row.input_tokens == 160
    rest = embed(gateway, key, ["hello world"] * 35)  # exactly what is left: the window holds 160, the floor given back
    assert rest.status_code == 200 and rest.json()["usage"]["prompt_tokens"] == 140, rest.text
    spy.counted.clear()
    asked.clear()
    assert embed(gateway, key, ["hello world"]).status_code == 429  # full: not even a floor fits
    assert spy.counted == [] and asked == [("bound", 13, False), ("floor", 2, False)]


def test_an_admitted_request_settles_to_its_exact_count(gateway: Gateway) -> None:
    spy = spied(gateway)
    asked = reserves(gateway).asked
    key = key_with(gateway, Limits(tpm=1000))
    texts = ["hello world"] * 10 + ["안녕하세요"]  # bound 10 x 13 + 17 = 147; counted 40 + 14 = 54
    answer = embed(gateway, key, texts)
    assert answer.status_code == 200 and answer.json()["usage"]["prompt_tokens"] == 54, answer.text
    assert asked == [("bound", 147, True)] and len(spy.counted) == 11
    svc: EmbeddingsService = gateway.app.state.embeddings
    row = gateway.ledger_rows()[-1]
    assert row.input_tokens == 54 and row.price_usd == svc.spec.price(54)
    # settled to the count, 946 left: a bound of 946 is admitted as it is, before its count
    fits = embed(gateway, key, ["x" * 254] * 3 + ["hello world"] * 13 + ["a b c d"])  # 3 x 256 + 13 x 13 + 9
    assert fits.status_code == 200, fits.text
    assert asked[1:] == [("bound", 946, True)]
