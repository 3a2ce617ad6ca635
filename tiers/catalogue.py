"""The tier catalogue (`tiers/tiers.yaml`): what each tier runs, where, and what it costs."""

from __future__ import annotations

from decimal import Decimal
from typing import Annotated, Literal
from urllib.parse import urlsplit

from pydantic import AfterValidator, ConfigDict, Field, PrivateAttr, ValidationError, field_validator, model_validator

from assets.builds import BudgetError, parse_budget
from quotas.money import round_cost, whole_picodollars_a_token
from wire.fields import NoBoolNumbers

Money = Annotated[Decimal, Field(ge=0, max_digits=18, decimal_places=12)]
# a price per 1K tokens: at most 9 decimal places (quotas/money.py PRICE_PLACES: a token's price a whole number of
# picodollars), refused by name otherwise; its digits checked after, so a finer price is told the places rule
PricePer1K = Annotated[Decimal, Field(ge=0), AfterValidator(whole_picodollars_a_token), Field(max_digits=18)]
# What a tier's server accepts beyond OpenAI's API (README.md, "Remote tiers"). Every dialect is asked for
# usage (`stream_options.include_usage`, which OpenAI defines); the others add:
#   vllm           usage in every chunk (`continuous_usage_stats`, which SGLang accepts too), so a stream the
#                  client leaves is billed for what ran, and the tenant's prefix-cache namespace as `cache_salt`
#                  (vLLM's field since 0.9: prompts are shared in its prefix cache only under one salt)
#   vllm-priority  ...and the plan's priority class as `priority` (a vLLM started with `--scheduling-policy
#                  priority`; any other refuses a non-zero priority with a 400)
#   tiergate       our own engine: both (local tiers always speak it)
# All but `openai` sample by vLLM's `top_k` (SGLang's too); OpenAI's API has no such field, so an `openai` tier never
# answers a request that sets it (gateway/pipeline/needs.py): OpenAI refuses it, a lenient server ignores it.
# Likewise `response_format` on the legacy /v1/completions: vLLM's and our engine's take it (the completion is then
# JSON), OpenAI's legacy API has no such field, so an `openai` tier never answers a text completion that sets one.
Dialect = Literal["openai", "vllm", "vllm-priority", "tiergate"]
VERSION_NAME = r"^[A-Za-z0-9][A-Za-z0-9._-]*$"
CONTINUOUS_USAGE: frozenset[str] = frozenset({"vllm", "vllm-priority", "tiergate"})
PRIORITY: frozenset[str] = frozenset({"vllm-priority", "tiergate"})
CACHE_SALT_FIELD: frozenset[str] = frozenset({"vllm", "vllm-priority"})  # our engine takes it as a header instead
TOP_K: frozenset[str] = frozenset({"vllm", "vllm-priority", "tiergate"})
COMPLETION_RESPONSE_FORMAT: frozenset[str] = frozenset({"vllm", "vllm-priority", "tiergate"})
# A chat answer constrained by `response_format` while the model may still call tools (tool_choice `auto`): OpenAI's
# API takes the two together, and vLLM's server does; our engine cannot (one grammar per answer: a call's or the
# format's, engine/tool_calls.py `answer_format`), so a `tiergate` tier never answers such a request
FORMAT_WITH_FREE_CALLS: frozenset[str] = frozenset({"openai", "vllm", "vllm-priority"})
# What a version of a local tier may not change: where a remote server is and how to talk to it (a local version
# runs its own engine, which speaks `tiergate`)
REMOTE_VERSION_FIELDS = ("urls", "api_key_env", "dialect")


