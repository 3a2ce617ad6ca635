"""Refusals before a reservation: each counted once (metrics and the ledger's refusal counts), as the error
the client gets. Whatever a check raises, the client sees it in OpenAI's shape (`client_error`).

A refusal that is the request's own fault (`tenants_fault`) is also charged to its tenant (`charge`: the gate's
bucket of refused requests, gateway/pipeline/gate.py): it cost the gateway its parse and whatever was done before
it was refused (routing, a prompt's count) and charges nothing else, so without it a tenant could have the gateway
do that work for it without end."""

from __future__ import annotations

import time
from collections.abc import Callable
from types import TracebackType

from gateway.errors import TiergateError, client_error
from gateway.metrics import GatewayMetrics
from gateway.pipeline.context import RequestContext
from gateway.pipeline.limit_errors import NeverAdmitted
from quotas.ledger import Ledger, Refusal


class RefusalLog:
    def __init__(self, *, ledger: Ledger, metrics: GatewayMetrics) -> None:
        self.ledger = ledger
        self.metrics = metrics

    def counted(self, ctx: RequestContext, charge: Callable[[TiergateError], None] | None = None) -> Counted:
        """Count a refusal raised inside the block, and raise it as the client's error; `charge(err)` it first
        when it is the tenant's fault."""
        return Counted(self, ctx, charge)

    def refuse(self, ctx: RequestContext, exc: Exception, charge: Callable[[TiergateError], None] | None) -> \
            TiergateError:
        """`exc` counted as a refusal (charged to the tenant where it is its fault): the client's error for it."""
        err = client_error(exc)
        if charge is not None and tenants_fault(err):
            charge(err)
        reason = err.code or type(err).__name__
        self.metrics.refused(reason)
        self.ledger.submit_refusal(Refusal(ctx.request_id, time.time(), ctx.tenant, ctx.key_id, reason,
                                           err.status_code))
        return err


class Counted:
    """`RefusalLog.counted`'s block: a class rather than a `contextmanager` generator, which cost every request
    a generator and its helper object per block (three blocks a request, ~1.5 us each, on the path every answer
    takes); the same refusals counted and raised."""

    __slots__ = ("charge", "ctx", "log")

    def __init__(self, log: RefusalLog, ctx: RequestContext, charge: Callable[[TiergateError], None] | None) -> None:
        self.log, self.ctx, self.charge = log, ctx, charge

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> bool:
        if not isinstance(exc, Exception):  # none, or a cancellation or exit: not a refusal
            return False
        err = self.log.refuse(self.ctx, exc, self.charge)
        if err is exc:
            return False  # raised on as it is
        raise err from exc


def tenants_fault(err: TiergateError) -> bool:
    """A refusal the request itself earned: any 4xx but a 401 (no tenant to charge) and a 429 (a limit's own
    refusal, which its limit already counts); and the 429 of a request no window or budget could ever admit
    (limit_errors.py `NeverAdmitted`), which no limit counts: it uses nothing up, so its scope's other requests go on
    (the gate no longer refuses them for a second after one), and a flood of them empties the tenant's bucket here
    as a flood of prompts too long for the context does."""
    return (400 <= err.status_code < 500 and err.status_code not in (401, 429)) or isinstance(err, NeverAdmitted)
