"""POST /v1/embeddings through the gateway: the official client gets sentence-transformers' vectors, billed per
token under the plan with one ledger row, and refusals are counted and charge nothing."""

from __future__ import annotations

import base64
import time
from collections.abc import Iterator
from decimal import Decimal

import httpx
import numpy as np
import openai
import pytest

from cache.embedder import default_model_path
from gateway.settings import Settings
from tests.conftest import Gateway, running_gateway
from tests.stubs import ServerThread, StubState

MODEL = "all-MiniLM-L6-v2"
TEXTS = ["How do I reset my password?", "The weather in Paris is mild in spring.", "x",
         "Embeddings map text to vectors; similar meanings land close together. " * 30]


@pytest.fixture(scope="module")
def reference() -> np.ndarray:
    """The vectors sentence-transformers itself gives these texts (normalized, as OpenAI's are)."""
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(default_model_path()), device="cpu").encode(TEXTS, normalize_embeddings=True)


@pytest.fixture
def metered(gateway_settings: Settings, stub: tuple[ServerThread, StubState]) -> Iterator[Gateway]:
    with running_gateway(gateway_settings, stub[1], plan="metered") as gw:
        yield gw


def client(gw: Gateway, key: str | None = None) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gw.url}/v1", api_key=key or gw.tenant_key, max_retries=0)


def test_the_official_client_gets_sentence_transformers_vectors(gateway: Gateway, reference: np.ndarray) -> None:
    with client(gateway) as c:
        default = c.embeddings.create(model=MODEL, input=TEXTS)  # the SDK asks for base64 and decodes it
        as_float = c.embeddings.create(model=MODEL, input=TEXTS, encoding_format="float", dimensions=384)
        one = c.embeddings.create(model=MODEL, input=TEXTS[3])
    for answer in (default, as_float):
        assert [d.index for d in answer.data] == [0, 1, 2, 3]
        np.testing.assert_allclose(np.array([d.embedding for d in answer.data]), reference, atol=1e-5)
    np.testing.assert_allclose(one.data[0].embedding, reference[3], atol=1e-5)
    assert default.model == MODEL and default.usage.prompt_tokens == default.usage.total_tokens > len(TEXTS)
    assert default.usage.prompt_tokens == as_float.usage.prompt_tokens
    # a text longer than the model reads (256 word pieces, about 420 here) is billed for what it read
    assert one.usage.prompt_tokens == 256

    rows = gateway.ledger_rows()
    assert len(rows) == 3 and {(r.tier, r.model, r.status, r.http_status) for r in rows} == {
        ("embeddings", MODEL, "ok", 200)}
    assert sorted(r.input_tokens for r in rows) == sorted(
        a.usage.prompt_tokens for a in (default, as_float, one))
    assert all(r.price_usd == Decimal("0.00001") * r.input_tokens / 1000 and r.output_tokens == 0 for r in rows)
    with gateway.client(gateway.tenant_key) as h:
        raw = h.post("/v1/embeddings", json={"model": MODEL, "input": "x", "encoding_format": "base64"})
    assert raw.headers["x-tiergate-tier"] == "embeddings"
    vector = np.frombuffer(base64.b64decode(raw.json()["data"][0]["embedding"]), dtype="<f4")
    np.testing.assert_allclose(vector, reference[2], atol=1e-5)


def test_the_model_is_listed_with_its_capability(gateway: Gateway) -> None:
    with client(gateway) as c:
        models = {m.id: m for m in c.models.list()}
    assert models[MODEL].model_extra["capabilities"] == ["embeddings"]
    assert models["mid"].model_extra["capabilities"] == ["chat.completions", "completions", "tools"]


@pytest.mark.parametrize(("body", "status", "param", "code"), [
    ({"input": "hi", "dimensions": 256}, 400, "dimensions", "unsupported_value"),
    ({"input": [1, 2, 3]}, 400, "input", "unsupported_value"),
    ({"input": [[1, 2], [3]]}, 400, "input", "unsupported_value"),
    ({"input": ["ok", ""]}, 400, "input.1", "string_too_short"),
    ({"input": []}, 400, "input", "too_short"),
    ({"input": "x" * 8193}, 400, "input", "string_too_long"),
    ({"input": ["a"] * 2049}, 400, "input", "too_long"),
    ({"input": "hi", "encoding_format": "int8"}, 400, "encoding_format", "literal_error"),
    ({"input": "hi", "model": "mid"}, 404, "model", "model_not_found"),
    ({"input": "hi", "truncate": True}, 400, "truncate", "unsupported_parameter"),
])
def test_a_bad_request_is_refused_by_name_counted_and_charged_nothing(
        gateway: Gateway, body: dict[str, object], status: int, param: str, code: str) -> None:
    with gateway.client(gateway.tenant_key) as c:
        r = c.post("/v1/embeddings", json={"model": MODEL} | body)
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param and r.json()["error"]["code"] == code
    assert gateway.ledger_rows() == []
    assert refusals(gateway) == [(code, status, 1)]


