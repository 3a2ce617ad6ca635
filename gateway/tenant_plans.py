"""The plan a tenant's requests run under: the tenant store names it, this gateway's plans file defines it.

The two can disagree: a plan taken out of the file while tenants are on it, or a tenant moved to a plan that this
gateway's file lacks (`tiergate admin tenants set-plan --plans OTHER_FILE`, or another replica with a newer file).
Start-up refuses the first (`check_tenant_plans`: the plans file, the missing plans and their tenants). A request of a
tenant whose plan is missing all the same is a 503 that says so, and the operator's log names the plan once
(`tenant_plan`); it was a KeyError, a 500 for every request of the tenant, each with a traceback.
"""

from __future__ import annotations

import logging
from functools import lru_cache
from pathlib import Path

from gateway.config_files import ConfigFileError
from gateway.errors import Unavailable
from gateway.tenants.records import Principal
from gateway.tenants.store import TenantStore
from quotas.plans import Plan, PlanBook

log = logging.getLogger("tiergate.plans")
NAMED_TENANTS = 5  # tenants named per missing plan in start-up's error; the rest are counted


def tenant_plan(plans: PlanBook, principal: Principal) -> Plan:
    """The plan of `principal`'s tenant; a 503 `plan_not_configured` when the plans file does not have it."""
    name = principal.tenant.plan  # type: ignore[union-attr]  # a tenant's key (the routes' guards)
    plan = plans.plans.get(name)
    if plan is None:
        _log_missing(name)
        raise Unavailable(f"your tenant's plan {name[:64]!r} is not configured on this gateway; its operator has "
                          "been told (nothing was charged)", code="plan_not_configured")
    return plan


@lru_cache(maxsize=256)  # once a plan, not once a request
def _log_missing(name: str) -> None:
    log.error("tenants are on plan %r, which the plans file does not have: their requests are refused (503 "
              "plan_not_configured) until it is added or they are moved (tiergate admin tenants set-plan)", name)


def check_tenant_plans(store: TenantStore, plans: PlanBook, plans_file: Path) -> None:
    """Refuse (ConfigFileError naming `plans_file`) a plans file that lacks a plan some tenant is on."""
    missing: dict[str, list[str]] = {}
    for tenant in store.list_tenants():
        if tenant.plan not in plans.plans:
            missing.setdefault(tenant.plan, []).append(tenant.name)
    if not missing:
        return
    listed = "; ".join(
        f"{plan!r} (tenant{'s' if len(names) > 1 else ''} {', '.join(names[:NAMED_TENANTS])}"
        f"{f' and {len(names) - NAMED_TENANTS} more' if len(names) > NAMED_TENANTS else ''})"
        for plan, names in sorted(missing.items()))
    raise ConfigFileError(plans_file, None, f"tenants are on plans this file does not have: {listed}; add the "
                          "plans back, or move the tenants first (tiergate admin tenants set-plan NAME PLAN)")
