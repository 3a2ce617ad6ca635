"""A gateway whose tiers speak different dialects (`small` and `full` vLLMs, `mid`, the plans' default, a plain
OpenAI-compatible server), every tier the recording stub but `small`, whose stub answers nothing (an empty answer: a
cascade's retry): where the fields only some servers take (top_k, a text completion's response_format) are
tested."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tests.conftest import Gateway, running_gateway
from tests.stubs import LADDER_PLANS, LADDER_PRICES, ServerThread, StubState, openai_tiers, stub_app, write_settings

DIALECTS = {"small": "vllm", "mid": "openai", "full": "vllm"}


@contextmanager
def dialect_gateway(tmp_path: Path, prepared_models: Path,
                    dialects: dict[str, str] | None = None) -> Iterator[Gateway]:
    """The gateway (its tiers' dialects DIALECTS, or `dialects`); `gateway.mute` is the state of `small`'s stub."""
    state, mute = StubState(), StubState()
    spoken = DIALECTS if dialects is None else dialects
    with ServerThread(stub_app(state)).start() as stub, ServerThread(stub_app(mute, reply="")).start() as empty:
        tiers = {name: {**LADDER_PRICES[name], "dialect": dialect, "url": empty.url if name == "small" else stub.url}
                 for name, dialect in spoken.items()}
        settings = write_settings(tmp_path, prepared_models, openai_tiers(tiers), LADDER_PLANS)
        with running_gateway(settings, state) as gateway:
            gateway.mute = mute  # type: ignore[attr-defined]
            yield gateway


def key_of(gw: Gateway, plan: str) -> str:
    gw.store.create_tenant(plan, plan)
    return gw.store.issue_key(plan, name="test")[1]
