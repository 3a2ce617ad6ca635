"""Idempotency-Key records, as Stripe defines them: per tenant, a key's first request runs and its answer is
stored; a retry with the same key and body gets that answer again, charged nothing more. This module holds what every
store shares: the records a claim returns, the bounds of what one tenant may hold (`Limits`), the stores' interface
(`IdempotencyStore`), and how a stored answer is encoded.

A record is `running` (claimed by one request, with a lease, so a crashed owner does not hold the key
forever) or `done` (the stored answer, kept for the plan's TTL). The key's fingerprint is the request's
canonical body, so the same key with another body is told apart.

Three stores behind one interface:
- `SQLiteIdempotency` (embedded, quotas/idempotency_sqlite.py): a table in the ledger's database; a `done` record
  commits in the same transaction as the answer's ledger row (`finish_with_row` gives the statement the ledger runs
  with the row), so a row and its stored answer are durable together or not at all.
- `PostgresIdempotency` (a fleet, quotas/idempotency_postgres.py): the same table in the fleet database, beside the
  ledger's tables; a claim is one statement on a connection of the async pool, and the `done` record commits with the
  ledger row, as in SQLite, so any replica replays an answer whose row any replica wrote.
- `RedisIdempotency` (replicas, quotas/idempotency_redis.py): the record in Redis, claimed and finished by Lua
  scripts, so a replica that did not serve the first request replays it too. Its answer is stored after its row is
  durable, not with it: a claim whose owner died in between is looked up in the gateway's ledger (`rows`) once its
  lease ends, and a retry is told it ran and was billed (`lost()`), never run again. A claim made by a gateway that
  writes another ledger (replicas with a SQLite file each: quotas/ledger_identity.py tells them apart) cannot be
  looked up: its retry is told that (`unknown()`), never run again under the key either.

What one tenant may hold is bounded (`Limits`), on every store: every key stores a copy of its answer for the TTL
(24 h), and a cached answer repeated under fresh keys is free, so without a bound one tenant's records could fill
the disk the ledger writes to, for every tenant. A new key is refused (`Full`, a 429 before any work) while the
tenant's live records reach `records`, or their stored answers `bytes`; expired records do not count, and a
replay or a retry of a key already held is never refused. An answer over `answer_bytes` is not stored, but its key
is kept as answered: a small record (`NOT_KEPT`, with the answer's size) takes the answer's place, committed with its
ledger row, so a retry with the key is told it ran and was too large to keep (the gateway's 409), never run and
charged again. Given up instead, as it was, every retry of such an answer (a long one with log-probabilities) ran
and was charged once more.
The count is kept where a new key is claimed, so it costs the hot path no scan: SQLite keeps per-tenant totals by
triggers, Redis a per-tenant sorted set of live keys and a hash of their sizes, PostgreSQL a totals row per tenant
kept by triggers, which a claim of a new key locks while it checks and inserts (quotas/idempotency_totals.py). Each
is exact: SQLite and Redis serialize claims, PostgreSQL a tenant's claims of new keys. Expired records count until
deleted: a tenant at its bound deletes its own before it is refused.
"""

from __future__ import annotations

import asyncio
import logging
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec

from quotas.ledger import Statement

if TYPE_CHECKING:
    from quotas.ledger import Ledger

log = logging.getLogger("tiergate.idempotency")

PRUNE_EVERY = 1000  # claims between deletions of expired records
# a tenant's bounds (the gateway's Settings do not carry them yet: these constants are what it runs with)
MAX_RECORDS_PER_TENANT = 10_000  # live keys (running or done)
MAX_BYTES_PER_TENANT = 256 * 1024 * 1024  # stored answers of its live keys (UTF-8 JSON)
MAX_ANSWER_BYTES = 4 * 1024 * 1024  # one stored answer (the largest request body the gateway accepts, too)


@dataclass(frozen=True)
class Claim:
    """This request owns the key: it runs, and its answer is stored (or the claim abandoned)."""

    tenant: str
    key: str
    fingerprint: str
    owner: str  # the request id that claimed it


@dataclass(frozen=True)
class Replay:
    """The key's first request finished: its answer, to be sent again."""

    answer: dict[str, Any]


