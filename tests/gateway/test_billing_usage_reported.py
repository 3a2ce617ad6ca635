"""What a tier reports as its usage is checked before it is billed, through a real gateway: an upstream that fills
`usage` with zeros (as some OpenAI-compatible servers do when they do not count) or reports fewer output tokens than
the content chunks it streamed is billed on our own count, and the ledger row, the budget and the tokens-per-minute
window all say the same. Such an answer was billed nothing (or one token), row and counters alike. So is the engine's
busy time, which prices the row's compute cost: a negative or absurd one is priced on the wall time instead (a
negative cost was written, and a huge one swamped the day's report)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest

from quotas.money import to_pico
from tests.conftest import Gateway, running_gateway
from tests.gateway.scripted_upstream import DONE, Script, chunk, scripted_app
from tests.stubs import ServerThread, free_port, openai_tiers, write_settings

PLANS = """
default_plan: billed
plans:
  billed:
    allowed_tiers: [small, mid, full]
    default_tier: mid
    cache: {enabled: false}
    limits: {rpm: 1000, tpm: 1000000, budget_day_usd: "10"}
"""
MSG = [{"role": "user", "content": "hello there"}]


def usage(prompt: int, completion: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


@pytest.fixture
def env(tmp_path: Path, prepared_models: Path) -> Iterator[tuple[Gateway, Script]]:
    script = Script()
    with ServerThread(scripted_app(script)).start() as up:
        tiers = openai_tiers({"small": {"url": f"http://127.0.0.1:{free_port()}"}, "mid": {"url": up.url},
                              "full": {"url": up.url}}, model="remote", price_per_1k_input="0.0010",
                             price_per_1k_output="0.0020")
        with running_gateway(write_settings(tmp_path, prepared_models, tiers, PLANS), script.state,
                             plan="billed") as gw:
            yield gw, script


def settled(gw: Gateway) -> tuple[Any, int, int]:
    """The one ledger row, and the tenant's money and tokens in the quota store once it is settled."""
    backend = gw.app.state.services.quota_backend
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and (backend._held or not gw.ledger_rows()):
        time.sleep(0.05)
    [row] = gw.ledger_rows()
    scope = backend._state[("acme", "t")]
    return row, sum(scope.spent_day.values()), scope.token_sum


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("reported", [usage(0, 0), usage(1, 1)], ids=["zeros", "less-than-streamed"])
def test_an_answer_is_billed_at_least_what_it_streamed(env: tuple[Gateway, Script], reported: dict[str, int],
                                                       stream: bool) -> None:
    gw, script = env
    script.lines = [chunk("The"), chunk(" capital"), chunk(" is"), chunk(" Paris"), chunk(finish="stop"),
                    chunk(choices=False, usage=reported), DONE]
    with gw.client(gw.tenant_key) as c:
        r = c.post("/v1/chat/completions", json={"model": "mid", "messages": MSG, "max_tokens": 10, "stream": stream})
    assert r.status_code == 200, r.text
    row, spent, tokens = settled(gw)
    assert row.output_tokens == 4  # a token per content chunk at least
    assert row.input_tokens >= 1  # a zero is no prompt: the one the gateway counted is billed
    assert row.price_usd > 0 and spent == to_pico(row.price_usd) and tokens == row.input_tokens + row.output_tokens
    if not stream:
        assert r.json()["usage"]["completion_tokens"] == 4  # what the client is told is what it pays


@pytest.mark.parametrize("busy", [-5.0, 1e15, True])
def test_a_busy_time_that_is_not_one_prices_the_compute_cost_on_the_wall_time(env: tuple[Gateway, Script],
                                                                          busy: object) -> None:
    gw, script = env
    script.lines = [chunk("Paris", usage=usage(5, 1), x_tiergate={"busy_s": busy}), chunk(finish="stop"), DONE]
    with gw.client(gw.tenant_key) as c:
        r = c.post("/v1/chat/completions", json={"model": "mid", "messages": MSG, "max_tokens": 10})
    assert r.status_code == 200, r.text
    row, _, _ = settled(gw)
    assert row.cost_basis == "wall" and Decimal(0) <= row.compute_cost_usd < Decimal("0.01")


def test_a_believable_busy_time_prices_the_compute_cost(env: tuple[Gateway, Script]) -> None:
    gw, script = env
    script.lines = [chunk("Paris", usage=usage(5, 1), x_tiergate={"busy_s": 0.36}), chunk(finish="stop"), DONE]
    with gw.client(gw.tenant_key) as c:
        assert c.post("/v1/chat/completions", json={"model": "mid", "messages": MSG}).status_code == 200
    row, _, _ = settled(gw)
    assert row.cost_basis == "engine" and row.compute_cost_usd == Decimal("0.0001")  # 0.36 s at $1 an hour


def test_a_compute_cost_is_written_and_reported_to_the_picodollar(env: tuple[Gateway, Script]) -> None:
    """0.37 s at $1 an hour is $0.000102777...: the row held, and every report printed, 28 significant digits."""
    gw, script = env
    script.lines = [chunk("Paris", usage=usage(5, 1), x_tiergate={"busy_s": 0.37}), chunk(finish="stop"), DONE]
    with gw.client(gw.tenant_key) as c:
        assert c.post("/v1/chat/completions", json={"model": "mid", "messages": MSG}).status_code == 200
    row, _, _ = settled(gw)
    assert row.cost_basis == "engine" and str(row.compute_cost_usd) == "0.000102777778", row.compute_cost_usd
    with gw.client(gw.admin_key) as admin:
        (report,) = admin.get("/admin/usage/report", params={"by": "tenant"}).json()["data"]
        csv = admin.get("/admin/usage/report", params={"by": "tenant", "format": "csv"}).text
    assert report["compute_cost_usd"] == "0.000102777778" and ",0.000102777778," in csv, (report, csv)
