"""The difficulty model as the router sees it, followed on disk: loaded when its artifact appears or changes.

The model itself (`tiers/difficulty.py`, trained by `tiergate router train`) is imported only when an
artifact is there to load (with the cascade's calibration that travels in it: `calibration`), so a gateway
without it, or without its dependencies, routes `auto` by the plan's default tier and says so. `tiergate run`
builds the artifact after the gateway has started, so the file is looked at again every `check_every_s`; a
changed file (a retrained model) replaces the loaded one without a restart. Loading and predicting run in a
worker thread: both can embed text, which must not stall the event loop. Predictions have threads of their own
(`Threads`: the gateway's take tenants in turn, gateway/fair_threads.py; PREDICT_THREADS of them): on asyncio's
default executor, a tenant's `auto` requests (one MiniLM pass each, refused or not) held the threads every
tenant's cache lookups wait on, and first come, first served, its queued predictions held every other tenant's.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import time
from collections.abc import Callable, Hashable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Protocol

from tiers.routing import Prediction

log = logging.getLogger("tiergate.router")
DIFFICULTY_MODULE = "tiers.difficulty"
CHECK_EVERY_S = 5.0
PREDICT_THREADS = 2  # threads for predictions (a MiniLM pass each), apart from the request path's


class DifficultyPredictor(Protocol):
    """What the router needs of a difficulty model."""

    version: str  # the artifact's version, written into route reasons and the ledger

    def predict(self, messages: list[dict[str, Any]]) -> dict[str, float]:
        """Predicted fidelity (0-1) per tier name for this conversation; the reference tier is 1.0."""
        ...

    # Optional: `uninformative` (tier -> why its prediction is no better than the mean's; default none) and
    # `cascade` (the cascade's CascadeCalibration; default none), as tiers/difficulty.py's model has them.


Loader = Callable[[Path], DifficultyPredictor]


class Threads(Protocol):
    """Where predictions run: `fn(*args)` in a worker thread when `owner`'s turn comes."""

    async def run(self, owner: Hashable, fn: Callable[..., Any], *args: Any) -> Any: ...

    def close(self) -> None: ...


class OwnThreads:
    """PREDICT_THREADS threads, first come, first served (owners ignored): a source used outside a gateway."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=PREDICT_THREADS, thread_name_prefix="tiergate-predict")

    async def run(self, owner: Hashable, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def default_artifact(data_dir: Path) -> Path:
    """Where `tiergate router train` (and the run command) write the artifact: the difficulty module's
    `default_artifact_path`, which is this path; it is not imported here, so nothing heavy loads unasked."""
    return data_dir / "router" / "difficulty.json"


def load_from_module(path: Path) -> DifficultyPredictor:
    """Import the difficulty module on first use and load `path` with it (ValueError: unusable artifact)."""
    try:
        module = importlib.import_module(DIFFICULTY_MODULE)
    except ImportError as exc:
        raise ValueError(f"the difficulty model cannot be loaded: {DIFFICULTY_MODULE} is missing ({exc})") from exc
    return module.load_difficulty_model(path)  # type: ignore[no-any-return]


class PredictorSource:
    """The current difficulty model, reloaded when its file changes; None until a valid one exists."""

    def __init__(self, path: Path, loader: Loader = load_from_module, *, check_every_s: float = CHECK_EVERY_S,
                 clock: Callable[[], float] = time.monotonic, threads: Threads | None = None) -> None:
        self.path = path
        self.loader = loader
        self.check_every_s = check_every_s
        self._clock = clock
        self.model: DifficultyPredictor | None = None
        self.error: str | None = None  # why the last artifact could not be loaded
        self._seen: tuple[int, int] | None = None  # (mtime_ns, size) of the file last loaded or rejected
        self._checked_at: float | None = None
        # The look at the file (and the load it starts) under way: a task of its own, which the callers awaiting it
        # shield, so a request cancelled mid-load (its client left) neither throws the loaded model away nor starts
        # a second load; callers arriving meanwhile wait for this one.
        self._checking: asyncio.Task[None] | None = None
        self._threads = threads or OwnThreads()

    @classmethod
    def for_data_dir(cls, data_dir: Path, *, threads: Threads | None = None) -> PredictorSource:
        return cls(default_artifact(data_dir), threads=threads)

    async def current(self) -> DifficultyPredictor | None:
        """The model to use now, looking at the file at most every `check_every_s`."""
        now = self._clock()
        if self._checked_at is not None and now - self._checked_at < self.check_every_s:
            return self.model
        if self._checking is None:
            self._checking = asyncio.get_running_loop().create_task(self._check())
        await asyncio.shield(self._checking)
        return self.model

    async def _check(self) -> None:
        try:
            await self._refresh()
        finally:
            self._checked_at = self._clock()
            self._checking = None

    async def predict(self, messages: list[dict[str, Any]] | Callable[[], list[dict[str, Any]]], *,
                      owner: Hashable = None) -> Prediction | str:
        """The model's prediction, made in `owner`'s turn (the tenant's), or why there is none (said in the route
        reason). `messages` may be a function that makes them: called only where there is a model to ask (with
        none, the common case, every `auto` request built its turns' list for nothing)."""
        model = await self.current()
        if model is None:
            return f"difficulty model unusable: {self.error}" if self.error else "no difficulty model yet"
        if callable(messages):
            messages = messages()
        try:
            fidelity = await self._threads.run(owner, model.predict, messages)
        except Exception as exc:  # a faulty model must not fail requests: route by the plan's default, loudly
            log.exception("difficulty model %s failed to predict", model.version)
            return f"difficulty model {model.version} failed: {type(exc).__name__}"
        uninformative = {str(k): str(v) for k, v in (getattr(model, "uninformative", None) or {}).items()}
        return Prediction({k: float(v) for k, v in fidelity.items()}, str(model.version), uninformative)

    def close(self) -> None:
        """Predictions not started are dropped."""
        self._threads.close()

    async def calibration(self) -> Any:
        """The cascade's calibration in the current artifact (tiers/difficulty.py's CascadeCalibration), or None."""
        return getattr(await self.current(), "cascade", None)

    async def _refresh(self) -> None:
        try:
            st = self.path.stat()
        except FileNotFoundError:
            return  # not built yet: keep what is loaded (nothing, usually)
        except OSError as exc:
            log.warning("cannot read the difficulty model at %s: %s", self.path, exc)
            return
        seen = (st.st_mtime_ns, st.st_size)
        if seen == self._seen:
            return
        try:
            model = await asyncio.to_thread(self.loader, self.path)
        except Exception as exc:  # a bad file (or a loader's bug: a KeyError) must not fail requests: keep the old
            self._seen = seen  # rejected: not tried again until the file changes
            bad_file = isinstance(exc, (ValueError, OSError))
            why = str(exc) if bad_file else f"{type(exc).__name__}: {exc}"
            self.error = f"{self.path}: {why}"
            log.error("difficulty model at %s not loaded (%s); keeping %s", self.path, why,
                      self.model.version if self.model else "the plans' default tiers", exc_info=not bad_file)
            return
        old = self.model.version if self.model else None
        self.model, self.error, self._seen = model, None, seen  # seen once loaded and in use, not before
        log.info("difficulty model %s loaded from %s%s", model.version, self.path,
                 f" (replaces {old})" if old else "")
