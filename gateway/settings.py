"""Gateway settings: `TIERGATE_*` environment variables (or `.env`), overridable by CLI flags."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

REPO_ROOT = Path(__file__).resolve().parent.parent


def _default_data_dir() -> Path:
    return Path.home() / ".local" / "share" / "tiergate"


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="TIERGATE_", env_file=".env", extra="ignore")

    data_dir: Path = Field(default_factory=_default_data_dir)  # state, ledger and prepared models
    models_dir: Path | None = None  # defaults to <data_dir>/models
    host: str = "127.0.0.1"
    port: int = 8080
    tiers_file: Path = REPO_ROOT / "tiers" / "tiers.yaml"
    plans_file: Path = REPO_ROOT / "quotas" / "plans.yaml"
    ladder_file: Path = REPO_ROOT / "degrade_ladder.yaml"
    redis_url: str | None = None  # set: quotas are shared through Redis by every replica
    redis_timeout_s: float = 0.05  # per Redis call
    redis_failure_mode: Literal["open", "closed"] = "open"  # open: local limits; closed: 503
    default_max_tokens: int = 1024  # the output cap reserved when a request sets none
    remote_max_concurrency: int = 64  # dispatch slots per replica of an `openai` tier
    dispatch_policy: Literal["vtc", "fifo"] = "vtc"  # fifo: no fairness between tenants (a baseline)
    cache_enabled: bool = True  # the answer cache (plans and headers decide per request)
    cache_max_entries: int = 100_000
    ladder_tick_s: float = 0.5  # how often the ladder follows shared changes and evaluates its triggers
    max_body_bytes: int = 4 * 1024 * 1024  # larger bodies get 413 before anything is parsed
    engine_start_timeout_s: float = 600.0
    build_missing_models: bool = True  # serve distils missing students and the router's model in the background
    build_router_model: bool = True  # ...and the router's difficulty model, once the tiers it reads are built
    upstream_connect_timeout_s: float = 5.0
    upstream_read_timeout_s: float = 600.0

    @property
    def resolved_models_dir(self) -> Path:
        return self.models_dir or self.data_dir / "models"

    @property
    def state_db(self) -> Path:
        return self.data_dir / "state.db"

    @property
    def ledger_db(self) -> Path:
        return self.data_dir / "ledger.db"
