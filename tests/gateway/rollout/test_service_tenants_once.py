"""A canary's named tenants are each named once: a repeat is refused by its place (`tenants.2`, code
`duplicate_tenant`), as a report's group or a query parameter sent twice is, and no rollout starts. It was dropped in
silence: the start answered 201 with another list than the one sent."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.errors import InvalidRequest
from gateway.rollout.service import RolloutService
from gateway.rollout.state import SqliteRolloutStore
from tests.gateway.rollout.test_service import CATALOGUE


@pytest.mark.parametrize(("tenants", "place"), [(("vip", "vip"), "tenants.1"), (("a", "b", "c", "b"), "tenants.3"),
                                                (("a", "b", "a", "b"), "tenants.2")])
def test_a_tenant_named_twice_is_refused_by_its_place_and_nothing_starts(
        tmp_path: Path, tenants: tuple[str, ...], place: str) -> None:
    store = SqliteRolloutStore(tmp_path / "state.db")
    try:
        s = RolloutService(CATALOGUE, store)
        with pytest.raises(InvalidRequest) as caught:
            s.start("mid", "v2", share=0.1, tenants=tenants, who="k", reason="r")
        assert (caught.value.param, caught.value.code) == (place, "duplicate_tenant")
        assert s.status() == [] and s.history("mid") == []
        r = s.start("mid", "v2", share=0.1, tenants=tuple(dict.fromkeys(tenants)), who="k", reason="r")
        assert r.tenants == tuple(dict.fromkeys(tenants))
    finally:
        store.close()
