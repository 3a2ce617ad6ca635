"""The environment variable an engine reads its API key from (engine/engine_auth.py: every route but /health then
wants it as a Bearer token). Here, below both, so that the supervisor (tiers/supervisor.py), which keeps it from the
local engines it starts, and the CLI's `--api-key-env` default name it without importing the engine."""

ENGINE_API_KEY_ENV = "TIERGATE_ENGINE_API_KEY"
