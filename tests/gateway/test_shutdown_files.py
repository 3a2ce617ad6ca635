"""A gateway that stops closes every file of its data directory it opened: the ladder's state store was left open
(four descriptors of state.db and its WAL files a gateway), so a process that starts gateways one after another, as
the test workers do, ran past 1,023 descriptors, where select() refuses them."""

from __future__ import annotations

import os
from pathlib import Path

from gateway.settings import Settings
from tests.conftest import running_gateway
from tests.stubs import ServerThread, StubState


def _open_under(directory: Path) -> list[str]:
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # closed since it was listed
            continue
        if target.startswith(str(directory)):
            found.append(target)
    return found


def test_a_stopped_gateway_holds_no_file_of_its_data_directory(gateway_settings: Settings,
                                                                stub: tuple[ServerThread, StubState]) -> None:
    with running_gateway(gateway_settings, stub[1]) as gw, gw.client(gw.tenant_key) as c:
        assert c.post("/v1/chat/completions", json={"model": "mid", "messages": [{"role": "user", "content": "hi"}],
                                                    "max_tokens": 2}).status_code == 200
        assert _open_under(gateway_settings.data_dir)  # the check sees them while it runs
    assert _open_under(gateway_settings.data_dir) == []
