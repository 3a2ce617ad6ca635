"""The chat request path as a pipeline of stages, each a module with one job and a frozen result.

One non-streamed `auto` request, from the route to the ledger:

1. `gateway/routes/chat.py` — the route. Litestar resolves the key dependency (`gateway/auth.py`: bearer
   key → `Principal`), builds a `RequestContext` (context.py: who, plan, headers, arrival), passes the gate
   (step 2, `Pipeline.admit`), reads the body and hands both to `Pipeline.handle` (handle.py), listening for
   the client's disconnect meanwhile.
2. gate.py — `TenantGate.enter`: the tenant's (and key's) requests in progress on this replica, and a
   remembered requests-per-minute refusal; microseconds, before anything costs, the body's read included.
3. handle.py's `parse_request` (wire/validation.py) — the body as a `ChatCompletionRequest`
   (wire/chat_request.py), every field bounded, unsupported ones refused by name.
4. refuse_early.py's `degradation` — the ladder's level read once as a frozen `Degradation`
   (gateway/ladder/apply.py); a shed priority class is refused here.
5. route.py — `RouteStage.choose` → `RouteDecision`: explicit tier or `auto` (difficulty model, budget
   floor), around unavailable and overloaded tiers, the ladder's remap, then the version of the tier that a
   rollout gives the conversation (gateway/rollout).
6. prompt.py — `PromptStage.measure` → `Prompt`: the ladder's input cap, the prompt counted with the tier's
   tokenizer (bounded, off the event loop), the output cap, the context check: a request that cannot fit is
   refused before the cache lookup can embed anything.
7. cache_lookup.py — `CacheStage.lookup` → `CacheLookup`: exact then semantic, inside the request's scope.
   A hit skips 9 and 10 (and its prompt count is not used).
8. reserve.py — `ReserveStage.reserve` → a quota `Reservation` (quotas/reservations.py): requests, tokens,
   money and a concurrency slot, charged atomically or refused with nothing charged. Every refusal in
   2-8 is counted once by refusals.py. From here on, the request is an `Attempt` (attempt.py).
9. dispatch.py — `DispatchStage.acquire` → a `Ticket`: the tier's queue, priority class then fair share.
10. tier_call.py — `TierCaller.open` → an `Upstream`: a replica (affinity, then least wait), its stream
    opened and its first chunk read, so a failure is still an HTTP status.
11. meter.py — `Meter`, the attempt's own accumulator, counts each chunk; it ends as a frozen `Outcome`.
12. settle.py — `Settler.settle`, called once from the `finally` of `Pipeline.answer`: the ledger row,
    the quota settled to real use, the dispatch slot freed, the cache given a fresh answer, the metrics.
    Only then does the route get `Done` (events.py) and the client the end of its answer.

cascade.py wraps step 9-12 for plans that retry a failed cheap answer on a dearer tier.
"""
