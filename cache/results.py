"""What a lookup answers (`Hit`, `Miss`, `Bypass`), the tenant settings it follows, and the cache's counters."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from cache.request_key import RequestKey
from cache.store import Entry


@dataclass(frozen=True, slots=True)
class TenantPolicy:
    """A tenant's cache settings, owned by the caller (plans, tenant admin)."""

    enabled: bool = True  # False: the tenant opted out; nothing is looked up or stored
    semantic: bool = True  # False: exact hits only
    similarity_threshold: float = 0.8  # cosine a semantic candidate must reach before the guards see it
    ttl_s: float | None = 86_400.0  # None: entries live until evicted, purged or reclaimed
    pure_tools: frozenset[str] = frozenset()  # tools declared free of side effects; others make a request uncacheable
    # the error bound (cache/error_bound.py): the share of wrong semantic hits allowed (None: the static threshold
    # and the guards alone decide), and the share of semantic hits checked against a fresh answer to learn it
    max_error_rate: float | None = None
    shadow_rate: float = 0.0
    threshold_delta: float = 0.0  # the ladder's change to whichever threshold applies (learned or static)
    meaning_check: bool = False  # a candidate must also pass the cache's MeaningCheck (cache/meaning_check.py)


@dataclass(frozen=True, slots=True)
class Probe:
    """What a missed lookup already computed, handed to the store of the fresh answer so nothing is done twice."""

    key: RequestKey
    partition: str  # the faiss partition: scope id + history hash
    vector: np.ndarray | None = None  # the last user turn's embedding, None when the lookup did not need it


@dataclass(frozen=True, slots=True)
class Hit:
    """A cached answer valid for this request."""

    entry: Entry
    kind: Literal["exact", "semantic"]
    similarity: float  # 1.0 for exact hits
    status: Literal["hit"] = "hit"
    shadow_rate: float = 0.0  # sampled, at this rate, for a check against a fresh answer (the error bound's evidence)
    # this request's own prompt tokens, as the caller counted them before the lookup (None: not counted), which
    # `request_usage` reports instead of the stored ones
    counted_prompt: int | None = field(default=None, compare=False)

    @property
    def response(self) -> str:
        return self.entry.response

    @property
    def usage(self) -> dict[str, Any]:
        """The usage as stored, of the request that stored the answer: a semantic hit's `prompt_tokens` are another
        request's. What this request reports and is billed for is `request_usage`."""
        return self.entry.usage

    @property
    def request_usage(self) -> dict[str, Any]:
        """This request's usage: its own prompt's tokens, the stored answer's completion tokens and finish reason. An
        exact hit's prompt is the stored one's (the same request), counted as its tier reported it; a semantic hit's
        stored prompt is another request's (a paraphrase, of another length), not reported or billed to this one: its
        own count is (`counted_prompt`; where it was not counted, its tier's tokenizer not prepared, the stored
        count stands in: billed nothing for its prompt, it was under-billed)."""
        stored = self.entry.usage
        prompt = self.counted_prompt if self.kind == "semantic" else None
        if prompt is None:  # an exact hit; or a semantic one not counted: the stored count, the nearest estimate
            prompt = stored.get("prompt_tokens") or 0
        return {"prompt_tokens": int(prompt), "completion_tokens": int(stored.get("completion_tokens", 0)),
                "finish_reason": stored.get("finish_reason")}

    def headers(self) -> dict[str, str]:
        out = {"x-tiergate-cache": "hit", "x-tiergate-cache-kind": self.kind}
        if self.kind == "semantic":
            out["x-tiergate-cache-similarity"] = f"{self.similarity:.4f}"
        return out


@dataclass(frozen=True, slots=True)
class Near:
    """The nearest candidate the guards accepted, below the learned threshold: the tier answers the request, and
    its answer tells whether serving this one would have been right."""

    tenant: str
    similarity: float
    response: str


@dataclass(frozen=True, slots=True)
class Miss:
    """The request may use the cache, but nothing valid was found (`reason` says what came closest)."""

    reason: str  # "no entry", "below threshold (best 0.71)", "refused near miss: numbers differ (0.94)"
    best_similarity: float | None = None
    status: Literal["miss"] = "miss"
    probe: Probe | None = field(default=None, repr=False, compare=False)  # for `SemanticCache.remember`
    near: Near | None = field(default=None, repr=False, compare=False)  # to label against the fresh answer

    def headers(self) -> dict[str, str]:
        return {"x-tiergate-cache": "miss"}


@dataclass(frozen=True, slots=True)
class Bypass:
    """The cache was not consulted: `reason` is a cacheability rule, e.g. 'bypass: temperature>0 without seed'."""

    reason: str
    status: Literal["bypass"] = "bypass"

    def headers(self) -> dict[str, str]:
        return {"x-tiergate-cache": "bypass"}


LookupResult = Hit | Miss | Bypass


@dataclass
class CacheStats:
    """Counters since start, for metrics."""

    exact_hits: int = 0
    semantic_hits: int = 0
    misses: int = 0
    bypasses: int = 0
    refused: Counter[str] = field(default_factory=Counter)  # guard or meaning-check reason -> count
    stored: int = 0
    reclaimed: int = 0
    dropped_writes: Counter[str] = field(default_factory=Counter)  # tenant -> writes dropped from its full queue
