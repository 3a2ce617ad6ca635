"""An attempt at answering, as the stages before the call leave it: what the call and settle stages take."""

from __future__ import annotations

from dataclasses import dataclass, field
from decimal import Decimal

from gateway.pipeline.cache_lookup import CacheLookup
from gateway.pipeline.idempotency import Keep
from gateway.pipeline.prompt import Prompt
from gateway.pipeline.route import RouteDecision
from quotas.reservations import Reservation
from wire.chat_request import ChatCompletionRequest


@dataclass(frozen=True)
class Attempt:
    """One try at answering, as the stages before the call left it: what settle needs besides the outcome."""

    request_id: str  # the request's id; a cascade's second attempt has its own
    route: RouteDecision
    reservation: Reservation
    lookup: CacheLookup
    applied: tuple[str, ...]  # degradation actions that shaped it
    hit_price: Decimal | None = None  # set when the answer comes from the cache
    cascade_of: str | None = None  # the first attempt's request id, on a cascade's second attempt
    cap_by_context: bool = False  # its output cap is what the tier's context had left
    extra_reason: tuple[str, ...] = field(default=())  # added to the route reason (the cascade's verdict)
    final: bool = True  # its answer is the client's (False: a cascade's first attempt that is retried)

    @property
    def is_cache_hit(self) -> bool:
        return self.hit_price is not None


@dataclass(frozen=True)
class Prepared:
    """A request that passed every check and holds its reservation: ready to be answered."""

    req: ChatCompletionRequest  # as the tier gets it (the ladder's input cap applied)
    attempt: Attempt
    prompt: Prompt | None  # None for a cache hit
    keep: Keep | None = None  # the request's Idempotency-Key claim: its final answer is stored
