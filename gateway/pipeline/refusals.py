"""Refusals before a reservation: each counted once (metrics and the ledger's refusal counts), as the error
the client gets. Whatever a check raises, the client sees it in OpenAI's shape (`client_error`)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

from gateway.errors import client_error
from gateway.metrics import GatewayMetrics
from gateway.pipeline.context import RequestContext
from quotas.ledger import Ledger, Refusal


class RefusalLog:
    def __init__(self, *, ledger: Ledger, metrics: GatewayMetrics) -> None:
        self.ledger = ledger
        self.metrics = metrics

    @contextmanager
    def counted(self, ctx: RequestContext) -> Iterator[None]:
        """Count a refusal raised inside the block, and raise it as the client's error."""
        try:
            yield
        except Exception as exc:
            err = client_error(exc)
            reason = err.code or type(err).__name__
            self.metrics.refused(reason)
            self.ledger.submit_refusal(Refusal(ctx.request_id, time.time(), ctx.tenant, ctx.key_id, reason,
                                               err.status_code))
            if err is exc:
                raise
            raise err from exc
