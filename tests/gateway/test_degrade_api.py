"""The ladder through the HTTP API: one test per action type, on-call routes, headers, ledger, replicas."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner

from gateway.app import create_app
from gateway.cli.main import cli
from gateway.config_files import ConfigFileError
from gateway.settings import Settings
from tests.conftest import Gateway, RedisServer, running_gateway
from tests.stubs import ServerThread, StubState

LADDER = """
levels:
  - {level: 0, name: normal}
  - {level: 1, name: remap, actions: [{remap_tiers: {full: mid}}]}
  - {level: 2, name: short, actions: [{cap_output_tokens: 3}]}
  - {level: 3, name: trim, actions: [{cap_input_tokens: 60}]}
  - {level: 4, name: shed, actions: [{shed: [standard], retry_after_s: 42}]}
  - {level: 5, name: cacheonly, actions: [{cache_only: [standard]}]}
  - level: 6
    name: cache-and-cascade
    actions: [{disable_cascade: true}, {semantic_threshold_delta: -0.03}]
"""
MSG = [{"role": "user", "content": "hello there"}]


@pytest.fixture
def laddered(gateway_settings: Settings, stub: tuple[ServerThread, StubState], tmp_path: Path) -> Iterator[Gateway]:
    f = tmp_path / "ladder.yaml"
    f.write_text(LADDER)
    with running_gateway(gateway_settings.model_copy(update={"ladder_file": f, "ladder_tick_s": 0.05}),
                         stub[1]) as gw:
        yield gw


def set_level(gw: Gateway, level: int, **extra: object) -> dict:  # type: ignore[type-arg]
    with gw.client(gw.admin_key) as c:
        r = c.post("/admin/degrade/", json={"level": level, "reason": "test"} | extra)
    assert r.status_code == 200, r.text
    return r.json()


def chat(gw: Gateway, **body: object):  # type: ignore[no-untyped-def]
    with gw.client(gw.tenant_key) as c:
        return c.post("/v1/chat/completions", json={"model": "full", "messages": MSG} | body)


def test_every_response_says_the_level(laddered: Gateway) -> None:
    with laddered.client() as c:
        assert c.get("/health").headers["x-tiergate-degrade-level"] == "0"
    r = chat(laddered)
    assert r.headers["x-tiergate-degrade-level"] == "0" and "x-tiergate-degrade-actions" not in r.headers
    set_level(laddered, 2)
    with laddered.client() as c:
        assert c.get("/v1/models").headers["x-tiergate-degrade-level"] == "2"  # even a 401


def test_remap_tiers(laddered: Gateway) -> None:
    set_level(laddered, 1)
    r = chat(laddered)
    assert r.status_code == 200 and r.headers["x-tiergate-tier"] == "mid"
    assert r.headers["x-tiergate-degrade-actions"] == "remap_tiers(full->mid)"
    assert "degrade level 1: full -> mid" in r.headers["x-tiergate-route-reason"]
    row = laddered.ledger_rows()[0]
    assert (row.tier, row.degrade_level, row.degrade_actions) == ("mid", 1, "remap_tiers(full->mid)")


def test_cap_output_tokens(laddered: Gateway) -> None:
    set_level(laddered, 2)
    r = chat(laddered, max_tokens=100)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    assert laddered.stub.requests[-1]["max_tokens"] == 3
    assert r.headers["x-tiergate-degrade-actions"] == "cap_output_tokens(3)"
    r = chat(laddered, max_tokens=2)  # already under the cap: untouched, nothing said
    assert laddered.stub.requests[-1]["max_tokens"] == 2 and "x-tiergate-degrade-actions" not in r.headers


def test_cap_input_tokens_drops_the_oldest_turns_keeping_the_system_prompt(laddered: Gateway) -> None:
    set_level(laddered, 3)
    long_history = [{"role": "system", "content": "Be brief."}]
    for i in range(6):
        long_history += [{"role": "user", "content": f"question number {i} about the weather"},
                         {"role": "assistant", "content": f"answer number {i}: it is sunny"}]
    long_history.append({"role": "user", "content": "and tomorrow?"})
    r = chat(laddered, messages=long_history)
    assert r.status_code == 200
    sent = laddered.stub.requests[-1]["messages"]
    assert sent[0]["content"] == "Be brief." and sent[-1]["content"] == "and tomorrow?"
    assert len(sent) < len(long_history)
    dropped = len(long_history) - len(sent)
    assert r.headers["x-tiergate-degrade-actions"] == f"cap_input_tokens(60,dropped={dropped})"
    assert all(m["content"] != "question number 0 about the weather" for m in sent)  # the oldest went first


def test_shed_is_503_with_retry_after_and_charges_nothing(laddered: Gateway) -> None:
    set_level(laddered, 4)
    r = chat(laddered)
    assert r.status_code == 503 and r.headers["retry-after"] == "42"
    assert r.json()["error"]["code"] == "degraded_shed" and r.headers["x-tiergate-degrade-actions"] == "shed(standard)"
    assert laddered.ledger_rows() == [] and laddered.stub.requests == []


def test_cache_only_without_a_cached_answer_is_503(laddered: Gateway) -> None:
    set_level(laddered, 5)
    r = chat(laddered, temperature=0)
    assert r.status_code == 503 and r.json()["error"]["code"] == "degraded_cache_only"
    assert r.headers["x-tiergate-degrade-actions"] == "cache_only(standard)" and laddered.stub.requests == []


def test_cascade_and_threshold_actions_are_declared_and_reported(laddered: Gateway) -> None:
    status = set_level(laddered, 6)
    assert {"disable_cascade": True} in status["actions"]
    assert {"semantic_threshold_delta": -0.03} in status["actions"]
    assert laddered.app.state.services.ladder.level == 6


def test_on_call_routes_ttl_auto_history_and_metrics(laddered: Gateway) -> None:
    status = set_level(laddered, 4, ttl_s=1)  # the shortest a manual level may be set for
    assert status["source"] == "manual" and status["manual"]["by"] == laddered.admin_key[3:15]
    time.sleep(1.1)
    with laddered.client(laddered.admin_key) as c:
        deadline = time.time() + 5  # the ladder's tick notices the end of the TTL (slower on a busy machine)
        while c.get("/admin/degrade/").json()["level"] != 0 and time.time() < deadline:
            time.sleep(0.1)
        assert c.get("/admin/degrade/").json()["level"] == 0  # the TTL ended
        set_level(laddered, 1)
        assert c.post("/admin/degrade/auto").json()["level"] == 0
        history = c.get("/admin/degrade/history").json()["data"]
        assert [(e["from_level"], e["to_level"]) for e in history][:4] == [(1, 0), (0, 1), (4, 0), (0, 4)]
        assert history[2]["reason"] == "manual override expired"
        assert c.post("/admin/degrade/", json={"level": 99, "reason": "x"}).status_code == 400
        assert c.post("/admin/degrade/", json={"level": 1}).status_code == 400  # a reason is required
        metrics = c.get("/metrics").text
    assert "tiergate_degrade_level 0.0" in metrics
    assert "tiergate_degrade_ladder_in_sync 1.0" in metrics
    assert 'tiergate_degrade_changes_total{by="manual",to="4"} 1.0' in metrics
    with laddered.client(laddered.tenant_key) as c:
        assert c.get("/admin/degrade/").status_code == 403


def test_reload_refuses_a_bad_file_and_keeps_the_ladder(laddered: Gateway) -> None:
    f = laddered.settings.ladder_file
    f.write_text(LADDER.replace("cap_output_tokens: 3", "cap_output_tokens: zero"))
    with laddered.client(laddered.admin_key) as c:
        r = c.post("/admin/degrade/reload")
        assert r.status_code == 400 and f"{f}:5" in r.json()["error"]["message"]
        assert len(c.get("/admin/degrade/").json()["levels"]) == 7
        # bytes that are not UTF-8 and nesting past PyYAML's recursion were a 500 (UnicodeDecodeError,
        # RecursionError); a key given twice was taken, the last one winning
        for bad, why in ((LADDER.encode() + b"# \xff\n", "not UTF-8"),
                         (b"levels: " + b"[" * 5000 + b"]" * 5000, "nested more than 64 levels"),
                         (LADDER.replace("name: short,", "name: short, name: long,").encode(), "given twice")):
            f.write_bytes(bad)
            r = c.post("/admin/degrade/reload")
            assert r.status_code == 400 and why in r.json()["error"]["message"], r.text
            assert r.json()["error"]["code"] == "invalid_ladder_file"
            assert len(c.get("/admin/degrade/").json()["levels"]) == 7
        f.write_text(LADDER.replace("cap_output_tokens: 3", "cap_output_tokens: 4"))
        assert c.post("/admin/degrade/reload").status_code == 200
    set_level(laddered, 2)
    assert chat(laddered, max_tokens=100).json()["usage"]["completion_tokens"] == 4


def test_bad_ladder_file_stops_start_up_with_its_line(gateway_settings: Settings, tmp_path: Path) -> None:
    f = tmp_path / "ladder.yaml"
    f.write_text("levels:\n  - {level: 0, name: normal}\n  - {level: 1, name: x, actions: [{explode: true}]}\n")
    with pytest.raises(ConfigFileError) as exc:
        create_app(gateway_settings.model_copy(update={"ladder_file": f}))
    assert exc.value.line == 3


def test_a_remap_naming_a_tier_the_fleet_lacks_starts_with_a_warning(gateway_settings: Settings, tmp_path: Path,
                                                                      caplog: pytest.LogCaptureFixture) -> None:
    """The shipped ladder remaps full to mid; a fleet without one of them starts, and the name is logged."""
    f = tmp_path / "ladder.yaml"
    f.write_text("levels:\n  - {level: 0, name: normal}\n  - {level: 1, name: x, actions: [\n"
                 "      {remap_tiers: {full: mdi}}]}\n")
    with caplog.at_level("WARNING", logger="tiergate.ladder"):
        create_app(gateway_settings.model_copy(update={"ladder_file": f}))
    assert any("remap_tiers names tiers the tiers file does not have: ['mdi']" in r.getMessage()
               for r in caplog.records), caplog.text


def test_cli_sets_the_level_a_running_gateway_follows(laddered: Gateway) -> None:
    env = {"TIERGATE_DATA_DIR": str(laddered.settings.data_dir),
           "TIERGATE_LADDER_FILE": str(laddered.settings.ladder_file)}
    runner = CliRunner()
    r = runner.invoke(cli, ["degrade", "set", "1", "--reason", "drill", "--ttl", "30m"], env=env)
    assert r.exit_code == 0, r.output
    deadline = time.time() + 2
    while chat(laddered).headers["x-tiergate-tier"] != "mid":
        assert time.time() < deadline
        time.sleep(0.05)
    status = runner.invoke(cli, ["degrade", "status"], env=env).output
    assert "level 1 (remap), set by manual" in status and "drill" in status
    assert "0 -> 1  by cli: manual for 1800s: drill" in runner.invoke(cli, ["degrade", "history"], env=env).output
    assert runner.invoke(cli, ["degrade", "auto"], env=env).exit_code == 0
    assert runner.invoke(cli, ["degrade", "set", "1", "--reason", "x", "--ttl", "soon"], env=env).exit_code == 2
    for ttl in ("0", "0s"):  # was a level held until `auto`
        r = runner.invoke(cli, ["degrade", "set", "1", "--reason", "x", "--ttl", ttl], env=env)
        assert r.exit_code == 2 and "--ttl" in r.output and "not from 1s" in r.output, r.output
    assert "level 0 (normal), set by auto" in runner.invoke(cli, ["degrade", "status"], env=env).output


def test_two_gateway_replicas_follow_one_level_through_redis(gateway_settings: Settings,
                                                            stub: tuple[ServerThread, StubState],
                                                            tmp_path: Path) -> None:
    redis = RedisServer().start()
    f = tmp_path / "ladder.yaml"
    f.write_text(LADDER)
    try:
        # a 0.1 s tick (the default is 0.5 s): the second replica followed in ~0.49 s, half the bound below, which a
        # loaded CI machine could pass; at 0.1 s the bound holds ten ticks
        base = gateway_settings.model_copy(update={"ladder_file": f, "redis_url": redis.url, "ladder_tick_s": 0.1})
        one = base.model_copy(update={"data_dir": tmp_path / "one"})
        two = base.model_copy(update={"data_dir": tmp_path / "two"})
        with running_gateway(one, stub[1]) as a, running_gateway(two, stub[1]) as b:
            set_level(a, 4)
            t0 = time.time()
            while chat(b).status_code != 503:
                assert time.time() - t0 < 1.0, "replica two did not follow within a second"
                time.sleep(0.02)
            with b.client(b.admin_key) as c:
                assert c.get("/admin/degrade/").json()["level"] == 4
    finally:
        redis.stop()


@pytest.mark.parametrize(("body", "param", "code"), [
    ({"level": 99, "reason": "x"}, "level", "level_not_found"),
    ({"level": 2**70, "reason": "x"}, "level", "level_not_found"),
    ({"level": 1, "reason": "   "}, "reason", "reason_required"),  # was param "level"
    ({"level": 1, "reason": "drill\nlevel 0 -> 6 by auto: forged"}, "reason", "invalid_value"),  # was taken, and logged
    ({"level": 1, "reason": "x", "ttl_s": 1e-300}, "ttl_s", "greater_than_equal"),  # was 200, level 0 in force
    ({"level": 1, "reason": "x", "ttl_s": 0.5}, "ttl_s", "greater_than_equal"),
])
def test_a_refused_change_names_its_field_and_has_a_code(laddered: Gateway, body: dict[str, object], param: str,
                                                         code: str) -> None:
    with laddered.client(laddered.admin_key) as c:
        r = c.post("/admin/degrade/", json=body)
        assert r.status_code == 400, r.text
        assert (r.json()["error"]["param"], r.json()["error"]["code"]) == (param, code)
        assert c.get("/admin/degrade/").json()["manual"] is None and c.get("/admin/degrade/history").json() == {
            "data": []}


@pytest.mark.parametrize("limit", ["-5", "0", "1001", "ten"])
def test_a_history_limit_out_of_range_is_refused_by_name(laddered: Gateway, limit: str) -> None:
    set_level(laddered, 1)
    with laddered.client(laddered.admin_key) as c:
        r = c.get("/admin/degrade/history", params={"limit": limit})  # -5 was 200, read as 1
        assert r.status_code == 400, r.text
        assert (r.json()["error"]["param"], r.json()["error"]["code"]) == ("limit", "invalid_value")
        assert len(c.get("/admin/degrade/history", params={"limit": "1000"}).json()["data"]) == 1
        assert len(c.get("/admin/degrade/history", params={"limit": "1"}).json()["data"]) == 1
