"""How a Redis failure becomes the quota store's: back-pressure (no free connection), transient (a timeout), one
request's own (a script's error: `QuotaScriptError`), or an outage (anything else), in one place (`backend_error`)."""

from __future__ import annotations

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import MaxConnectionsError, RedisError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeout

from quotas.backends.base import QuotaBackendError


class QuotaScriptError(QuotaBackendError):
    """Redis answered, with an error a script raised itself (a command inside it refused, as INCRBY past int64 did, or
    Lua's own): that request's failure, which its client sees as a retryable 503, not Redis down for everyone (the
    failover does not count it in a streak, nor fails over on it)."""


# the codes of errors a script's command can raise that say Redis itself cannot serve (MISCONF: it refuses writes
# since a save failed; NOREPLICAS: min-replicas-to-write, too few replicas in touch), not that this request's keys
# or arguments are wrong. (redis-py raises READONLY, LOADING, OOM, MASTERDOWN, CLUSTERDOWN and TRYAGAIN as
# ResponseError's subclasses, outages already; NOTBUSY and UNBLOCKED answer SCRIPT KILL and blocked clients, never a
# script's command.)
_OUTAGE_CODES = frozenset({"MISCONF", "NOREPLICAS", "BUSY", "MASTERDOWN", "CLUSTERDOWN", "TRYAGAIN"})


def backend_error(exc: RedisError) -> QuotaBackendError:
    """The one place a Redis failure becomes ours: no free connection is back-pressure, a timeout is
    transient, a script's own error (its line in the answer, `@user_script:`) the request's (`QuotaScriptError`),
    anything else (refused, reset, READONLY, LOADING, BUSY, OOM, MISCONF, NOREPLICAS) is an outage."""
    if isinstance(exc, MaxConnectionsError) or (
            isinstance(exc, RedisConnectionError) and str(exc) == "No connection available."):
        return QuotaBackendError(f"redis: every connection busy ({exc})", transient=True, back_pressure=True)
    if (type(exc) is ResponseError and "@user_script:" in str(exc)
            and (getattr(exc, "status_code", None) or str(exc).split(" ", 1)[0]) not in _OUTAGE_CODES):
        return QuotaScriptError(f"redis: a script failed ({exc})")
    return QuotaBackendError(f"redis: {exc}", transient=isinstance(exc, RedisTimeout))
