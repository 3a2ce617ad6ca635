"""The tier catalogue (`tiers/tiers.yaml`): what each tier runs, where, and what it costs."""

from __future__ import annotations

from decimal import Decimal
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

Money = Annotated[Decimal, Field(ge=0, max_digits=18, decimal_places=12)]


class TierSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

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
    urls: list[str] = Field(default_factory=list)  # openai backend: one URL per replica
    api_key_env: str | None = None  # openai backend: env var that holds the upstream's key
    max_num_seqs: Annotated[int, Field(ge=1)] = 8
    kv_cache_bytes: Annotated[int, Field(ge=1 << 20)] | None = None  # the engine's KV cache budget [engine default]
    threads: Annotated[int, Field(ge=1)] | None = None
    prepared_by: str | None = None  # the command that builds this tier's model when it is missing
    tokenizer: str | None = None  # model source whose tokenizer counts prompt tokens [default: `model` if local]
    max_concurrency: Annotated[int, Field(ge=1)] | None = None  # dispatch slots per replica [default: max_num_seqs]
    price_per_1k_input: Money
    price_per_1k_output: Money
    hardware_cost_per_hour: Money
    context_limit: Annotated[int, Field(ge=16)]

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
        return self

    def price(self, input_tokens: int, output_tokens: int) -> Decimal:
        """What the tenant pays for these tokens at this tier."""
        return (self.price_per_1k_input * input_tokens + self.price_per_1k_output * output_tokens) / 1000

    def compute_cost(self, busy_s: float) -> Decimal:
        """What `busy_s` seconds of this tier's hardware cost us."""
        return self.hardware_cost_per_hour * Decimal(repr(busy_s)) / 3600


class TierCatalogue(BaseModel):
    model_config = ConfigDict(extra="forbid")

    tiers: Annotated[dict[str, TierSpec], Field(min_length=1)]

    @model_validator(mode="after")
    def _names(self) -> TierCatalogue:
        for name, spec in self.tiers.items():
            if name == "auto":
                raise ValueError("`auto` is reserved for routing; name the tier otherwise")
            spec.name = name
        return self

    def by_price(self) -> list[TierSpec]:
        """Tiers from cheapest to dearest (output price, then input price)."""
        return sorted(self.tiers.values(), key=lambda t: (t.price_per_1k_output, t.price_per_1k_input))
