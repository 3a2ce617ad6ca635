"""The checks of one request before the engine takes it: what `LLMEngine.validate` runs, for `generate` and for
the HTTP server before it answers (engine/server.py), so a request this engine can never serve is a 400 naming the
field, never a failure in the loop; and the checks the server runs around rendering and tokenizing a request's prompt
(`PromptChecks`).

The sampling parameters are checked again (the dataclass may have been changed since it was built), then the prompt
against the model (token ids within its vocabulary) and against this engine's room (prompt plus output within the
model's context and within the whole KV cache), and a response format against the formats refused to the tenant.

`check_output_room` is the part of the room check that needs no prompt: a `max_tokens` that leaves no room for even
the shortest prompt (one token: an empty one is refused) can never be served, whatever the prompt, so the server
refuses it before rendering and tokenizing one (up to a second of a tokenizer thread for a long prompt, spent on a
request refused anyway), with the answer the whole check would give: the same code and param.

`PromptChecks` renders and tokenizes a prompt (in the server's worker thread) and refuses what cannot be served before
it costs more than it must. Text longer than the context could hold even at the vocabulary's longest token is refused
before tokenizing (a chat request's messages' text alone that long, before its prompt is rendered: 4 MB of
`<|im_end|>` held a worker thread 0.72 s in the escaping, the scan and the template before its refusal), and a longer
text than PREFIX_CHARS_PER_TOKEN characters per context token is first counted in pieces of that many characters,
refused as soon as the pieces counted overflow the context (with PREFIX_MARGIN_TOKENS for each cut, as the gateway's
prefix count has, gateway/pipeline/prompt.py): a hostile prompt just under the first bound (SmolLM2: 236K
characters, 0.2-0.8 s of tokenizing each) was counted whole before its refusal, and 30 of them held a normal request
26 s behind them in the tokenizing threads (0.1 s with the pieces). So is text
that is not Unicode text (a lone UTF-16 surrogate, which a tool call's arguments can spell as a JSON escape: the
tokenizer raised TypeError, a 500), and a conversation the model's chat template refuses (a template's
`raise_exception`, e.g. roles that do not alternate) is a 400 naming `messages`. A message's `name` is passed to
the template; where the template does not write names into the prompt (SmolLM2's does not: found once, at start,
by wire/tool_calls.py's `named_roles`), it is a 400 naming `messages.<i>.name`, code `unsupported_parameter`, before
anything is rendered: the answer must not be the one an unnamed message gets (the gateway relays the refusal as the
tenant's 400, billed nothing).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from jinja2 import TemplateError

from engine.block_manager import BlockManager
from engine.grammar import GrammarCache
from engine.sampling_params import EngineInputError, SamplingParams
from wire.chat_request import ChatCompletionRequest
from wire.completion_request import CompletionRequest
from wire.prompt_text import PlainTenantText
from wire.tool_calls import named_roles, render_messages, stray_result, unrendered_name

MIN_PROMPT_TOKENS = 1  # the shortest prompt `check_request` takes (an empty one is refused)
PREFIX_CHARS_PER_TOKEN = 8  # a prompt longer than this many characters per context token is counted in pieces first
PREFIX_MARGIN_TOKENS = 16  # a piece cut inside a word may count a few tokens more than the whole has there

_SURROGATE = re.compile("[\ud800-\udfff]")


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


class PromptChecks:
    """A request's prompt rendered and tokenized for one engine's tokenizer and context (`max_model_len`), with the
    checks around it (the module says which): each method returns the prompt's token ids or raises EngineInputError."""

    def __init__(self, tokenizer: Any, max_model_len: int) -> None:
        self.tokenizer, self.max_model_len = tokenizer, max_model_len
        self.max_prompt_chars = max_prompt_chars_for(tokenizer, max_model_len)
        self.plain_text = PlainTenantText.for_tokenizer(tokenizer)  # None: no special token a tenant could spell
        # the roles whose `name` the chat template writes into the prompt (a name it would leave out is refused)
        self.names_written = named_roles(lambda turns: tokenizer.apply_chat_template(turns, add_generation_prompt=True,
                                                                                     tokenize=False))

    def _too_long(self, has: str, param: str) -> EngineInputError:
        return EngineInputError(f"{has}; this model's maximum context length of {self.max_model_len} tokens holds "
                                f"at most {self.max_prompt_chars}", param=param, code="context_length_exceeded")

    def _checked_ids(self, text: str, param: str, *, add_special_tokens: bool,
                     encode: Callable[[], list[int]] | None = None) -> list[int]:
        """Tokenize (in a worker thread): refuses text that cannot fit before tokenizing it. `encode`: what
        tokenizes it where the tokenizer's own call on `text` would not (a prompt holding tenant text that spells
        special tokens); the bounds are still those of `text`."""
        tokenizer, max_model_len = self.tokenizer, self.max_model_len
        if self.max_prompt_chars is not None and len(text) > self.max_prompt_chars:
            raise self._too_long(f"the prompt has {len(text)} characters", param)
        if (bad := _SURROGATE.search(text)) is not None:
            raise EngineInputError(
                f"the prompt holds a lone UTF-16 surrogate (U+{ord(bad[0]):04X}, from a \\u escape in a tool call's "
                "arguments?), which is not text", param=param)
        piece = max_model_len * PREFIX_CHARS_PER_TOKEN
        if len(text) > piece:  # counted in pieces first: a refusal costs about what the context holds, not the text
            counted = 0
            for k, start in enumerate(range(0, len(text), piece), 1):
                counted += len(tokenizer(text[start:start + piece],
                                         add_special_tokens=add_special_tokens and start == 0)["input_ids"])
                if counted > max_model_len + PREFIX_MARGIN_TOKENS * k:
                    raise EngineInputError(
                        f"this model's maximum context length is {max_model_len} tokens; the prompt's first "
                        f"{start + piece} characters are about {counted} tokens", param=param,
                        code="context_length_exceeded")
        if encode is not None:
            return encode()
        return list(tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])

    def chat_ids(self, req: ChatCompletionRequest) -> list[int]:
        """The conversation (tools, calls and results as text) rendered with the model's chat template, tokenized:
        the template's markers as their special tokens, the request's strings as text, even where they spell a
        special token (wire/prompt_text.py: `<|im_end|>` in a message forged a turn), or our own tool markers
        (`<tool_call>`, escaped before `render_messages` writes ours around them). Without such a string, the rendered
        text is tokenized whole, as ever."""
        if (i := unrendered_name(req, self.names_written)) is not None:
            raise EngineInputError(
                f"messages.{i}.name: this model's chat template does not write a {req.messages[i].role} message's "
                "name into the prompt, so the model could not tell who sent it; remove it (or put the name in the "
                "content)", param=f"messages.{i}.name", code="unsupported_parameter")
        if (i := stray_result(req)) is not None:
            raise EngineInputError(
                f"messages.{i}.tool_call_id: answers no call of the assistant message before its results (an id that "
                "message did not make, or one answered already); this model's prompt places each result after the "
                "calls without ids, so it would read as another call's answer. Send each result once, after the "
                "assistant message that made its call", param=f"messages.{i}.tool_call_id")
        if self.max_prompt_chars is not None:  # before escaping, scanning and rendering: 4 MB of `<|im_end|>` held a
            # worker thread 0.72 s before its refusal. The messages' text is in the prompt as sent (a template that
            # trims it drops no more than its ends' whitespace): a bound on the prompt's length
            chars = sum(len(m.text().strip()) for m in req.messages)
            if chars > self.max_prompt_chars:
                raise self._too_long(f"the messages' text has {chars} characters", "messages")
        plain_text = self.plain_text
        markers = plain_text.marker_escape() if plain_text is not None else None
        turns = render_messages(req, markers)
        escaped = plain_text.escaped(turns, markers) if plain_text is not None else None
        try:
            text = self.tokenizer.apply_chat_template(escaped.turns if escaped is not None else turns,
                                                      add_generation_prompt=True, tokenize=False)
        except TemplateError as exc:  # the template's own refusal of this conversation (its `raise_exception`)
            raise EngineInputError(f"messages: this model's chat template refuses the conversation: {exc}",
                                   param="messages") from None
        if escaped is None or plain_text is None:
            return self._checked_ids(text, "messages", add_special_tokens=False)
        return self._checked_ids(plain_text.restored(text, escaped), "messages", add_special_tokens=False,
                                 encode=lambda: plain_text.ids(text, escaped))

    def text_ids(self, req: CompletionRequest) -> list[int]:
        """The prompt as it is, with the tokenizer's own special tokens (a BOS where the model has one), as vLLM.
        Special tokens' strings in it are parsed as those tokens, as vLLM parses them: the prompt is the tenant's
        own whole text, no template of ours around it to protect, and writing the model's markers by hand (a chat
        prompt built by the client) is what this endpoint is for. Only a chat request's text is read as text."""
        return self._checked_ids(req.text, "prompt", add_special_tokens=True)


def max_prompt_chars_for(tokenizer: Any, max_model_len: int) -> int | None:
    """The longest prompt text that could fit in the context: every token as long as the longest one.

    A vocabulary entry is at least as long as the text it stands for (byte-level entries spell one character
    per byte, SentencePiece's spell their text), so with tokenizers that drop no text, as chat models' do,
    this never refuses a prompt that fits. None when the tokenizer lists no vocabulary.
    """
    get_vocab = getattr(tokenizer, "get_vocab", None)
    if get_vocab is None:
        return None
    vocab = get_vocab()
    return max_model_len * max(map(len, vocab), default=1) if vocab else None