@dataclass(frozen=True)
class Running:
    """The key's first request is still running."""


@dataclass(frozen=True)
class Mismatch:
    """The key was used with another request body."""


@dataclass(frozen=True)
class Full:
    """The tenant holds as many live records (or stored bytes) as it may: a new key waits until some expire."""

    retry_after_s: float  # until the tenant's first live record expires


Begun = Claim | Replay | Running | Mismatch | Full


@dataclass(frozen=True)
class Limits:
    """What one tenant may hold: a new key is refused at `records` live records or `bytes` stored; an answer over
    `answer_bytes` is not stored (`NOT_KEPT` stands in for it). The bytes may be passed by the answers of claims in
    flight (each under `answer_bytes`): a claim is checked before its answer exists."""

    records: int = MAX_RECORDS_PER_TENANT
    bytes: int = MAX_BYTES_PER_TENANT
    answer_bytes: int = MAX_ANSWER_BYTES

    def room(self, records: int, stored: int) -> bool:
        return records < self.records and stored < self.bytes


DEFAULT_LIMITS = Limits()
# what a `done` record holds in place of an answer over `Limits.answer_bytes`: {NOT_KEPT: its size in bytes}
NOT_KEPT = "tiergate_answer_not_kept"
# what a claim whose owner died after its answer's row committed answers instead (Redis, which stores the answer only
# after its row: quotas/idempotency_redis.py): {NOT_KEPT: 0, LOST: True}, the same 409 (it ran and was billed; its
# answer is lost), never run and billed again
LOST = "tiergate_answer_lost"


# what a claim whose owner died answers when that owner wrote a ledger this gateway cannot read (another host's
# SQLite file): {NOT_KEPT: 0, LOST: True, UNKNOWN: True}, a 409 too (whether it ran and was billed is not known here;
# it may have been, so it is not run again under the key). A gateway that knows only LOST words it as `lost()`.
UNKNOWN = "tiergate_outcome_unknown"


def lost() -> Replay:
    """What a retry is told of a key whose request ran and was billed, its answer lost with its gateway."""
    return Replay({NOT_KEPT: 0, LOST: True})


def unknown() -> Replay:
    """What a retry is told of a key whose request's gateway died and wrote its row, if any, in a ledger this gateway
    cannot read: it may have run and been billed there, so it is not run again under the key."""
    return Replay({NOT_KEPT: 0, LOST: True, UNKNOWN: True})


def not_kept(answer: dict[str, Any]) -> int | None:
    """The size of the answer a stored record stands in for (`NOT_KEPT`), or None: the record is the answer."""
    return answer.get(NOT_KEPT)


def _full(now: float, first_expires: float | None) -> Full:
    return Full(max(1.0, first_expires - now) if first_expires is not None else 1.0)


