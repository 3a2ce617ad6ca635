"""A key revoked while a stream of its is open ends that stream: a leaked key's long answers do not run on for the
rest of their `max_tokens` after an admin revokes it. The stream ends with OpenAI's error event (`api_key_revoked`),
the upstream call is cancelled and the tokens that ran are billed, as when a client leaves."""

from __future__ import annotations

import json
import threading
import time

import pytest

import gateway.auth as auth
from tests.conftest import Gateway

SLOW = {"model": "mid", "messages": [{"role": "user", "content": "STUB:slow"}], "stream": True}  # a word per 0.2 s


def test_revoking_a_key_ends_its_open_stream(gateway: Gateway, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(auth, "KEY_RECHECK_S", 0.0)  # look again at every event, not once a second
    key, plaintext = gateway.store.issue_key("acme", name="leaked")
    with gateway.client(plaintext) as c, c.stream("POST", "/v1/chat/completions", json=SLOW) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(4)]  # role chunk, blank, first word, blank
        assert any("Hello" in line for line in got)
        with gateway.client(gateway.admin_key) as admin:
            assert admin.post(f"/admin/keys/{key.key_id}/revoke").status_code == 200
        rest = [line[6:] for line in lines if line.startswith("data: ")]
    assert rest and rest[-1] != "[DONE]", rest
    assert json.loads(rest[-1])["error"]["code"] == "api_key_revoked"
    deadline = time.time() + 5
    while time.time() < deadline and not (gateway.ledger_rows() and gateway.stub.finished):
        time.sleep(0.05)
    (row,) = gateway.ledger_rows()
    assert row.key_id == key.key_id and row.status == "cancelled" and row.output_tokens >= 1
    assert gateway.stub.finished == ["disconnected"]


def test_revoking_a_key_ends_its_answer_in_progress_with_a_401(gateway: Gateway,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(auth, "KEY_RECHECK_S", 0.0)
    key, plaintext = gateway.store.issue_key("acme", name="leaked")
    revoke = threading.Timer(0.5, gateway.store.revoke_key, (key.key_id,))  # as the CLI does, mid-answer
    revoke.start()
    with gateway.client(plaintext) as c:
        r = c.post("/v1/chat/completions", json={**SLOW, "stream": False})
    revoke.join()
    assert r.status_code == 401 and r.json()["error"]["code"] == "api_key_revoked", r.text
    deadline = time.time() + 5
    while time.time() < deadline and not gateway.ledger_rows():
        time.sleep(0.05)
    (row,) = gateway.ledger_rows()
    assert row.status == "cancelled" and row.output_tokens >= 1