def _base_url(url: str) -> str:
    """Refuse a tier URL that carries a secret or more than a base URL. A URL is logged with each health check and
    tier error, shown as a replica's reason on the admin /health and the dashboard, and hashed into model versions:
    credentials in it (`https://user:key@host`) or a key in its query (`?api-key=...`) would be written there. The
    key belongs in the environment variable `api_key_env` names; a query or fragment would be lost anyway, as the
    client appends `/v1/chat/completions` to the URL. The message never repeats the URL (nor does the error: the
    models hide their input in errors)."""
    try:
        parts = urlsplit(url)
        userinfo = parts.username is not None or parts.password is not None
    except ValueError:  # an unparsable port or host
        raise ValueError("a tier URL is a base URL (scheme://host:port/path); this one cannot be parsed") from None
    if userinfo:
        raise ValueError("a tier URL may not hold credentials (user:password@): they would be written to logs and "
                         "/health; put the upstream's key in an environment variable and name it in `api_key_env`")
    if "?" in url or "#" in url:
        raise ValueError("a tier URL is a base URL (scheme://host:port/path), without a query string or fragment: "
                         "a key there would be written to logs and /health, and the client appends "
                         "/v1/chat/completions to the URL; put the upstream's key in an environment variable and "
                         "name it in `api_key_env`")
    return url


BaseUrl = Annotated[str, AfterValidator(_base_url)]


class DistillSpec(NoBoolNumbers):
    """How a tier's model is built when missing: a student distilled from another tier's model."""

    model_config = ConfigDict(extra="forbid")

    teacher: str  # the tier whose model it learns to imitate
    layers: Annotated[int, Field(ge=1)] = 8
    budget: str = "10m"  # training time (10m, 1h) or steps (500steps)
    seed: int = 0

    @field_validator("budget")
    @classmethod
    def _budget(cls, value: str) -> str:
        try:
            parse_budget(value)
        except BudgetError as exc:
            raise ValueError(str(exc)) from exc
        return value

    def command(self) -> str:
        return f"tiergate models distill --teacher {self.teacher} --layers {self.layers} --budget {self.budget}"


class SpeculativeSpec(NoBoolNumbers):
    """Speculative decoding for a local tier (engine/speculative.py): another local tier's model, with the same
    tokenizer, drafts `k` tokens that this tier's model checks in one step, while at most `max_batch` sequences
    decode. Greedy answers are unchanged; sampled ones come from the same distribution."""

    model_config = ConfigDict(extra="forbid")

    draft: str  # the local tier whose model drafts (its model, quantize and dtype; it runs inside this tier's engine)
    k: Annotated[int, Field(ge=1, le=8)] = 4
    max_batch: Annotated[int, Field(ge=1, le=256)] = 4


class TierVersion(NoBoolNumbers):
    """One version of a tier (`versions:` in tiers.yaml): a name and the fields that differ from the tier's; every
    field left out is the tier's. A field given as `null` is overridden to null (`quantize: null`). A version of a
    local tier runs engines of its own (model, precision, engine flags, `cores` weight); one of a remote tier points
    at its own servers (`urls`, `api_key_env`, `dialect`)."""

    model_config = ConfigDict(extra="forbid", hide_input_in_errors=True)  # a URL may hold a secret (_base_url)

    name: Annotated[str, Field(min_length=1, max_length=64, pattern=VERSION_NAME)]
    model: str | None = None
    quantize: Literal["int8"] | None = None
    dtype: Literal["auto", "fp32", "bf16", "fp16"] | None = None
    urls: list[BaseUrl] | None = None
    api_key_env: str | None = None
    dialect: Dialect | None = None
    tools: bool | None = None
    max_num_seqs: Annotated[int, Field(ge=1)] | None = None
    kv_cache_bytes: Annotated[int, Field(ge=1 << 20)] | None = None
    kv_cache_dtype: Literal["auto", "bf16"] | None = None
    threads: Annotated[int, Field(ge=1)] | None = None
    tokenizer: str | None = None
    cores: Annotated[float, Field(gt=0, le=1024)] | None = None

    def overrides(self) -> dict[str, object]:
        """The fields this version sets (what it changes about the tier)."""
        return {name: getattr(self, name) for name in self.model_fields_set - {"name"}}


