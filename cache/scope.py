"""Cache scopes: the boundary no cache hit may ever cross.

An entry is reusable only by a request that would have produced it: the same tenant, the same identity
snapshot (key roles, and the end user where the tenant isolates users), the same data version, the same
model version, the same system prompt, tools and output-shaping parameters, and the same sampling class.
All of these are fields of `CacheScope`; its `scope_id` names the partition an entry lives in, so a lookup
can only ever see entries of its own scope. Bumping a version yields a new `scope_id`, which makes the
older entries unreachable at once (they are reclaimed later, see `SemanticCache.bump_data_version`).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from cache.request_key import context_hash, sampling_class

# keeps ("a", "bc") apart from ("ab", "c"). Only the identity can hold it (an end user's id, as the tenant sends it);
# no other field can (tenant names, data versions as the header's pattern allows, digests), so a joined string still
# splits one way only: the tenant is what comes before the first separator, the four fields after the identity what
# comes after the last four, and the identity what is left between
_SEP = "\x1f"


def identity_snapshot(roles: Iterable[str] = (), end_user: str | None = None,
                      safety_identifier: str | None = None) -> str:
    """A canonical string for who is asking: the key's roles/scopes (order-free) and, optionally, the end user as
    the request names them (OpenAI's `user`, and `safety_identifier`, which it recommends instead).

    Pass the end user's fields only when the tenant isolates its users; otherwise users of one tenant share answers.
    """
    parts = ",".join(sorted({r.strip() for r in roles if r.strip()}))
    if safety_identifier is not None:  # both ids, unambiguously (a `user` value cannot forge this form)
        return f"roles={parts};users={json.dumps([end_user, safety_identifier])}"
    return f"roles={parts};user={end_user}" if end_user is not None else f"roles={parts}"


def end_user_snapshot(end_user: str | None = None, safety_identifier: str | None = None) -> str | None:
    """The end user alone, as `identity_snapshot` names them (None: the request names none). Where a plan isolates
    its users, what a request leaves behind that makes a later one faster (a remembered vector or count, a prefix
    in an engine's cache) is kept for the tenant and this end user: another end user could time it."""
    if safety_identifier is not None:
        return f"users={json.dumps([end_user, safety_identifier])}"
    return f"user={end_user}" if end_user is not None else None


@dataclass(frozen=True, slots=True)
class CacheScope:
    """Everything besides the conversation that an answer depends on; entries never cross scopes."""

    tenant: str
    identity: str  # from identity_snapshot()
    data_version: int | str  # the tenant's data version (admin bump, or X-Tiergate-Data-Version)
    model_version: str  # fingerprint of the tier's weights, quantization and engine version
    context_hash: str  # system prompt, tools and output-shaping parameters (request_key.context_hash)
    sampling_class: str  # "greedy" or "seed:<n>:temperature=<t>:top_p=<p>:top_k=<k>" (request_key.sampling_class)
    end_user: str | None = None  # end_user_snapshot() where the identity holds one (already in `identity`)

    @property
    def scope_id(self) -> str:
        """A stable 32-hex-digit id: equal for equal scopes, across processes and restarts."""
        fields = (self.tenant, self.identity, f"{type(self.data_version).__name__}:{self.data_version}",
                  self.model_version, self.context_hash, self.sampling_class)
        return hashlib.sha256(_SEP.join(fields).encode()).hexdigest()[:32]

    @classmethod
    def for_request(cls, request: Mapping[str, Any], *, tenant: str, roles: Iterable[str] = (),
                    end_user: str | None = None, safety_identifier: str | None = None,
                    data_version: int | str = 0, model_version: str,
                    hashed: tuple[str, str] | None = None) -> CacheScope:
        """The scope of an OpenAI chat request: derives the context hash and sampling class from its body
        (`hashed`: the two, `body_hashes(request)`, where the caller has them already)."""
        context, sampling = body_hashes(request) if hashed is None else hashed
        return cls(tenant=tenant, identity=identity_snapshot(roles, end_user, safety_identifier),
                   data_version=data_version, model_version=model_version, context_hash=context,
                   sampling_class=sampling, end_user=end_user_snapshot(end_user, safety_identifier))


def body_hashes(request: Mapping[str, Any]) -> tuple[str, str]:
    """What a request's scope reads of its body: its context hash and sampling class."""
    return context_hash(request), sampling_class(request)
