"""Embeddings requests whose client leaves mid-answer, for the tests that hold a stage in its thread: the request
sent on a raw connection that closes once the held stage has begun, and the ledger rows it left."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Callable
from typing import Any

from tests.conftest import Gateway


def send_and_leave(gw: Gateway, body: dict[str, Any], headers: dict[str, str], begun: Callable[[], bool],
                   what: str, timeout_s: float = 60) -> None:
    """POST `body` to /v1/embeddings on a raw connection with `headers`, and close it once `begun()` says the held
    stage started (`what`: that stage, for the failure's message)."""
    raw = json.dumps(body).encode()
    host, port = gw.url.removeprefix("http://").split(":")
    head = "".join(f"{k}: {v}\r\n" for k, v in {"Host": "gw", "Authorization": f"Bearer {gw.tenant_key}",
                                                 "Content-Type": "application/json",
                                                 "Content-Length": str(len(raw)), **headers}.items())
    with socket.create_connection((host, int(port))) as s:
        s.sendall(f"POST /v1/embeddings HTTP/1.1\r\n{head}\r\n".encode() + raw)
        deadline = time.time() + timeout_s
        while not begun() and time.time() < deadline:
            time.sleep(0.01)
        assert begun(), f"{what} never began"


def rows_not_ok(gw: Gateway, timeout_s: float = 10) -> list[Any]:
    """The ledger rows not `ok`, once there are some (empty after `timeout_s`)."""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if rows := [r for r in gw.ledger_rows() if r.status != "ok"]:
            return rows
        time.sleep(0.05)
    return []