class TierSpec(NoBoolNumbers):
    model_config = ConfigDict(extra="forbid", hide_input_in_errors=True)  # a URL may hold a secret (_base_url)

    name: str = ""  # filled from the mapping key
    description: str = ""
    backend: Literal["local", "openai"]
    # local: a built-in model name or a model directory (relative paths are under the models dir);
    # openai: the model id the upstream serves
    model: str
    quantize: Literal["int8"] | None = None
    dtype: Literal["auto", "fp32", "bf16", "fp16"] = "auto"
    device: str = "cpu"
    replicas: Annotated[int, Field(ge=1, le=64)] = 1  # local engine processes
    urls: list[BaseUrl] = Field(default_factory=list)  # openai backend: one URL per replica
    api_key_env: str | None = None  # openai backend: env var that holds the upstream's key
    # openai backend: the extensions its server accepts [default: none beyond OpenAI's API]; local: tiergate
    dialect: Dialect | None = None
    # the tier answers OpenAI's tool calling (`tools`, `tool_choice`, tool messages): our engine renders and parses
    # them (wire/tool_calls.py); a remote server gets them as sent, so say `false` for one that cannot (a llama.cpp
    # server started without `--jinja`, a model with no tool template) and routing keeps tool requests off it
    tools: bool = True
    # sequences each engine runs at once [default: what its KV cache holds for a typical request, so the engine
    # and the gateway's dispatch slots agree; tiers/supervisor.py's engine_max_num_seqs]
    max_num_seqs: Annotated[int, Field(ge=1)] | None = None
    kv_cache_bytes: Annotated[int, Field(ge=1 << 20)] | None = None  # the engine's KV cache budget [engine default]
    kv_cache_dtype: Literal["auto", "bf16"] = "auto"  # bf16: half the KV bytes under an fp32 model
    threads: Annotated[int, Field(ge=1)] | None = None  # torch threads per engine [default: its share of cores]
    # local: this tier's weight, per replica, when the host's cores are split among local replicas (a tier with
    # `cores: 2` gets twice the cores of one with 1) [default 1: equal shares]; tiers/core_plan.py's plan_cores
    cores: Annotated[float, Field(gt=0, le=1024)] | None = None
    prepared_by: str | None = None  # the command that builds this tier's model when it is missing
    distill: DistillSpec | None = None  # built by distilling another tier's model (serve does it when missing)
    speculative: SpeculativeSpec | None = None  # local: another local tier's model drafts tokens for this one's
    tokenizer: str | None = None  # model source whose tokenizer counts prompt tokens [default: `model` if local]
    max_concurrency: Annotated[int, Field(ge=1)] | None = None  # dispatch slots per replica [default: max_num_seqs]
    price_per_1k_input: PricePer1K
    price_per_1k_output: PricePer1K
    hardware_cost_per_hour: Money
    context_limit: Annotated[int, Field(ge=16)]
    # versions of the tier (README.md, "Model versions and rollouts"): each inherits the fields above and changes
    # some; `serving` names the one that answers when no rollout says otherwise, and the tier's own fields are
    # then that version's
    versions: list[TierVersion] = Field(default_factory=list)
    serving: str | None = None
    # a rollout's guards on this tier unless its start says otherwise (gateway/rollout/guards.py `Guards` checks
    # the names and bounds when the gateway loads the file): e.g. {max_error_rate: 0.02, window_s: 600}
    rollout_guards: dict[str, float | int | None] = Field(default_factory=dict)
    _version: str | None = PrivateAttr(None)  # the version this spec is (None: a tier without versions)
    _variants: dict[str, TierSpec] = PrivateAttr(default_factory=dict)  # version name -> its spec
    _draft: TierSpec | None = PrivateAttr(None)  # the tier `speculative.draft` names (set by the catalogue)

    @field_validator("price_per_1k_input", "price_per_1k_output", "hardware_cost_per_hour", mode="before")
    @classmethod
    def _exact(cls, value: object) -> object:
        # YAML reads 0.0002 as a float; go through its shortest repr so money stays exact
        return repr(value) if isinstance(value, float) else value

    @model_validator(mode="after")
    def _backend_fields(self) -> TierSpec:
        if self.backend == "openai" and not self.urls:
            raise ValueError("an openai backend needs `urls` (one OpenAI-compatible base URL per replica)")
        if self.backend == "local" and self.urls:
            raise ValueError("a local backend spawns its own engines; remove `urls`")
        if self.backend == "local" and self.dialect not in (None, "tiergate"):
            raise ValueError("a local backend runs our engine, which speaks `tiergate`; remove `dialect`")
        if self.dialect is None:
            self.dialect = "tiergate" if self.backend == "local" else "openai"
        if self.cores is not None and self.backend != "local":
            raise ValueError("`cores` splits this host's cores among local engines; a remote tier has its own")
        if self.distill and self.backend != "local":
            raise ValueError("only a local tier can be distilled")
        if self.speculative and self.backend != "local":
            raise ValueError("`speculative` runs a draft model inside our engine; a remote tier has its own server")
        if self.distill and not self.prepared_by:
            self.prepared_by = self.distill.command()
        return self

    @model_validator(mode="after")
    def _versions(self) -> TierSpec:
        """Each version's spec (the tier's fields with its own), and the tier's fields become the serving one's."""
        if not self.versions:
            if self.serving is not None:
                raise ValueError("`serving` names one of the tier's `versions`, and this tier lists none")
            return self
        names = [v.name for v in self.versions]
        if dupes := sorted({n for n in names if names.count(n) > 1}):
            raise ValueError(f"versions: duplicate name(s) {', '.join(dupes)}")
        if self.serving is None:
            raise ValueError(f"a tier with `versions` names the one answering today in `serving` (one of "
                             f"{', '.join(names)})")
        if self.serving not in names:
            raise ValueError(f"serving: {self.serving!r} is not one of the tier's versions ({', '.join(names)})")
        base = self.model_dump(exclude={"versions", "serving", "name"})
        for v in self.versions:
            if self.backend == "local" and (remote := [f for f in REMOTE_VERSION_FIELDS if f in v.model_fields_set]):
                fields = ", ".join(f"`{f}`" for f in remote)
                raise ValueError(f"version {v.name!r}: {fields} belong to a remote tier's version; a local tier's "
                                 "versions run engines of their own (they may change model, quantize, dtype, "
                                 "kv_cache_bytes, kv_cache_dtype, max_num_seqs, threads, cores, tokenizer, tools)")
            try:
                spec = TierSpec.model_validate(base | v.overrides())
            except ValidationError as exc:
                raise ValueError(f"version {v.name!r}: {exc.errors()[0]['msg']}") from None
            spec._version = v.name
            self._variants[v.name] = spec
        for name in self.versions[names.index(self.serving)].overrides():
            setattr(self, name, getattr(self._variants[self.serving], name))
        self._version = self.serving
        self._variants[self.serving] = self
        return self

    @property
    def draft(self) -> TierSpec | None:
        """The tier whose model drafts for this one (`speculative`), once the catalogue has checked it; None for a
        tier that is not speculative (a version cannot change `speculative`, so every version has the same)."""
        return self.__pydantic_private__["_draft"]  # type: ignore[index]  # (self._draft: ~2.7 µs a read)

    @property
    def version_name(self) -> str | None:
        """The version this spec is: the serving one for a tier with versions, None for a tier without."""
        return self.__pydantic_private__["_version"]  # type: ignore[index]  # (self._version: ~2.7 µs a read)

    @property
    def variants(self) -> dict[str, TierSpec]:
        """Version name -> its spec (the serving one is this spec itself); empty for a tier without versions."""
        return self.__pydantic_private__["_variants"]  # type: ignore[index]  # (self._variants: ~2.7 µs a read)

    def variant(self, version: str) -> TierSpec:
        """The spec of one of the tier's versions (KeyError if it has no such version)."""
        return self._variants[version]

    @property
    def sends_continuous_usage(self) -> bool:
        """Its server reports usage in every stream chunk when asked (`continuous_usage_stats`)."""
        return self.dialect in CONTINUOUS_USAGE

    @property
    def sends_priority(self) -> bool:
        """Its server schedules by vLLM's `priority` field (lower first)."""
        return self.dialect in PRIORITY

    @property
    def samples_top_k(self) -> bool:
        """Its server samples by vLLM's `top_k` (the `k` most likely tokens only)."""
        return self.dialect in TOP_K

    @property
    def formats_completions(self) -> bool:
        """Its server's /v1/completions takes `response_format` (vLLM's field; OpenAI's legacy API has none)."""
        return self.dialect in COMPLETION_RESPONSE_FORMAT

    @property
    def formats_with_free_calls(self) -> bool:
        """Its server constrains a chat answer by `response_format` while the model may call tools (tool_choice
        `auto`; FORMAT_WITH_FREE_CALLS)."""
        return self.dialect in FORMAT_WITH_FREE_CALLS

    @property
    def sends_cache_salt(self) -> bool:
        """Its server keeps a request's prefix cache apart by vLLM's `cache_salt` body field."""
        return self.dialect in CACHE_SALT_FIELD

    def price(self, input_tokens: int, output_tokens: int) -> Decimal:
        """What the tenant pays for these tokens at this tier."""
        return (self.price_per_1k_input * input_tokens + self.price_per_1k_output * output_tokens) / 1000

    def compute_cost(self, busy_s: float) -> Decimal:
        """What `busy_s` seconds of this tier's hardware cost us, to the picodollar (quotas/money.py `round_cost`)."""
        return round_cost(self.hardware_cost_per_hour * Decimal(repr(busy_s)) / 3600)


