"""Which version answers a conversation: a pure function of the rollout and the conversation, so nothing is stored.

A conversation is the tiers' affinity key (tiers/replica_choice.py): the client's `x-tiergate-session`, else a
hash of the tenant and the messages up to the first user turn, which every later turn repeats. It falls in one of
10,000 buckets, salted by the rollout's id (each rollout draws its own canary, so the same conversations are not
always the first to get a new version). During a canary a conversation is on the candidate iff its bucket is
below share x 10,000, or its tenant is named: its later turns land in the same bucket and follow the first, and
raising the share only moves conversations from the old version to the new one, never back. `full` puts everyone
on the candidate; `rolled_back` and `shadow` everyone on the baseline (a shadow only copies a sample of requests to
the candidate, off the response's path: `sampled`). `paused` holds the canary as it is (the same
conversations stay where they are; the share cannot be raised until it is promoted again).

A client picks its sessions and reads each answer's version (`x-tiergate-model-version`), so it can find which of
its conversations the candidate answers and choose what it sends there: no keying of the bucket hides that while
the header is sent. The guards are built for it (guards.py: one tenant's outcomes do not decide).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence

from gateway.rollout.state import Rollout
from tiers.replica_choice import affinity_key

BUCKETS = 10_000


def conversation_id(tenant: str, messages: Sequence[Mapping[str, object]], session: str | None = None) -> str:
    """The conversation a request belongs to (its replica-affinity key)."""
    return affinity_key(tenant, messages, session)


def bucket(conversation: str, rollout_id: str) -> int:
    """The conversation's bucket in this rollout, 0 to BUCKETS - 1, uniform over conversations."""
    digest = hashlib.blake2b(f"{rollout_id}\x00{conversation}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") % BUCKETS


def on_candidate(rollout: Rollout, tenant: str, conversation: str) -> bool:
    """Whether the rollout's candidate answers this conversation."""
    if rollout.stage == "full":
        return True
    if rollout.stage in ("rolled_back", "shadow"):
        return False
    return tenant in rollout.tenants or bucket(conversation, rollout.id) < round(rollout.share * BUCKETS)


def version_for(rollout: Rollout, tenant: str, conversation: str) -> str:
    """The version that answers this conversation under the rollout."""
    return rollout.candidate if on_candidate(rollout, tenant, conversation) else rollout.baseline


def sampled(rollout: Rollout, request_id: str) -> bool:
    """Whether a shadow copies this request to the candidate: a hash of its id below the shadow share."""
    return rollout.stage == "shadow" and bucket(request_id, rollout.id) < round(rollout.shadow * BUCKETS)