class IdempotencyStore(ABC):
    limits = DEFAULT_LIMITS  # what one tenant may hold (each store enforces it where a new key is claimed)
    # the gateway's ledger, set once it is open: where a store that stores an answer only after its row (Redis) looks
    # for the row of a claim whose owner died (the SQL stores commit the answer with its row: they need none)
    rows: Ledger | None = None

    @abstractmethod
    async def begin(self, tenant: str, key: str, fingerprint: str, owner: str, *, lease_s: float) -> Begun:
        """Claim `key` for `owner`, or say why not (its answer, still running, another body, no room for a new key)."""

    def finish_with_row(self, claim: Claim, answer: dict[str, Any], ttl_s: float) -> tuple[Statement, ...]:
        """Statements that store the answer in the same ledger transaction as its row (none: see `finish`)."""
        return ()

    async def finish(self, claim: Claim, answer: dict[str, Any], ttl_s: float) -> None:  # noqa: B027
        """Store the answer, for stores that cannot commit with the ledger row (called once it is durable)."""

    async def finish_alone(self, claim: Claim, answer: dict[str, Any], ttl_s: float) -> None:
        """Store an answer whose ledger row is already durable without it, in a write of its own (a cascade's first
        answer, which stands when its retry failed: gateway/pipeline/cascade.py). Raises if the store cannot."""
        await self.finish(claim, answer, ttl_s)

    @abstractmethod
    async def abandon(self, claim: Claim) -> None:
        """The request failed or its client left: a retry runs again."""

    async def renew(self, claim: Claim, lease_s: float) -> bool:
        """Extend `claim`'s lease to `lease_s` from now while its request runs, if the record is still its running
        claim (False when not: answered, given up, or taken over by another request after it expired). Without it an
        answer running past its lease (a long stream) let a retry with its key take the key over, run and be charged a
        second time (gateway/pipeline/idempotency.py renews it every third of the lease, and a renewal that raised a
        thirtieth later). False, or no renewal before the lease may end, and the gateway stops the request: a retry
        may take the key over. A store that cannot renew says False."""
        return False

    async def stored(self, tenant: str, key: str, fingerprint: str) -> Replay | Mismatch | None:
        """The key's stored answer (or Mismatch for another body), read only: nothing is claimed or written, so it is
        asked while the ledger cannot write (a replay writes no row); None when the key holds no answer (new, running
        or expired). A store that cannot read without writing says None: the request is refused as any other."""
        return None

    def finish_when_written(self, written: asyncio.Future[None], claim: Claim, answer: dict[str, Any],
                            ttl_s: float, *, give_up: GiveUp = None) -> None:
        """Follow the ledger row of `claim`'s answer (`written`, the ledger's future for it) still pending after the
        gateway's wait for it (gateway/pipeline/idempotency.py's `keep_when_written`), however late its fate is
        final, with no task held open meanwhile (a shutdown does not wait on it): a row that commits keeps the answer
        (`finish`; SQLite and PostgreSQL committed it with the row), a row refused for good gives the claim up, so a
        retry runs, unless `give_up(row)` says the claim is no longer the row's (a withdrawn row's, whose request
        still runs). The ledger settles every row's future: committed, refused, or failed as it closes."""
        written.add_done_callback(lambda row: _follow(self, row, claim, answer, ttl_s, give_up))

    async def close(self) -> None:  # noqa: B027
        """Release connections."""


# Whether a claim whose ledger row was refused is to be given up by the store's follower (`finish_when_written`)
GiveUp = Callable[[asyncio.Future[None]], bool] | None
_FOLLOWING: set[asyncio.Task[None]] = set()  # `finish_when_written`'s work, held until it ends


def _follow(store: IdempotencyStore, row: asyncio.Future[None], claim: Claim, answer: dict[str, Any],
            ttl_s: float, give_up: GiveUp = None) -> None:
    """`finish_when_written`'s end: the row's fate is final."""
    refused = row.cancelled() or row.exception() is not None
    if refused and give_up is not None and not give_up(row):
        return  # the claim is another's to keep or give up (its request's)
    task = asyncio.get_running_loop().create_task(store.abandon(claim) if refused else
                                                  store.finish(claim, answer, ttl_s))
    _FOLLOWING.add(task)
    task.add_done_callback(_followed)


def _followed(task: asyncio.Task[None]) -> None:
    _FOLLOWING.discard(task)
    if not task.cancelled() and (exc := task.exception()) is not None:
        log.error("keeping or giving up an Idempotency-Key after its late ledger row failed: %s", exc)


def _decoded(stored: str | bytes) -> Replay:
    """A stored answer to replay (msgspec: several times json.loads' speed on megabytes of logprobs)."""
    return Replay(msgspec.json.decode(stored))


def _kept(answer: dict[str, Any], limits: Limits) -> tuple[str, int]:
    """What a `done` record stores of `answer`, as JSON text, and its size: the answer, or over `limits.answer_bytes`
    the record that stands in for it (`NOT_KEPT`)."""
    text, size = _encoded(answer)
    return _encoded({NOT_KEPT: size}) if size > limits.answer_bytes else (text, size)


def _encoded(answer: dict[str, Any]) -> tuple[str, int]:
    """The answer as JSON text and its size in bytes (UTF-8), on the event loop: msgspec's encoder (Litestar's
    own), several times json.dumps' speed on an answer with logprobs (megabytes at 20 alternatives a token), the
    same value read back."""
    encoded = msgspec.json.encode(answer)
    return encoded.decode(), len(encoded)
