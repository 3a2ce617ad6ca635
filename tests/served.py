"""`tiergate serve` in a child process beside a stub upstream, for the end-to-end tests that need the whole product
(real local engines, the supervisor, the banner's keys)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from bench.serve_gateway import Started, tiergate_serve
from tests.conftest import MODELS_DIR, PLANS_YAML
from tests.stubs import ServerThread, StubState, free_port, stub_app


@contextmanager
def serve_beside_a_stub(tmp: Path, tiers: str, ladder: str) -> Iterator[tuple[str, Started]]:
    """The gateway's URL and process, with `tiers` (a template with `{stub}` for the stub's URL), the tests' plans
    and `ladder`, its data under `tmp / "data"`; both stop when the block ends."""
    stub = ServerThread(stub_app(StubState())).start()
    (tmp / "tiers.yaml").write_text(tiers.format(stub=stub.url))
    (tmp / "plans.yaml").write_text(PLANS_YAML)
    (tmp / "ladder.yaml").write_text(ladder)
    port = free_port()
    env = os.environ | {"TIERGATE_MODELS_DIR": str(MODELS_DIR), "TIERGATE_DATA_DIR": str(tmp / "data"),
                        "TIERGATE_PORT": str(port), "TIERGATE_TIERS_FILE": str(tmp / "tiers.yaml"),
                        "TIERGATE_PLANS_FILE": str(tmp / "plans.yaml"),
                        "TIERGATE_LADDER_FILE": str(tmp / "ladder.yaml"), "TIERGATE_BUILD_MISSING_MODELS": "0"}
    try:
        with tiergate_serve(env, ready_timeout_s=300) as started:
            yield f"http://127.0.0.1:{port}", started
    finally:
        stub.stop()
