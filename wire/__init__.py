"""OpenAI's wire format, in one leaf package: request models, response builders, SSE framing, error bodies.

It imports nothing of ours, so the gateway, the engine's server, the cache and the tiers' client all share
one definition of what crosses the wire.
"""
