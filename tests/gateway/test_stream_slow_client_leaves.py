"""A streamed answer whose client leaves while a chunk waits to be sent (a slow reader: the server's flow control holds
the send) is settled when its response ends, not when the garbage collector frees its generators.

Litestar's streaming response cancels its sending task when the client disconnects and leaves the answer's iterator
where it was, suspended at a `yield`; the pipeline's `finally` (the settle, the gate's place) then ran only once the
iterator was collected, and the iterator sat in a reference cycle through the cancellation's traceback. Until a
collection the tenant's concurrency slot, the tier's dispatch slot and the quota reservation stayed held (a tenant
allowed one request at a time was refused 429 meanwhile), the upstream went on generating, and no row was written.
The garbage collector is off during the test so that it cannot settle the request for the gateway.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from tests.gateway.cancel_sweep import WORDS, InProcessGateway

pytestmark = pytest.mark.asyncio(loop_scope="module")


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def gw(tmp_path_factory: pytest.TempPathFactory, prepared_models: Path) -> AsyncIterator[InProcessGateway]:
    async with InProcessGateway(tmp_path_factory.mktemp("slow"), prepared_models) as gateway:
        yield gateway


@pytest.mark.parametrize("leave_at", range(1, len(WORDS) + 3))  # the role chunk, each word, the finish (then [DONE])
async def test_a_slow_client_leaving_mid_stream_is_settled_with_its_response(gw: InProcessGateway, leave_at: int,
                                                                             no_collections: None) -> None:
    answer = await gw.request({"model": "mid", "stream": True, "messages": [
        {"role": "user", "content": f"a slow reader leaving at {leave_at}"}]}, leave_at_body=leave_at)
    assert answer.status == 200
    await gw.assert_left_settled(answer)
    again = await gw.request({"model": "mid", "messages": [{"role": "user", "content": "and the next one"}]})
    assert again.status == 200, again.body  # the plan allows one request at a time: the slot is free