class EmbeddingSpec(NoBoolNumbers):
    """The embedding model of POST /v1/embeddings: the semantic cache's MiniLM, run in the gateway process.

    Its price sits here, beside the tiers' prices, because it is a model's price: the same for every plan, read by
    finance next to its compute cost. A plan's limits and budgets apply to it as to chat (tokens and money are
    reserved under the plan's scopes).
    """

    model_config = ConfigDict(extra="forbid")

    enabled: bool = True
    model: Annotated[str, Field(min_length=1, max_length=256)] = "all-MiniLM-L6-v2"  # the name clients send
    description: str = "all-MiniLM-L6-v2 sentence embeddings (384 dimensions, normalized), batched in the gateway"
    price_per_1k_input: PricePer1K = Decimal("0.00001")
    hardware_cost_per_hour: Money = Decimal("0.02")  # the gateway's cores while they embed

    @field_validator("price_per_1k_input", "hardware_cost_per_hour", mode="before")
    @classmethod
    def _exact(cls, value: object) -> object:
        return repr(value) if isinstance(value, float) else value

    def price(self, tokens: int) -> Decimal:
        return self.price_per_1k_input * tokens / 1000

    def compute_cost(self, busy_s: float) -> Decimal:
        return round_cost(self.hardware_cost_per_hour * Decimal(repr(busy_s)) / 3600)


