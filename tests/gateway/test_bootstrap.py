"""First run creates an admin key and the demo tenant once; later runs reuse them."""

from __future__ import annotations

import json
import stat
from pathlib import Path

from gateway.bootstrap import banner, ensure_bootstrap
from gateway.config_files import load_yaml
from gateway.settings import REPO_ROOT
from gateway.tenants.store import TenantStore
from quotas.plans import PlanBook

PLANS = load_yaml(REPO_ROOT / "quotas" / "plans.yaml", PlanBook)


def test_first_run_creates_keys_once_and_later_runs_reuse_them(tmp_path: Path) -> None:
    store = TenantStore(tmp_path / "state.db")
    first = ensure_bootstrap(store, PLANS, tmp_path)
    assert first is not None and store.authenticate(first["demo_key"]).tenant.name == "demo"
    assert store.authenticate(first["admin_key"]).key.is_admin
    f = tmp_path / "bootstrap-keys.json"
    assert stat.S_IMODE(f.stat().st_mode) == 0o600 and json.loads(f.read_text()) == first
    second = ensure_bootstrap(store, PLANS, tmp_path)
    assert second == first and len(store.list_keys()) == 2 and [t.name for t in store.list_tenants()] == ["demo"]
    text = banner(second, host="127.0.0.1", port=8080, data_dir=tmp_path)
    assert first["demo_key"] in text and "curl -s http://127.0.0.1:8080/v1/chat/completions" in text
    f.unlink()
    assert ensure_bootstrap(store, PLANS, tmp_path) is None
    assert "tiergate keys issue" in banner(None, host="h", port=1, data_dir=tmp_path)


def test_a_saved_key_the_store_no_longer_takes_is_not_printed(tmp_path: Path) -> None:
    """The operator revoked the demo key (or rotated it): a later start printed it again, with a curl that got 401."""
    store = TenantStore(tmp_path / "state.db")
    first = ensure_bootstrap(store, PLANS, tmp_path)
    assert first is not None
    demo_id = first["demo_key"].split("-")[1]
    store.revoke_key(demo_id)
    later = ensure_bootstrap(store, PLANS, tmp_path)
    assert later == {"admin_key": first["admin_key"]}
    text = banner(later, host="127.0.0.1", port=8080, data_dir=tmp_path)
    assert first["demo_key"] not in text and "no longer valid" in text and "tiergate keys issue --tenant demo" in text
    assert json.loads((tmp_path / "bootstrap-keys.json").read_text()) == first  # the operator's copy, untouched
