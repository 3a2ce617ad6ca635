"""Gateway settings: `TIERGATE_*` environment variables (or `.env`), overridable by CLI flags."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr, ValidationInfo, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from gateway.connection_cap import ADDRESS_SHARE, MAX_CONNECTIONS
from wire.errors import MAX_BODY_BYTES

REPO_ROOT = Path(__file__).resolve().parent.parent
LEASE_REAP_ROUNDS = 3  # TIERGATE_QUOTA_LEASE_S is at least this many TIERGATE_QUOTA_REAP_EVERY_S
MIN_TICK_S = 0.01  # TIERGATE_LADDER_TICK_S: a shorter tick (or 0) only spins a core on the ladder and rollout guards
# TIERGATE_WORKERS (and serve --workers): a fixed cap, the same on every host, well above what one host's cores use
# (each worker is a process with its own connections and caches); a typo (1000000) is refused, not forked
MAX_WORKERS = 64
# TIERGATE_CORE_BUDGET's words, as tiers/core_plan.py reads them
CORE_BUDGET_ON = ("on", "1", "true", "yes", "")
CORE_BUDGET_OFF = ("off", "0", "false", "no")


def _default_data_dir() -> Path:
    return Path.home() / ".local" / "share" / "tiergate"


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="TIERGATE_", env_file=".env", extra="ignore")

    data_dir: Path = Field(default_factory=_default_data_dir)  # state, ledger and prepared models
    models_dir: Path | None = None  # defaults to <data_dir>/models
    host: str = "127.0.0.1"  # empty is refused: it would listen on every interface (0.0.0.0 and ::)
    port: int = Field(default=8080, ge=1, le=65535)
    tiers_file: Path = REPO_ROOT / "tiers" / "tiers.yaml"
    plans_file: Path = REPO_ROOT / "quotas" / "plans.yaml"
    ladder_file: Path = REPO_ROOT / "degrade_ladder.yaml"
    redis_url: str | None = None  # set: quotas are shared through Redis by every replica
    # set (postgresql://user:password@host:5432/db): tenants, keys, data versions, the ledger, refusal counts,
    # the ladder's audit and idempotency records live in PostgreSQL, shared by replicas on any host (README,
    # "Deployment"); unset: SQLite files in the data directory
    database_url: str | None = None
    # how long start-up (`tiergate serve`, create_app) waits, for each store it opens, for a database that does not
    # answer yet (down, starting, full), trying again with a growing pause and a log line each try, before it stops
    # with one line (gateway/stores.py); a server that refuses who connects (password, role, database name) stops it
    # at once; 0: one try. The CLI's other commands always try once
    database_start_wait_s: float = Field(60.0, ge=0, allow_inf_nan=False)
    # per replica, for idempotency records (the ledger and tenants have their own)
    database_max_connections: int = Field(10, ge=1)
    # a key lookup's (or data-version read's) longest wait for another session's table lock (an operator's LOCK TABLE,
    # an ALTER), then a retryable 503 `database_busy`, rather than its 5 s statement timeout on one of two lookup
    # threads (gateway/tenants/store_postgres.py); 0: no bound but the statement timeout
    tenant_lookup_lock_timeout_s: float = Field(0.2, ge=0, allow_inf_nan=False)
    # a ledger read a request waits on (re-seeding a Redis that lost a tenant's counters, quotas/seed.py): its longest
    # wait for another session's table lock, then a retryable 503 `quota_backend_unavailable` with nothing charged,
    # rather than its 60 s statement timeout; 0: no bound but the statement timeout
    ledger_read_lock_timeout_s: float = Field(0.5, ge=0, allow_inf_nan=False)
    # keys the hash of what names a tenant's users and caches (user, safety_identifier, prompt_cache_key) before a
    # remote tier gets it (gateway/pipeline/tier_call.py); the same on every replica, never shown to an upstream
    hint_secret: SecretStr = SecretStr("")
    redis_timeout_s: float = Field(0.05, gt=0, allow_inf_nan=False)  # per Redis call
    redis_failure_mode: Literal["open", "closed"] = "open"  # open: local limits; closed: 503
    # per replica; a request waits for a free one (back-pressure, not an outage)
    redis_max_connections: int = Field(64, ge=1)
    redis_pool_wait_s: float = Field(2.0, gt=0, allow_inf_nan=False)  # ...this long at most, then a retryable 503
    # start even when that Redis may evict keys (a maxmemory with a policy but noeviction): gateway/redis_eviction.py
    redis_allow_eviction: bool = False
    # how often the running gateway reads that policy again (gateway/redis_eviction_watch.py): a change shows in the
    # log, /metrics and /health within this
    redis_eviction_check_s: float = Field(30.0, gt=0, allow_inf_nan=False)
    # how often each replica returns reservations whose lease ran out
    quota_reap_every_s: float = Field(5.0, gt=0, allow_inf_nan=False)
    # a reservation's lease: a request still running past a third of it renews it at each reap round, so it runs out
    # only for a replica that died (or lost the store) before settling
    quota_lease_s: float = Field(900.0, gt=0, allow_inf_nan=False)
    # a settle Redis did not answer is retried in the background this long
    quota_settle_retry_s: float = Field(600.0, ge=0, allow_inf_nan=False)
    default_max_tokens: int = Field(1024, ge=1)  # the output cap reserved when a request sets none
    remote_max_concurrency: int = Field(64, ge=1)  # dispatch slots per replica of an `openai` tier
    dispatch_policy: Literal["vtc", "fifo"] = "vtc"  # fifo: no fairness between tenants (a baseline)
    cache_enabled: bool = True  # the answer cache (plans and headers decide per request)
    # beyond it, the tenant holding the most entries loses its least recently used
    cache_max_entries: int = Field(100_000, ge=1)
    # one tenant's own bound: it evicts only its own entries beyond it
    cache_max_entries_per_tenant: int = Field(25_000, ge=1)
    # ...and what one tenant's entries may hold in bytes (cache.store.stored_bytes: texts and vectors), likewise
    cache_max_bytes_per_tenant: int = Field(256 << 20, gt=0)  # cache.store.MAX_BYTES_PER_TENANT
    cache_embed_max_batch: int = Field(32, ge=1)  # texts per embedding forward pass (1: one at a time, the ablation)
    # the longest a text waits for others to share its forward pass
    cache_embed_max_wait_ms: float = Field(3.0, ge=0, allow_inf_nan=False)
    # how often the ladder follows shared changes and evaluates its triggers
    ladder_tick_s: float = Field(0.5, ge=MIN_TICK_S, allow_inf_nan=False)
    # larger bodies get 413 before anything is parsed (local engines: too)
    max_body_bytes: int = Field(MAX_BODY_BYTES, ge=1)
    # a request (line, headers, body) must arrive whole within this, from its connection or the previous answer's
    # end, or its connection is closed (gateway/http_limits.py: slow clients cannot hold connections for ever)
    request_receipt_timeout_s: float = Field(30.0, gt=0, allow_inf_nan=False)
    # a connection whose answer stays unread this long (the client's socket full) is aborted and its request cancelled
    response_stall_timeout_s: float = Field(60.0, gt=0, allow_inf_nan=False)
    # ...and one whose client takes its paused answer slower than this (bytes/s) is too, once the answer's paused
    # time passes the stall limit and a second for each of these bytes taken (a trickle reader: http_limits.py)
    # gateway/http_limits.py MIN_READ_BYTES_PER_S; finite: at an infinite rate no client would earn paused time
    response_min_read_bytes_per_s: float = Field(2048.0, gt=0, allow_inf_nan=False)
    # client connections a process keeps (fewer where its open-file limit is low): past it, the one idle longest is
    # closed for a new one (gateway/connection_cap.py: idle sockets cannot take the descriptors requests need)
    max_connections: int = Field(MAX_CONNECTIONS, gt=0)
    # ...and with all of them open, one peer address holding more than this share of them makes room only among its
    # own (refused when none of its own is idle or unfinished), others among its first (1: ages alone decide)
    connection_share_per_address: float = Field(ADDRESS_SHARE, gt=0, le=1, allow_inf_nan=False)
    # normal: a ledger commit reaches the OS before the response ends (survives a killed gateway);
    # full: it reaches the disk too (survives a power cut; an fsync per group commit, ~4 ms here).
    # SQLite only: with a database_url a commit is as durable as PostgreSQL's synchronous_commit (on: the disk)
    ledger_sync: Literal["normal", "full"] = "normal"
    engine_start_timeout_s: float = Field(600.0, gt=0, allow_inf_nan=False)
    build_missing_models: bool = True  # serve distils missing students and the router's model in the background
    build_router_model: bool = True  # ...and the router's difficulty model, once the tiers it reads are built
    upstream_connect_timeout_s: float = Field(5.0, gt=0, allow_inf_nan=False)
    upstream_read_timeout_s: float = Field(600.0, gt=0, allow_inf_nan=False)
    # gateway processes `tiergate serve` runs on one port (SO_REUSEPORT); more than one needs redis_url, where the
    # quotas are counted for all of them (README, "What runs")
    workers: int = Field(default=1, ge=1, le=MAX_WORKERS)
    # set in each worker of `tiergate serve --workers N`: the parent supervises the local engines and publishes them
    # here (tiers/engines_file.py); this process follows them and never starts one
    engines_file: Path | None = None
    # read from the environment where they act (cache/embedder.py; tiers/core_plan.py), and checked here so that a typo
    # is one line at start-up, before anything is written, not a traceback once the cache and engines start (or, for
    # the core budget, a word taken as `on`)
    embedder_runtime: Literal["auto", "onnx", "torch"] = "auto"  # empty: auto
    core_budget: str = "on"  # on or off (1/0, true/false, yes/no); empty: on
    gateway_cores: int | None = Field(None, ge=0)  # cores kept for the gateway; empty: tiers/core_plan.py's default

    @field_validator("host", mode="before")
    @classmethod
    def _host_given(cls, host: object) -> object:
        # uvicorn binds an empty host on every interface: an unset variable in a unit or compose template (`${HOST}`)
        # exposed the gateway where the default is 127.0.0.1
        if isinstance(host, str) and not host.strip():
            raise ValueError("empty: it would listen on every interface; unset it for 127.0.0.1, or give 0.0.0.0 "
                             "(or ::) to listen on every interface")
        return host

    @field_validator("data_dir", "models_dir", "tiers_file", "plans_file", "ladder_file", "engines_file",
                     mode="before")
    @classmethod
    def _path_given(cls, path: object) -> object:
        # an empty path is the current directory: `tiergate tenants create` then wrote a new, empty ./state.db
        if isinstance(path, str) and not path.strip():
            raise ValueError("empty: it would be the current directory; unset it for the default, or give a path")
        return path

    @field_validator("embedder_runtime", "gateway_cores", mode="before")
    @classmethod
    def _blank_is_default(cls, value: object, info: ValidationInfo) -> object:
        if isinstance(value, str) and not value.strip():  # as their readers take it
            return cls.model_fields[info.field_name].default
        return value.strip() if isinstance(value, str) else value

    @field_validator("core_budget")
    @classmethod
    def _core_budget_word(cls, value: str) -> str:
        word = value.strip().lower()
        if word not in CORE_BUDGET_ON + CORE_BUDGET_OFF:
            raise ValueError("on or off (or 1/0, true/false, yes/no; empty: on)")
        return "off" if word in CORE_BUDGET_OFF else "on"

    @field_validator("database_url")
    @classmethod
    def _postgres_only(cls, url: str | None) -> str | None:
        if url and url.split("://", 1)[0] not in ("postgresql", "postgres"):
            raise ValueError("TIERGATE_DATABASE_URL must be a postgresql:// URL (unset: SQLite in the data directory)")
        return url or None

    @model_validator(mode="after")
    def _lease_outlasts_reap_rounds(self) -> Settings:
        # a running request's lease is renewed once a reap round, from a third of it on: a lease under three rounds
        # can run out between two renewals, and a live request is then reaped (refunded, its slot freed) mid-answer
        if self.quota_lease_s < LEASE_REAP_ROUNDS * self.quota_reap_every_s:
            raise ValueError(f"TIERGATE_QUOTA_LEASE_S ({self.quota_lease_s:g} s) must be at least "
                             f"{LEASE_REAP_ROUNDS} x TIERGATE_QUOTA_REAP_EVERY_S ({self.quota_reap_every_s:g} s), "
                             f"{LEASE_REAP_ROUNDS * self.quota_reap_every_s:g} s: the reaper renews running requests' "
                             "leases once a round, and a shorter lease lets a live request be reaped")
        return self

    @field_validator("redis_url")
    @classmethod
    def _redis_only(cls, url: str | None) -> str | None:
        if url and url.split("://", 1)[0] not in ("redis", "rediss", "unix"):
            raise ValueError("TIERGATE_REDIS_URL must be a redis://, rediss:// or unix:// URL (unset: no Redis)")
        return url or None

    @property
    def resolved_models_dir(self) -> Path:
        return self.models_dir or self.data_dir / "models"

    @property
    def state_db(self) -> Path:
        return self.data_dir / "state.db"

    @property
    def ledger_db(self) -> Path:
        return self.data_dir / "ledger.db"
