"""A semantic candidate is served only if the store files it under the lookup's own partition (its scope and
history): the index's word alone is not the scope check (cache/lookup_pass.py `_servable`). No known path files
an entry under the wrong partition; here one is planted in the index, and refused, counted and logged once."""

from __future__ import annotations

import logging

import pytest

from cache import Hit, SemanticCache
from cache.request_key import request_key
from cache.semantic_cache import WRONG_PARTITION
from tests.cache.conftest import chat, scope

Q = "How do I convert 5 km to miles?"
PARAPHRASE = "How can I convert 5 kilometers into miles?"


def test_an_entry_of_another_partition_proposed_by_the_index_is_never_served(
        cache: SemanticCache, caplog: pytest.LogCaptureFixture) -> None:
    body = chat(Q)
    theirs = cache.store(scope(body, tenant="globex"), body, "globex's answer")
    assert theirs is not None and theirs.embedding is not None
    ours = f"{scope(body).scope_id}:{request_key(body).history_hash}"  # acme's partition of the same question
    assert theirs.partition != ours
    cache.index.add(ours, [theirs.entry_id], theirs.embedding[None, :])  # planted: the index proposes it to acme
    para = chat(PARAPHRASE)
    with caplog.at_level(logging.ERROR, logger="cache.semantic_cache"):
        first = cache.lookup(scope(para), para)
        second = cache.lookup(scope(para), para)
    assert not isinstance(first, Hit) and not isinstance(second, Hit)  # globex's answer, before
    assert first.status == second.status == "miss"
    assert cache.stats.refused[WRONG_PARTITION] == 2  # each refusal counted
    assert [r for r in caplog.records if theirs.entry_id in r.getMessage()] != []
    assert len([r for r in caplog.records if r.name == "cache.semantic_cache"]) == 1  # logged once
    assert cache.entries.get(theirs.entry_id) is not None  # refused, not deleted: the fault is the index's
