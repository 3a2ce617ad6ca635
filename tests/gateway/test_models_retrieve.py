"""GET /v1/models/{model}: one entry of the list a key sees, as the OpenAI SDKs' `models.retrieve` reads it; a model
the key does not see is OpenAI's 404 `model_not_found`, the same for a name that is no tier and for a tier the
plan leaves out."""

from __future__ import annotations

import openai
import pytest

from gateway.settings import Settings
from tests.conftest import Gateway, running_gateway
from tests.stubs import ServerThread, StubState


def test_every_listed_model_is_retrieved_as_listed(gateway: Gateway) -> None:
    with openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=gateway.tenant_key, max_retries=0) as client:
        listed = {m.id: m.model_dump() for m in client.models.list()}
        assert {"auto", "mid", "full"} <= set(listed)
        for model_id, entry in listed.items():
            got = client.models.retrieve(model_id)
            assert got.id == model_id and got.object == "model" and got.model_dump() == entry


@pytest.mark.parametrize("model_id", ["nope", "gpt-4o"])
def test_an_unknown_model_is_openais_404(gateway: Gateway, model_id: str) -> None:
    with (openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=gateway.tenant_key, max_retries=0) as client,
          pytest.raises(openai.NotFoundError) as caught):
        client.models.retrieve(model_id)
    error = caught.value.response.json()["error"]
    assert error["code"] == "model_not_found" and error["param"] == "model" and model_id in error["message"]


def test_a_model_needs_a_key(gateway: Gateway) -> None:
    with gateway.client() as c:
        r = c.get("/v1/models/mid")
    assert r.status_code == 401 and r.json()["error"]["code"] == "missing_api_key"


def test_a_tier_the_plan_leaves_out_reads_like_an_unknown_model(gateway_settings: Settings,
                                                                 stub: tuple[ServerThread, StubState]) -> None:
    with (running_gateway(gateway_settings, stub[1], plan="smallonly") as gw,
          openai.OpenAI(base_url=f"{gw.url}/v1", api_key=gw.tenant_key, max_retries=0) as client):
        assert "mid" not in {m.id for m in client.models.list()}
        with pytest.raises(openai.NotFoundError) as hidden:
            client.models.retrieve("mid")
        with pytest.raises(openai.NotFoundError) as unknown:
            client.models.retrieve("nope")
    assert hidden.value.response.json()["error"]["message"].replace("mid", "nope") == \
        unknown.value.response.json()["error"]["message"]
