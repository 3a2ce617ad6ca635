"""Bad admin input below the routes: every refusal names its field and has a code, changes nothing, and an admin's
string never breaks a log line. The rollout service (which the CLI calls directly), the ladder's TTL, the report's
groups, and Litestar's own refusals as our errors."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
from litestar.exceptions import HTTPException

from gateway.errors import InvalidRequest, client_error
from gateway.ladder.config import Ladder
from gateway.ladder.controller import LadderChangeError, LadderController
from gateway.ladder.signals import Signals
from gateway.ladder.state import SqliteLadderStore
from gateway.rollout.service import RolloutService
from gateway.rollout.state import SqliteRolloutStore
from quotas.report import usage_report
from tiers.catalogue import TierCatalogue

TIER = {"backend": "openai", "model": "m", "urls": ["http://a:1"], "price_per_1k_input": "0.001",
        "price_per_1k_output": "0.002", "hardware_cost_per_hour": "1", "context_limit": 4096}
CATALOGUE = TierCatalogue.model_validate({"tiers": {"mid": TIER | {"serving": "v1", "versions": [
    {"name": "v1"}, {"name": "v2", "urls": ["http://b:1"]}]}}})


@pytest.fixture
def service(tmp_path: Path) -> Iterator[RolloutService]:
    store = SqliteRolloutStore(tmp_path / "rollouts.db")
    yield RolloutService(CATALOGUE, store)
    store.close()


@pytest.mark.parametrize("reason", ["drill\nrollout of v9 on tier mid: full by admin (forged)", "a\rb", "tab\there",
                                    "nel\x85here", "esc\x1b[31m", "del\x7f", "line\u2028sep"])
def test_a_reason_with_a_control_character_is_refused_by_name(service: RolloutService, reason: str) -> None:
    with pytest.raises(InvalidRequest) as exc:
        service.start("mid", "v2", share=0.2, who="cli", reason=reason)
    assert (exc.value.param, exc.value.code) == ("reason", "invalid_value")
    assert service.status() == [] and service.history() == []
    service.start("mid", "v2", share=0.2, who="cli", reason="r")
    before = (service.status(), service.history())
    for change in (lambda: service.promote("mid", who="k", reason=reason),
                   lambda: service.pause("mid", who="k", reason=reason),
                   lambda: service.rollback("mid", who="k", reason=reason)):
        with pytest.raises(InvalidRequest) as exc:
            change()
        assert (exc.value.param, exc.value.code) == ("reason", "invalid_value")
    assert (service.status(), service.history()) == before


@pytest.mark.parametrize(("call", "param", "code"), [
    (lambda s: s.start("mid", "v2", share=1.5, who="k", reason="r"), "share", "invalid_value"),
    (lambda s: s.start("mid", "v2", share=-0.1, who="k", reason="r"), "share", "invalid_value"),
    (lambda s: s.promote("mid", share=1.5, who="k", reason="r"), "share", "invalid_value"),
    (lambda s: s.promote("mid", share=0.1, who="k", reason="r"), "share", "share_lowered"),
    (lambda s: s.promote("mid", who="k", reason="  "), "reason", "reason_required"),
    (lambda s: s.pause("mid", who="k", reason="\u3000"), "reason", "reason_required"),
    (lambda s: s.rollback("mid", who="k", reason=""), "reason", "reason_required"),
])
def test_every_refused_change_has_a_param_and_a_code(service: RolloutService, call: object, param: str,
                                                     code: str) -> None:
    service.start("mid", "v2", share=0.3, who="k", reason="r")
    before = (service.status(), service.history())
    with pytest.raises(InvalidRequest) as exc:
        call(service)  # type: ignore[operator]
    assert (exc.value.param, exc.value.code) == (param, code)
    assert (service.status(), service.history()) == before


def test_a_shadow_with_a_share_has_a_code(service: RolloutService) -> None:
    with pytest.raises(InvalidRequest) as exc:
        service.start("mid", "v2", share=0.2, shadow=0.5, who="k", reason="r")
    assert exc.value.param == "share" and exc.value.code


def test_the_reason_is_logged_quoted(service: RolloutService, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="tiergate.rollout"):
        service.start("mid", "v2", share=0.2, who="cli", reason="  new weights (ticket 42) ")
    assert caplog.records[-1].getMessage().endswith("by cli: 'new weights (ticket 42)'")


LADDER = Ladder.model_validate({"levels": [{"level": 0, "name": "normal"}, {"level": 1, "name": "short",
                                                                             "actions": [{"cap_output_tokens": 3}]}]})


@pytest.mark.parametrize("ttl_s", [1e-300, 0.0, 0.5, -5.0, float("nan"), float("inf"), 1e12])
def test_a_manual_level_too_short_or_too_long_is_refused(tmp_path: Path, ttl_s: float) -> None:
    c = LadderController(LADDER, SqliteLadderStore(tmp_path / "ladder.db"), Signals(), clock=lambda: 1000.0)
    with pytest.raises(LadderChangeError) as exc:
        c.set_manual(1, reason="drill", who="k", ttl_s=ttl_s)
    assert (exc.value.param, exc.value.code) == ("ttl_s", "invalid_value")
    assert c.state.manual_level is None and c.store.history() == [] and c.level == 0
    c.set_manual(1, reason="drill", who="k", ttl_s=1.0)
    assert (c.level, c.state.manual_until) == (1, 1001.0)


def test_the_report_refuses_a_group_named_twice() -> None:
    class NoLedger:  # the refusal comes before any read
        def request_totals(self, *args: object, **kwargs: object) -> list[object]:
            raise AssertionError("read")

        refusal_totals = request_totals

    with pytest.raises(ValueError, match="day more than once"):
        usage_report(NoLedger(), by=("tenant", "day", "day"))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="day, tenant more than once"):
        usage_report(NoLedger(), by=("day",) * 5000 + ("tenant", "tenant"))  # type: ignore[arg-type]


@pytest.mark.parametrize(("status", "code"), [
    (400, "bad_request"), (403, "forbidden"), (404, "not_found"), (409, "conflict"), (415, "unsupported_media_type"),
    (422, "unprocessable_entity"), (503, "service_unavailable"),
    (401, "invalid_api_key"), (405, "method_not_allowed"), (413, "payload_too_large"), (429, "rate_limit_exceeded"),
    (500, "internal_error"), (502, "internal_error"),
])
def test_litestars_own_refusals_have_a_code(status: int, code: str) -> None:
    err = client_error(HTTPException(status_code=status, detail="Invalid host header"))
    assert err.body()["error"]["code"] == code and set(err.body()["error"]) == {"message", "type", "param", "code"}