class TierCatalogue(NoBoolNumbers):
    model_config = ConfigDict(extra="forbid", hide_input_in_errors=True)  # a URL may hold a secret (_base_url)

    tiers: Annotated[dict[str, TierSpec], Field(min_length=1)]
    embeddings: EmbeddingSpec = Field(default_factory=EmbeddingSpec)

    @model_validator(mode="after")
    def _names(self) -> TierCatalogue:
        for name, spec in self.tiers.items():
            if name == "auto":
                raise ValueError("`auto` is reserved for routing; name the tier otherwise")
            spec.name = name
            for variant in spec.variants.values():
                variant.name = name
        if self.embeddings.model in self.tiers or self.embeddings.model == "auto":
            raise ValueError(f"the embedding model's name {self.embeddings.model!r} is a tier's; name it otherwise")
        for spec in self.tiers.values():
            teacher = spec.distill.teacher if spec.distill else None
            if teacher is not None and (teacher not in self.tiers or self.tiers[teacher].backend != "local"
                                        or teacher == spec.name):
                raise ValueError(f"tier {spec.name!r} is distilled from {teacher!r}, which is not another local tier")
            if spec.speculative is not None:
                draft = self.tiers.get(spec.speculative.draft)
                if draft is None or draft.backend != "local" or draft.name == spec.name:
                    raise ValueError(f"tier {spec.name!r}: speculative.draft {spec.speculative.draft!r} is not "
                                     "another local tier")
                if draft.speculative is not None:
                    raise ValueError(f"tier {spec.name!r}: its draft tier {draft.name!r} is itself speculative; "
                                     "a draft runs plain")
                for variant in (spec, *spec.variants.values()):
                    variant._draft = draft
        return self

    def student_of(self, teacher: str) -> TierSpec | None:
        """The tier whose model is distilled from tier `teacher`, if any."""
        return next((t for t in self.tiers.values() if t.distill and t.distill.teacher == teacher), None)

    def by_price(self) -> list[TierSpec]:
        """Tiers from cheapest to dearest (output price, then input price)."""
        return sorted(self.tiers.values(), key=lambda t: (t.price_per_1k_output, t.price_per_1k_input))
