"""What a request needs of the tier that answers it: fields that only some tiers' servers honour.

A field we do not honour is refused by name, never dropped (wire/chat_request.py), and which tier answers decides
whether it is honoured. So a request that needs something of its tier never goes to a tier that cannot give it:
`auto`, every fallback and the ladder's remap pass such tiers over (route.py), and so does a cascade's second attempt
(the decision's `unable`); naming one is a 400 naming the field, and so is a plan none of whose tiers can. All of it
before anything is reserved or sent.

What a tier has is what the version answering it has (route.py asks the rollout: `RolloutService.steady`), and a
rollout's candidate that lacks a need does not answer the request: its baseline does (gateway/rollout/service.py
says why, and why a start refuses such a candidate in the first place: `taken_away`).

- `tools`, or tool calls and results in the messages: tiers that can call tools (`TierSpec.tools`).
- vLLM's `top_k` above 0: tiers whose server samples by it (`TierSpec.samples_top_k`: our engines, vLLM, SGLang).
  OpenAI's API has no such field: OpenAI refuses it (a 400 the tenant got as the tier's), a lenient server ignores
  it, and either way the answer is not sampled as asked. -1 and 0 turn it off, every server's default: they need
  nothing (tier_call.upstream_body leaves them out).
- `response_format` on a text completion (POST /v1/completions), other than `text`: tiers whose server's
  /v1/completions takes it (`TierSpec.formats_completions`: our engines, vLLM). OpenAI's legacy completions API has
  no such field: a strict server refuses it, a lenient one ignores it, and the tenant's JSON constraint was dropped
  unsaid. `text` asks for nothing (the answer unconstrained): it needs nothing and is left out of the body. On chat,
  `response_format` is OpenAI's own field, and every tier gets it.
- `response_format` (json_object, json_schema) on a chat request whose model may still call tools (`tools` offered
  under tool_choice `auto`): tiers whose server constrains the two together (`TierSpec.formats_with_free_calls`:
  OpenAI, vLLM). Our engine enforces one grammar an answer, a call's or the format's, and refused the request with a
  400 only once the gateway had routed and reserved it (engine/tool_calls.py `answer_format`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from gateway.errors import InvalidRequest
from gateway.pipeline.text_completion import is_raw
from tiers.catalogue import TierSpec
from wire.chat_request import ChatCompletionRequest
from wire.tools import must_call, offered_tools


@dataclass(frozen=True)
class Need:
    param: str  # the request's field, as a refusal names it
    can: str  # what a tier that has it does ("can call tools")
    cannot: str  # and one that has not ("cannot call tools"): the route reason of a tier passed over
    without: str  # what the request leaves out to go to any tier
    has: Callable[[TierSpec], bool]

    def named(self, tier: str) -> InvalidRequest:
        """The 400 for a request that names a tier without it."""
        return InvalidRequest(f"{self.param}: tier {tier!r} {self.cannot}; send the request to a tier that can "
                              f"(or `auto`), or {self.without}", param=self.param, code="unsupported_parameter")

    def nowhere(self) -> InvalidRequest:
        """The 400 for a request none of whose plan's tiers has it."""
        return InvalidRequest(f"{self.param}: none of the tiers your plan allows {self.can}", param=self.param,
                              code="unsupported_parameter")


TOOLS = Need("tools", "can call tools", "cannot call tools", "leave tools and tool messages out", lambda t: t.tools)
TOP_K = Need("top_k", "can sample by top_k", "cannot sample by top_k (its server does not take it)",
             "leave top_k out (or send -1: off)", lambda t: t.samples_top_k)

RESPONSE_FORMAT = Need("response_format", "can constrain a text completion by response_format",
                       "cannot constrain a text completion by response_format (its server's /v1/completions does not "
                       "take it)", "leave response_format out (or use /v1/chat/completions)",
                       lambda t: t.formats_completions)


FORMAT_WITH_FREE_CALLS = Need("response_format", "can constrain the answer's format while the model may call tools",
                              "cannot constrain the answer's format while the model may call tools (tool_choice "
                              "'auto')", "send tool_choice 'none' or 'required', or leave response_format out",
                              lambda t: t.formats_with_free_calls)

NEEDS = (TOOLS, TOP_K, RESPONSE_FORMAT, FORMAT_WITH_FREE_CALLS)  # every need, in the order a refusal names them


def needs_of(req: ChatCompletionRequest) -> tuple[Need, ...]:
    """What `req` needs of its tier (none, for most requests)."""
    needs = (TOOLS,) if req.uses_tools else ()
    if req.top_k is not None and req.top_k > 0:
        needs = (*needs, TOP_K)
    if req.response_format is not None and req.response_format.constrains:
        if is_raw(req):
            needs = (*needs, RESPONSE_FORMAT)
        elif offered_tools(req.tools, req.tool_choice) and not must_call(req.tool_choice):
            needs = (*needs, FORMAT_WITH_FREE_CALLS)
    return needs


def able(tiers: Iterable[TierSpec], needs: tuple[Need, ...]) -> list[TierSpec]:
    """The tiers (in the order given) that have every need; a 400 naming the first need that leaves none."""
    left = list(tiers)
    for need in needs:
        left = [t for t in left if need.has(t)]
        if not left:
            raise need.nowhere()
    return left


def lacking(tier: TierSpec, needs: tuple[Need, ...]) -> Need | None:
    """The first of `needs` the tier (one version's spec) lacks; None if it has them all."""
    return next((n for n in needs if not n.has(tier)), None)


def taken_away(before: TierSpec, after: TierSpec) -> list[Need]:
    """What `before` has and `after` lacks: what a request would lose if `after` answered in `before`'s place."""
    return [n for n in NEEDS if n.has(before) and not n.has(after)]


def unable(tiers: Iterable[TierSpec], needs: tuple[Need, ...]) -> dict[str, str]:
    """Tier name -> why it cannot answer (the first need it lacks), for the tiers that lack one."""
    return {tier.name: f"it {need.cannot}" for tier in tiers if (need := lacking(tier, needs)) is not None}


def check_named(tier: TierSpec | None, needs: tuple[Need, ...]) -> None:
    """A 400 naming the first need the named `tier` lacks (None: `auto`, or no such tier, refused elsewhere)."""
    if tier is not None and (need := lacking(tier, needs)) is not None:
        raise need.named(tier.name)
