"""First run: an admin key and a `demo` tenant with a key, printed once with an example request.

The store keeps only hashes. So that `make run` can print a working example on later runs too, the
first run also writes the two keys to `<data dir>/bootstrap-keys.json` (mode 0600), the operator's own
copy, which they may delete at any time; nothing in the gateway reads keys from it. A key of that copy which the
store no longer honours (revoked, rotated past its grace, expired) is left out of what is printed: its example
request would answer 401.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from gateway.errors import Conflict, NotFound
from gateway.tenants.keys import parse_key
from gateway.tenants.records import ADMIN
from gateway.tenants.store import TenantStore
from quotas.plans import PlanBook

DEMO_TENANT = "demo"
FILE_NAME = "bootstrap-keys.json"


def ensure_bootstrap(store: TenantStore, plans: PlanBook, data_dir: Path) -> dict[str, str] | None:
    """Create what is missing; return the keys from the operator's copy, if it is still there."""
    path = data_dir / FILE_NAME
    saved: dict[str, str] = json.loads(path.read_text()) if path.is_file() else {}
    created = False
    if not any(k.is_admin and k.revoked_at is None for k in store.list_keys()):
        _, saved["admin_key"] = store.issue_key(None, name="bootstrap admin", roles=(ADMIN,))
        created = True
    if DEMO_TENANT not in {t.name for t in store.list_tenants()}:
        try:
            store.create_tenant(DEMO_TENANT, plans.default_plan)
        except Conflict:  # another replica sharing this data directory got there first
            return _honoured(store, saved)
        _, saved["demo_key"] = store.issue_key(DEMO_TENANT, name="demo")
        created = True
    if created:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as fh:
            json.dump(saved, fh, indent=2)
    return _honoured(store, saved)


def _honoured(store: TenantStore, saved: dict[str, str]) -> dict[str, str] | None:
    """The saved keys the store still takes: an operator who revoked the demo key was shown it again, with an example
    request that answered 401."""
    now = time.time()
    kept: dict[str, str] = {}
    for name, key in saved.items():
        parsed = parse_key(key) if isinstance(key, str) else None
        if parsed is None:
            continue
        try:
            if store.get_key(parsed[0]).active(now):
                kept[name] = key
        except NotFound:
            continue
    return kept or None


def banner(keys: dict[str, str] | None, *, host: str, port: int, data_dir: Path) -> str:
    base = f"http://{host}:{port}"
    if not keys or "demo_key" not in keys:
        return (f"Tiergate is serving at {base}. The first-run demo key is no longer in {data_dir / FILE_NAME}, "
                "or no longer valid;\n"
                "issue new ones with `tiergate keys issue --tenant demo` (and `--admin` for an admin key).")
    lines = [
        f"Tiergate is serving at {base}",
        f"  admin key : {keys.get('admin_key', '(see tiergate keys issue --admin)')}",
        f"  demo key  : {keys['demo_key']}   (tenant 'demo')",
        f"  (your copy of these keys: {data_dir / FILE_NAME}; the gateway stores only their hashes)",
        "",
        "Try it:",
        f"  curl -s {base}/v1/chat/completions \\",
        f"    -H 'Authorization: Bearer {keys['demo_key']}' -H 'Content-Type: application/json' \\",
        "    -d '{\"model\": \"auto\", \"messages\": [{\"role\": \"user\", \"content\": "
        "\"What is the capital of France? Answer in one word.\"}], \"max_tokens\": 32, \"temperature\": 0}'",
        "",
        "Or with the OpenAI Python client:",
        f"  OpenAI(base_url='{base}/v1', api_key='{keys['demo_key']}')",
    ]
    return "\n".join(lines)