def refusals(gw: Gateway) -> list[tuple[str, int, int]]:
    """The gateway's refusal counts, once its ledger writer has committed them (within its next group)."""
    ledger = gw.app.state.services.ledger
    deadline = time.time() + 5
    while not (counts := ledger.refusal_counts()) and time.time() < deadline:
        time.sleep(0.02)
    return [(c.reason, c.http_status, c.count) for c in counts]


def test_limits_apply_as_to_chat(metered: Gateway) -> None:
    with client(metered) as c:
        answers = [c.embeddings.create(model=MODEL, input="hello") for _ in range(3)]
        assert all(a.data for a in answers)
        with pytest.raises(openai.RateLimitError) as refused:  # the plan allows 3 requests a minute
            c.embeddings.create(model=MODEL, input="hello")
    assert refused.value.body["code"] == "rate_limit_rpm" and int(refused.value.response.headers["retry-after"]) >= 1
    assert len(metered.ledger_rows()) == 3
    with client(metered, metered.admin_key) as admin, pytest.raises(openai.PermissionDeniedError):
        admin.embeddings.create(model=MODEL, input="hello")  # admin keys do not call models
    with client(metered, "tg-wrong") as wrong, pytest.raises(openai.AuthenticationError):
        wrong.embeddings.create(model=MODEL, input="hello")


def test_refused_bodies_empty_the_same_bucket_as_chat(gateway: Gateway) -> None:
    """An embeddings body refused by the validation is counted in the tenant's bucket of refused bodies too."""
    gate = gateway.app.state.services.pipeline.gate
    gate.refused_bytes_burst, gate.refused_bytes_per_s = 2000, 1000
    bad = {"model": MODEL, "input": ["x" * 1500, ""]}  # an empty input is refused
    with httpx.Client(base_url=gateway.url, headers={"authorization": f"Bearer {gateway.tenant_key}"}) as c:
        first, second, third = (c.post("/v1/embeddings", json=bad) for _ in range(3))
    assert first.status_code == second.status_code == 400
    assert third.status_code == 429 and third.json()["error"]["code"] == "rate_limit_invalid_requests"


def test_refusals_after_the_parse_are_charged_as_on_chat(gateway: Gateway) -> None:
    """A request refused as its own fault after its body parsed (a model not served, an Idempotency-Key reused with
    another body) cost the gateway that parse and charged nothing else, as chat's (gateway/pipeline/refusals.py's
    `tenants_fault`): charged nothing here either, a tenant could have 4 MiB bodies of 2,048 texts parsed and refused
    without end, never throttled."""
    gate = gateway.app.state.services.pipeline.gate
    gate.refused_bytes_burst, gate.refused_bytes_per_s = 4096, 1e-3  # a bucket that does not refill in the test
    wrong = {"model": "mid", "input": ["x" * 2500, "y" * 2500]}  # valid, but no embedding model of that name
    with httpx.Client(base_url=gateway.url, headers={"authorization": f"Bearer {gateway.tenant_key}"}) as c:
        first, second = (c.post("/v1/embeddings", json=wrong) for _ in range(2))
    assert first.status_code == 404 and first.json()["error"]["code"] == "model_not_found"
    assert second.status_code == 429 and second.json()["error"]["code"] == "rate_limit_invalid_requests"


def test_a_refused_body_is_charged_its_headers_too(gateway: Gateway) -> None:
    """As on the chat route (gateway/pipeline/gate.py's `refused_size`): a refused body of a few bytes under 5 KB of
    headers cost the gateway the headers too, and was charged the body only."""
    gate = gateway.app.state.services.pipeline.gate
    gate.refused_bytes_burst, gate.refused_bytes_per_s = 4096, 1e-3  # a bucket that does not refill in the test
    bad = {"model": MODEL, "input": ""}  # refused: an empty input
    with httpx.Client(base_url=gateway.url, headers={"authorization": f"Bearer {gateway.tenant_key}"}) as c:
        first = c.post("/v1/embeddings", json=bad, headers={"x-pad": "a" * 5000})
        second = c.post("/v1/embeddings", json=bad)
    assert first.status_code == 400 and first.json()["error"]["param"] == "input"
    assert second.status_code == 429 and second.json()["error"]["code"] == "rate_limit_invalid_requests"
