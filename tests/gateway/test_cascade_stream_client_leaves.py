"""A streamed `auto` answer under a plan's cascade whose client leaves mid-stream is settled when its response ends,
as a plain stream's is (tests/gateway/test_stream_slow_client_leaves.py), not later by the event loop's finalizer.

The cascade wraps the pipeline's `answer` generators and yields their events; closed at a `yield` (the client left),
it left its attempt's generator suspended, and that attempt's `finally` (the settle, the tier's dispatch slot, the
upstream's connection) ran only once the garbage collector or asyncio's async-generator finalizer got to it: after
the request had ended and had left the tenant's gate, so the tenant's next request found the slot of the one before
still held (a plan allowing one request at a time refused it, 429), and shutdown's drain did not wait for it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from tests.gateway.cancel_sweep import WORDS, InProcessGateway

pytestmark = pytest.mark.asyncio(loop_scope="module")

PLANS = """
default_plan: swept
plans:
  swept:
    allowed_tiers: [mid]
    default_tier: mid
    limits: {max_concurrent: 1, tpm: 10000000, budget_day_usd: "1000"}
    routing: {cascade: true, cascade_streams: true}
    cache: {shadow_check_rate: 0}
"""


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def gw(tmp_path_factory: pytest.TempPathFactory, prepared_models: Path) -> AsyncIterator[InProcessGateway]:
    async with InProcessGateway(tmp_path_factory.mktemp("cascade"), prepared_models, plans=PLANS) as gateway:
        yield gateway


@pytest.mark.parametrize("leave_at", range(1, len(WORDS) + 3))  # the role chunk, each word, the finish (then [DONE])
async def test_a_cascaded_stream_whose_client_leaves_is_settled_with_its_response(
        gw: InProcessGateway, leave_at: int, no_collections: None) -> None:
    answer = await gw.request({"model": "auto", "stream": True, "messages": [
        {"role": "user", "content": f"a cascaded stream left at {leave_at}"}]}, leave_at_body=leave_at)
    assert answer.status == 200
    await gw.assert_left_settled(answer)
    again = await gw.request({"model": "auto", "stream": True, "messages": [
        {"role": "user", "content": "and the next one"}]})
    assert again.status == 200 and again.complete, again.body  # one request at a time: the slot is free
