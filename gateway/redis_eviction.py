"""Start-up refuses a Redis that may evict the gateway's keys on its own.

Quota counters and reservations, idempotency records, the ladder's level and the cache's entries (with the
per-tenant entry and byte counts its Lua scripts keep) live in the one Redis of TIERGATE_REDIS_URL. A server with a
`maxmemory` and any `maxmemory-policy` but `noeviction` drops keys when it is full: an evicted counter or
reservation silently forgives spend or frees concurrency, an evicted cache entry leaves its tenant's byte count
inflated for good. Most of our keys carry a TTL (windows, day and month spend, reservations, idempotency records),
so the volatile-* policies evict them too. With `noeviction` a full Redis refuses writes instead, which the gateway
sees as a Redis fault (TIERGATE_REDIS_FAILURE_MODE) and nothing is lost.

TIERGATE_REDIS_ALLOW_EVICTION=1 starts anyway, with a warning. A server that refuses CONFIG (a managed Redis renames
or forbids it) or cannot be reached now (the gateway starts without Redis by design) is a warning that the policy
was not checked. Nothing logged or raised here holds the URL's password (`redacted`).
"""

from __future__ import annotations

import logging

import redis
from redis.exceptions import RedisError, ResponseError

from gateway.settings import Settings
from quotas.fault_log import redacted

log = logging.getLogger("tiergate.gateway")

CHECK_TIMEOUT_S = 2.0  # connect and answer; one round trip at start-up, not a request's budget (redis_timeout_s)
SAFE_POLICY = "noeviction"
# the fix a refusal names (start-up's error; the running gateway's not-ready reason)
FIX = ("set `maxmemory-policy noeviction` on that Redis (redis.conf, or CONFIG SET maxmemory-policy noeviction), or "
       "TIERGATE_REDIS_ALLOW_EVICTION=1 to run anyway")


class RedisEvicts(Exception):
    """The Redis of TIERGATE_REDIS_URL may evict keys (a maxmemory and an evicting policy): start-up stops with this
    one line, which names the setting and the fix."""


def check_redis_eviction(settings: Settings) -> None:
    """Raises `RedisEvicts` when the gateway's Redis may evict its keys and the operator has not allowed it; logs one
    warning when it was allowed, or when the policy could not be read. Nothing to do without TIERGATE_REDIS_URL."""
    if not settings.redis_url:
        return
    where = redacted(settings.redis_url)
    try:
        policy, maxmemory = _read_policy(settings.redis_url)
    except ResponseError as exc:  # CONFIG renamed away or denied by an ACL: a managed Redis, most often
        log.warning("could not check the maxmemory-policy of Redis at %s (CONFIG GET answered: %s); it must be "
                    "`noeviction`, or evicted keys forgive spend and corrupt the cache's counts: check it with your "
                    "provider", where, redacted(str(exc)))
        return
    except (RedisError, OSError) as exc:  # down now: the gateway starts without it (TIERGATE_REDIS_FAILURE_MODE)
        log.warning("could not check the maxmemory-policy of Redis at %s (%s); it must be `noeviction`", where,
                    redacted(f"{type(exc).__name__}: {exc}"))
        return
    if policy is None or maxmemory is None:  # answered, but without the settings (some proxies)
        log.warning("could not check the maxmemory-policy of Redis at %s (CONFIG GET did not return it); it must be "
                    "`noeviction`", where)
        return
    problem = eviction_problem(where, policy, maxmemory)
    if problem is None:
        return
    if settings.redis_allow_eviction:
        log.warning("%s; starting anyway (TIERGATE_REDIS_ALLOW_EVICTION=1)", problem)
        return
    raise RedisEvicts(f"{problem}; {FIX}")


def eviction_problem(where: str, policy: str, maxmemory: int) -> str | None:
    """What is wrong with a Redis running `policy` under `maxmemory` bytes (one line, `where` already redacted), or
    None when it never evicts: start-up and the running gateway's watch (redis_eviction_watch.py) judge alike."""
    if policy == SAFE_POLICY or maxmemory == 0:  # no limit: nothing is ever evicted
        return None
    return (f"Redis at {where} (TIERGATE_REDIS_URL) runs with maxmemory {maxmemory} and maxmemory-policy {policy}: "
            "when full it evicts quota counters, reservations, idempotency records and cache entries, forgiving "
            "spend and leaving cache counts wrong")


def _read_policy(url: str) -> tuple[str | None, int | None]:
    """(maxmemory-policy, maxmemory in bytes) as the server answers CONFIG GET; None for one it did not return."""
    client = redis.Redis.from_url(url, socket_timeout=CHECK_TIMEOUT_S, socket_connect_timeout=CHECK_TIMEOUT_S,
                                  decode_responses=True)
    try:
        return parse_policy(client.config_get("maxmemory*"))
    finally:
        client.close()


def parse_policy(config: dict[str, str]) -> tuple[str | None, int | None]:
    """(maxmemory-policy, maxmemory in bytes) from a CONFIG GET answer; None for one it lacks (some proxies)."""
    maxmemory = config.get("maxmemory")
    return config.get("maxmemory-policy"), int(maxmemory) if maxmemory is not None and maxmemory.isdigit() else None
