"""The checks of one request before the engine takes it: what `LLMEngine.validate` runs, for `generate` and for
the HTTP server before it answers (engine/server.py), so a request this engine can never serve is a 400 naming the
field, never a failure in the loop.

The sampling parameters are checked again (the dataclass may have been changed since it was built), then the prompt
against the model (token ids within its vocabulary) and against this engine's room (prompt plus output within the
model's context and within the whole KV cache), and a response format against the formats refused to the tenant.

`check_output_room` is the part of the room check that needs no prompt: a `max_tokens` that leaves no room for even
the shortest prompt (one token: an empty one is refused) can never be served, whatever the prompt, so the server
refuses it before rendering and tokenizing one (up to a second of a tokenizer thread for a long prompt, spent on a
request refused anyway), with the answer the whole check would give: the same code and param.
"""

from __future__ import annotations

from engine.block_manager import BlockManager
from engine.grammar import GrammarCache
from engine.sampling_params import EngineInputError, SamplingParams

MIN_PROMPT_TOKENS = 1  # the shortest prompt `check_request` takes (an empty one is refused)


def check_request(prompt_token_ids: list[int], params: SamplingParams, tenant: str | None, *,
                  vocab_size: int | None, max_model_len: int, block_manager: BlockManager,
                  grammars: GrammarCache) -> None:
    """Raise EngineInputError (naming the field) for a request this engine can never serve.

    `vocab_size`: the model's (None: unknown, a test double's); `max_model_len`: its context; `block_manager`: the
    engine's KV cache. A response format refused to `tenant` before is refused here again (`grammars`); one it
    never compiled is compiled by `LLMEngine.compiled_grammar` (a schema that cannot be compiled is an
    EngineInputError there).
    """
    params.check()  # again: the dataclass may have been changed since it was built
    if not prompt_token_ids:
        raise EngineInputError("the prompt is empty", param="messages")
    low, high = min(prompt_token_ids), max(prompt_token_ids)
    if low < 0 or (vocab_size is not None and high >= vocab_size):
        raise EngineInputError(f"prompt token ids must lie within 0..{(vocab_size or 0) - 1}",
                               param="prompt_token_ids")
    _check_room(len(prompt_token_ids), params.max_tokens, max_model_len=max_model_len, block_manager=block_manager)
    if (fmt := params.output_format) is not None:
        grammars.known(fmt, tenant)


def check_output_room(max_tokens: int, *, max_model_len: int, block_manager: BlockManager) -> None:
    """Raise EngineInputError when `max_tokens` output tokens and a prompt of MIN_PROMPT_TOKENS cannot fit the
    model's context or the whole KV cache, by `check_request`'s own rule: no prompt could make the request fit."""
    _check_room(None, max_tokens, max_model_len=max_model_len, block_manager=block_manager)


def _check_room(prompt_tokens: int | None, max_tokens: int, *, max_model_len: int, block_manager: BlockManager) -> None:
    """The room check of both: a prompt of `prompt_tokens` (None: not read yet, the shortest counted) plus
    `max_tokens` output tokens within the model's context and within the whole KV cache."""
    prompt = MIN_PROMPT_TOKENS if prompt_tokens is None else prompt_tokens
    total, bm = prompt + max_tokens, block_manager
    if total <= max_model_len and bm.num_blocks_for(total) <= bm.num_blocks:
        return
    held = (f"this model's maximum context length is {max_model_len} tokens" if total > max_model_len
            else f"this engine's KV cache holds {bm.num_blocks * bm.block_size} tokens")
    needs = (f"needs {prompt} prompt tokens + {max_tokens} output tokens = {total}" if prompt_tokens is not None
             else f"asks for {max_tokens} output tokens, which leaves no room for a prompt (at least "
                  f"{MIN_PROMPT_TOKENS} token)")
    raise EngineInputError(f"{held}; the request {needs}", param="messages", code="context_length_exceeded")
