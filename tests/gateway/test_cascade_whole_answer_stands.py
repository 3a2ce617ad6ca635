"""A cascade's first answer that ended within the look-ahead was read whole, whatever its finish: if its retry fails
before its first byte, the first answer (billed already, its row ok) stands and is sent, JSON or stream, as one
that ended with "stop" does (gateway/pipeline/cascade.py). Before, one that ended at max_tokens ("length") was taken
for an answer the look-ahead cut, and the client got the retry's error for an answer it was billed for. An answer
the look-ahead did cut still gives the client the retry's error."""

from __future__ import annotations

import json
from pathlib import Path

from gateway.settings import Settings
from tests.gateway.test_cascade_logprobs import calibrated, engine_small, settings  # noqa: F401  (fixtures)
from tests.gateway.test_routing_api import chat
from tests.stubs import StubState

FAILS = "STUB:400 anything"  # `mid`, the retry's tier, answers 400 (context_length_exceeded)


def rows_by_tier(gw) -> dict[str, object]:  # type: ignore[no-untyped-def]
    return {row.tier: row for row in gw.ledger_rows()}


def test_a_json_answer_cut_at_max_tokens_within_the_look_ahead_stands_when_its_retry_fails(
        settings: tuple[Settings, StubState], tmp_path: Path) -> None:  # noqa: F811
    with calibrated(settings, tmp_path, 0.0, lookahead=32) as gw:
        r = chat(gw, FAILS, max_tokens=3)
        assert r.status_code == 200, r.text
        assert r.headers["x-tiergate-cascade"] == "small->mid failed (context_length_exceeded)"
        choice = r.json()["choices"][0]
        assert choice["message"]["content"] == "uns" and choice["finish_reason"] == "length"
        rows = rows_by_tier(gw)
        assert (rows["small"].status, rows["small"].http_status, rows["small"].finish_reason) == ("ok", 200, "length")
        assert (rows["mid"].status, rows["mid"].http_status) == ("error", 400)


def test_a_held_stream_cut_at_max_tokens_within_the_look_ahead_is_sent_when_its_retry_fails(
        settings: tuple[Settings, StubState], tmp_path: Path) -> None:  # noqa: F811
    with calibrated(settings, tmp_path, 0.0, lookahead=32, plan="streamed") as gw:
        body = {"model": "auto", "messages": [{"role": "user", "content": FAILS}], "max_tokens": 3, "stream": True}
        with gw.client(gw.tenant_key) as c, c.stream("POST", "/v1/chat/completions", json=body) as r:
            lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
            status, headers = r.status_code, dict(r.headers)
        assert status == 200 and headers["x-tiergate-cascade"] == "small->mid failed (context_length_exceeded)", lines
        assert lines[-1] == "[DONE]"
        chunks = [json.loads(line) for line in lines[:-1]]
        choices = [ch["choices"][0] for ch in chunks if ch["choices"]]
        text = "".join(choice["delta"].get("content") or "" for choice in choices)
        finishes = [choice["finish_reason"] for choice in choices if choice["finish_reason"]]
        assert text == "uns" and finishes == ["length"], chunks
        rows = rows_by_tier(gw)
        assert (rows["small"].status, rows["small"].http_status, rows["small"].finish_reason) == ("ok", 200, "length")
        assert (rows["mid"].status, rows["mid"].http_status) == ("error", 400)


def test_an_answer_the_look_ahead_cut_gives_the_retrys_error_when_the_retry_fails(
        settings: tuple[Settings, StubState], tmp_path: Path) -> None:  # noqa: F811
    with calibrated(settings, tmp_path, 0.0, lookahead=2) as gw:
        r = chat(gw, FAILS, max_tokens=64)
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
        rows = rows_by_tier(gw)
        assert rows["small"].finish_reason == "cascaded" and rows["mid"].status == "error"
