"""Schema-driven fuzzing of every route the OpenAPI document publishes (schemathesis): generated requests, valid
and invalid, against a real gateway in front of the stub upstream. No answer may be a server error, and every
answer must be one the document allows (its status, content type, body and headers); a request the document
allows is not refused as malformed, one it forbids is; a route that needs a key refuses a request without one.

A negative request may also be refused with 413: a body past the gateway's size limit is refused before it is
read, whatever else is wrong with it (schemathesis generates multi-megabyte arrays). Two operations take values
that configuration defines, which the document (built from the routes) cannot enumerate: a tenant's plan, the
ladder's level, and a rollout's tier and version (the tiers file's); for them a well-formed request naming a plan,
level, tier or version that does not exist may be refused (400 naming it), and that alone is not checked. A key's
tenant is one the store holds: a generated key request that names a tenant names acme, the gateway's (a tenant that
does not exist is a 400 naming `tenant`). One chat field depends on another in a way JSON Schema cannot say: a
named `tool_choice` must name one of `tools`; a generated request that offers tools names the first of them. So does
a usage report's range: its `from` day may not come after its `to` (an empty range is refused, not read as no use);
a generated report asking both gets them in order."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.config import SchemathesisConfig
from schemathesis.specs.openapi.checks import positive_data_acceptance

from gateway.app import create_app
from gateway.settings import Settings
from tests.conftest import PLANS_YAML, Gateway, running_gateway, tiers_yaml
from tests.stubs import ServerThread, StubState, stub_app, write_settings

ADMIN_PATHS = ("/admin", "/metrics")
KEYS: dict[str, str] = {}  # the running gateway's keys, for the auth provider (set by the fixture)
# a plan's name, the ladder's levels, a rollout's tier and version (the fuzzed gateway's tiers declare no versions)
CONFIGURED = {("POST", "/admin/tenants"), ("POST", "/admin/degrade"), ("POST", "/admin/rollouts")}
REJECTED = [400, 401, 403, 404, 405, 406, 409, 413, 415, 422, 428, 429]  # schemathesis' list, and 413


def _document() -> dict[str, Any]:
    """The document as the app publishes it (it depends on the routes, not on the configuration)."""
    with tempfile.TemporaryDirectory() as data_dir:
        return create_app(Settings(data_dir=Path(data_dir))).openapi_schema.to_schema()


schema = schemathesis.openapi.from_dict(_document(), config=SchemathesisConfig.from_dict(
    {"checks": {"negative_data_rejection": {"expected-statuses": REJECTED}}}))


@schema.auth(refresh_interval=None)
class GatewayKey:
    """The admin key for admin routes, the tenant's elsewhere; schemathesis also sends each request without it."""

    def get(self, case: Any, ctx: Any) -> str:
        # also asked while the test is collected, before the gateway (and its keys) exist
        return KEYS.get("admin" if case.path.startswith(ADMIN_PATHS) else "tenant", "")

    def set(self, case: Any, data: str, ctx: Any) -> None:
        if case.headers is None:
            case.headers = {}
        case.headers["Authorization"] = f"Bearer {data}"


@pytest.fixture(scope="module")
def fuzzed(tmp_path_factory: pytest.TempPathFactory, prepared_models: Path) -> Iterator[Gateway]:
    """One gateway (and stub upstream, for every tier: the gateway is ready) for every operation's examples."""
    state = StubState()
    with ServerThread(stub_app(state)).start() as stub:
        gw_settings = write_settings(tmp_path_factory.mktemp("fuzz"), prepared_models, tiers_yaml(stub.url, stub.url),
                                     PLANS_YAML, max_body_bytes=64 * 1024)
        with running_gateway(gw_settings, state) as gw:
            KEYS.update(admin=gw.admin_key, tenant=gw.tenant_key)
            yield gw


@schema.parametrize()
@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
def test_no_answer_contradicts_the_document(case: Any, fuzzed: Gateway) -> None:
    configured = (case.method.upper(), case.path) in CONFIGURED
    _name_an_offered_tool(case.body)
    _results_answer_calls(case.body)
    _days_in_order(case.query)
    if (case.method.upper(), case.path) == ("POST", "/admin/keys") and isinstance(case.body, dict) and \
            isinstance(case.body.get("tenant"), str):
        case.body["tenant"] = "acme"  # the store's tenant: a string the schema allows either way
    case.call_and_validate(base_url=fuzzed.url, excluded_checks=[positive_data_acceptance] if configured else None)


def _days_in_order(query: Any) -> None:
    """A report's `from` and `to` (YYYY-MM-DD: in order as text), both given, are put in order."""
    if isinstance(query, dict) and all(isinstance(query.get(k), str) for k in ("from", "to")) and \
            query["from"] > query["to"]:
        query["from"], query["to"] = query["to"], query["from"]


def _results_answer_calls(body: Any) -> None:
    """Each tool result answers a call of the assistant message before its turn of results, once (a relation between
    messages the schema cannot state; else it is refused): the results whose id answers none are left out, and a
    conversation left with no message gets a user turn."""
    if not isinstance(body, dict) or not isinstance(messages := body.get("messages"), list):
        return
    kept: list[Any] = []
    pending: set[Any] = set()
    for m in messages:
        if not isinstance(m, dict) or m.get("role") != "tool":
            calls = m.get("tool_calls") if isinstance(m, dict) else None
            pending = {c["id"] for c in calls if isinstance(c, dict) and isinstance(c.get("id"), str)} \
                if isinstance(calls, list) else set()
            kept.append(m)
        elif not isinstance(answered := m.get("tool_call_id"), str):
            kept.append(m)  # refused by the schema as it is
        elif answered in pending:
            pending.discard(answered)
            kept.append(m)
    body["messages"] = kept or [{"role": "user", "content": "hi"}]


def _name_an_offered_tool(body: Any) -> None:
    """A named tool_choice names the first of the request's tools (when it offers any: else it is refused)."""
    if not isinstance(body, dict) or not isinstance(choice := body.get("tool_choice"), dict):
        return
    tools, function = body.get("tools"), choice.get("function")
    if isinstance(function, dict) and isinstance(tools, list) and tools and isinstance(tools[0], dict) and \
            isinstance(tools[0].get("function"), dict) and "name" in tools[0]["function"]:
        function["name"] = tools[0]["function"]["name"]
