"""One step's prompt cost per tenant, while tenants share the engine: the arithmetic of engine/scheduler.py's
fairness (its module docstring says why and what was measured). `prompt_cost` prices reading prompt tokens late in
a prompt, `water_fill` shares a step's cost equally among tenants, and `TenantShares` holds what each (tenant,
priority) may still spend this step and whether a tenant may take another running slot. Pure arithmetic: the
scheduler decides which sequences these numbers apply to."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

# A prompt token read after this many earlier ones costs about twice one at the start: measured on one core,
# 0.9-1.1 ms a token at the start, 1.3-1.6 ms after 512, 1.8-2.2 after 1,024, 2.4-2.9 after 1,536 (mid and full)
CONTEXT_COST_TOKENS = 1000

Tenant = str | None  # a sequence's salt's tenant (sequence.salt_tenant: the gateway's per-tenant digest); None is one


@dataclass
class TenantShares:
    """One step's prompt cost per (tenant, priority) held to a share while tenants share the engine (in
    `prompt_cost`'s units)."""

    shared: bool  # more than one tenant has sequences here
    num_running: Counter[Tenant]  # running sequences per tenant, this step's admissions included
    num_waiting: Counter[Tenant]  # waiting sequences of the head's priority per tenant, this step's admissions out
    max_running: int  # a tenant's fair share of the batch's slots: max_num_seqs over the tenants here, rounded up
    min_chunk: int  # a held tenant's first chunk of a priority in the step is never cut below this
    left: dict[tuple[Tenant, int], float] = field(default_factory=dict)  # what held chunks may still cost
    started: set[tuple[Tenant, int]] = field(default_factory=set)  # held ones with a chunk in this step

    def holds(self, key: tuple[Tenant, int]) -> bool:
        return key in self.left

    def grant(self, key: tuple[Tenant, int], n: int, context: int) -> int:
        """How many of `n` prompt tokens read after `context` earlier ones a held share allows (0: none)."""
        fit = int(self.left[key] * CONTEXT_COST_TOKENS // (CONTEXT_COST_TOKENS + context))
        if key not in self.started:
            fit = max(fit, self.min_chunk)
        return min(n, fit)

    def charge(self, key: tuple[Tenant, int], n: int, context: int) -> None:
        if key in self.left:
            self.left[key] -= prompt_cost(n, context)
            self.started.add(key)

    def can_take(self, key: tuple[Tenant, int]) -> bool:
        return key not in self.left or key not in self.started or self.left[key] >= 1

    def may_admit(self, tenant: Tenant, num_free_slots: int) -> bool:
        """Whether `tenant` may take a free slot: within its fair share always; beyond it only if the slots left still
        hold what the other tenants' waiting sequences need to reach theirs (a lone tenant takes every slot)."""
        if self.num_running[tenant] < self.max_running:
            return True
        needed = sum(min(n, max(0, self.max_running - self.num_running[other]))
                     for other, n in self.num_waiting.items() if other != tenant)
        return num_free_slots > needed


def prompt_cost(n: int, context: int) -> float:
    """What reading `n` prompt tokens after `context` earlier ones costs, in tokens read at a prompt's start."""
    return n * (CONTEXT_COST_TOKENS + context) / CONTEXT_COST_TOKENS


def water_fill(demand: dict[Tenant, float], total: float) -> dict[Tenant, float]:
    """Share `total` equally among the tenants; one that needs less than its part leaves the rest to the others."""
    shares: dict[Tenant, float] = {}
    order = sorted(demand, key=demand.__getitem__)  # stable: equal demands keep their order
    for k, tenant in enumerate(order):
        shares[tenant] = min(demand[tenant], total / (len(order) - k))
        total -= shares[tenant]
    return shares
