"""A shadow copy goes as its request went: as its tenant's, and under a plan that keeps end users apart
(`cache.isolate_users`), as its end user's, so that what the candidate keeps of it (a cached prefix) is that end
user's alone (gateway/pipeline/off_path.py). handle.py passed the tenant only: an isolated end user's copies were
salted as the tenant's shared requests are."""

from __future__ import annotations

from typing import Any

from cache.scope import end_user_snapshot
from tests.gateway.test_rollout import admin, first_turn, two_versions  # noqa: F401 (a fixture)
from tests.gateway.test_rollout_shadow import servers, wait_for  # noqa: F401 (a fixture)


def test_an_isolated_end_users_shadow_copy_goes_as_that_end_users(two_versions: Any) -> None:  # noqa: F811
    gw, _, _ = two_versions
    gw.store.create_tenant("apart", "private")  # cache.isolate_users
    key = gw.store.issue_key("apart", name="test")[1]
    shadow = gw.app.state.services.pipeline.shadow
    sent: list[tuple[str | None, str | None]] = []
    real = shadow.send

    def send(*args: Any, **kw: Any) -> None:
        sent.append((kw.get("tenant"), kw.get("end_user")))
        real(*args, **kw)

    shadow.send = send
    r = admin(gw, "/admin/rollouts", {"tier": "mid", "version": "v2", "shadow": 1.0, "reason": "compare v2"})
    assert r.status_code == 201, r.text
    with gw.client(key) as c:
        for user in ("ana", "bo"):
            answer = c.post("/v1/chat/completions", json={"model": "mid", "messages": first_turn(1), "max_tokens": 8,
                                                          "user": user})
            assert answer.status_code == 200, answer.text
    assert wait_for(lambda: len(sent) == 2)
    assert sent == [("apart", end_user_snapshot("ana", None)), ("apart", end_user_snapshot("bo", None))]
    assert end_user_snapshot("ana", None) is not None
