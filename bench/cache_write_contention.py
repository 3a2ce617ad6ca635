"""Do one tenant's cache writes stall another tenant's lookups? In process, real SemanticCache + file SQLiteStore.

    .venv/bin/python -m bench.cache_write_contention [--seconds 8] [--writers 4]

Tenant A stores new answers (deterministic requests, each a new question) as fast as `--writers` threads can;
tenant B, in one thread, looks up: half repeats of its stored questions (exact hits), half new questions
(searched in its faiss partition, a miss). Embeddings are fixed random unit vectors per text (no model), so
what B's latency shows is the cache's locks, the store's connections and the GIL, not the embedder.
B's lookup latency p50/p95/p99/max is taken alone, then with A writing, in the same run.

Two shapes: threads calling `store` and `lookup` (the lock question as such; `--trace-locks` records, per
tenant, the waits and holds of the cache's and the store's write locks), and with `--async-in-flight N` the
gateway's: one event loop, B's `alookup`s while A keeps N `astore`s in flight (their writes in worker threads).
With `--b-store-every K` B also stores the answer to every Kth of its new questions (`astore`, awaited: until
its write is in the store), and the time that takes is reported alone and under A's flood: how long A's queued
writes hold B's.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from cache import CacheScope, SemanticCache, SQLiteStore
from cache.embedder import DIM, Embedder


class HashEmbedder(Embedder):
    """A fixed random unit vector per text: no model to load, and no two texts alike."""

    def __init__(self) -> None:
        super().__init__(num_threads=None)

    @property
    def max_tokens(self) -> int:
        return 256

    def num_tokens(self, text: str) -> int:
        return len(text.split()) + 2

    def encode(self, texts: list[str], *, batch_size: int = 64) -> np.ndarray:
        seeds = [int.from_bytes(hashlib.blake2b(t.encode(), digest_size=8).digest(), "little") for t in texts]
        rows = [np.random.default_rng(s).standard_normal(DIM) for s in seeds]
        return np.stack([r / np.linalg.norm(r) for r in rows]).astype(np.float32)


class TracedLock:
    """A lock that records, per thread name, how long each blocking acquire waited and each hold lasted."""

    def __init__(self, inner: threading.Lock | threading.RLock) -> None:
        self.inner = inner
        self.waits: dict[str, list[float]] = {}
        self.holds: dict[str, list[float]] = {}
        self._local = threading.local()

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        t0 = time.perf_counter()
        got = self.inner.acquire(blocking, timeout)
        if got:
            name = threading.current_thread().name
            if blocking:
                self.waits.setdefault(name, []).append(time.perf_counter() - t0)
            depth = getattr(self._local, "depth", 0)
            if depth == 0:
                self._local.since = time.perf_counter()
            self._local.depth = depth + 1
        return got

    def release(self) -> None:
        self._local.depth -= 1
        if self._local.depth == 0:
            held = time.perf_counter() - self._local.since
            self.holds.setdefault(threading.current_thread().name, []).append(held)
        self.inner.release()

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()

    def summary(self, label: str) -> str:
        def by(d: dict[str, list[float]], who: str) -> list[float]:
            return [x * 1000 for name, xs in d.items() if name.startswith(who) for x in xs]
        lines = []
        for who in ("B", "A-"):
            w, h = by(self.waits, who), by(self.holds, who)
            lines.append(f"  {label} by {who.rstrip('-')}: {len(w)} blocking acquires, wait max "
                         f"{max(w, default=0):.2f} ms; {len(h)} holds, p50 {statistics.median(h) if h else 0:.3f} ms,"
                         f" max {max(h, default=0):.2f} ms")
        return "\n".join(lines)


def chat(question: str) -> dict:
    return {"model": "auto", "temperature": 0,
            "messages": [{"role": "system", "content": "You are helpful."}, {"role": "user", "content": question}]}


def scope_of(tenant: str) -> CacheScope:
    return CacheScope.for_request(chat("x"), tenant=tenant, roles=["user"], data_version=1, model_version="m1")


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def run_b(cache: SemanticCache, seconds: float, b_stored: int, tag: str) -> list[float]:
    """B's lookups for `seconds`; their latencies in ms."""
    b = scope_of("tenant-b")
    out: list[float] = []
    end = time.perf_counter() + seconds
    i = 0
    while time.perf_counter() < end:
        q = f"b question {i % b_stored}" if i % 2 == 0 else f"b new question {tag} {i}"
        body = chat(q)
        t0 = time.perf_counter()
        r = cache.lookup(b, body)
        out.append((time.perf_counter() - t0) * 1000)
        if i % 2 == 0:
            assert r.status == "hit", r
        else:
            assert r.status != "hit", r
        i += 1
        time.sleep(0.001)  # a steady stream, not a second flood
    return out


async def run_async(cache: SemanticCache, seconds: float, b_stored: int, in_flight: int,
                    b_store_every: int = 0) -> tuple[list[float], list[float], int, list[float], list[float]]:
    """The gateway's shape: on one event loop, B's `alookup`s one after another, alone and then while A keeps
    `in_flight` `astore`s of new questions going (each answer's write goes to a worker thread, as `apersist` does)."""
    b = scope_of("tenant-b")
    a = scope_of("tenant-a")

    async def b_lookups(tag: str) -> tuple[list[float], list[float]]:
        out: list[float] = []
        stores: list[float] = []  # B's astores: until the write is in the store
        end = time.perf_counter() + seconds
        i = 0
        while time.perf_counter() < end:
            q = f"b new question {tag} {i}" if i % 2 else f"b question {i % b_stored}"
            t0 = time.perf_counter()
            r = await cache.alookup(b, chat(q))
            out.append((time.perf_counter() - t0) * 1000)
            assert (r.status == "hit") == (i % 2 == 0), r
            if i % 2 and b_store_every and (i // 2) % b_store_every == 0:
                t0 = time.perf_counter()
                assert await cache.astore(b, chat(q), "b answer") is not None
                stores.append((time.perf_counter() - t0) * 1000)
            i += 1
            await asyncio.sleep(0.001)
        return out, stores

    alone, b_alone_stores = await b_lookups("alone-async")
    stop = False
    written = 0

    async def a_writer(w: int) -> None:
        nonlocal written
        n = 0
        while not stop:
            await cache.astore(a, chat(f"a async question {w} {n}"), "ok")
            n += 1
            written += 1

    writers = [asyncio.create_task(a_writer(w)) for w in range(in_flight)]
    await asyncio.sleep(0.5)
    flooded, b_flood_stores = await b_lookups("flood-async")
    stop = True
    await asyncio.gather(*writers)
    return alone, flooded, written, b_alone_stores, b_flood_stores


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--writers", type=int, default=4)
    ap.add_argument("--b-entries", type=int, default=500)
    ap.add_argument("--async-in-flight", type=int, default=0,
                    help="also run the event-loop shape: B's alookups while A keeps this many astores in flight")
    ap.add_argument("--b-store-every", type=int, default=0,
                    help="with --async-in-flight: B also stores the answer to every Kth of its new questions, timed")
    ap.add_argument("--trace-locks", action="store_true",
                    help="record waits and holds of the cache's and the store's write locks, by tenant")
    args = ap.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        store = SQLiteStore(Path(tmp) / "cache.db", max_entries=200_000)
        cache = SemanticCache(store, HashEmbedder())
        b = scope_of("tenant-b")
        for i in range(args.b_entries):
            cache.store(b, chat(f"b question {i}"), f"answer {i}")
        a = scope_of("tenant-a")
        for i in range(200):  # A's partition exists before the flood
            cache.store(a, chat(f"a warm {i}"), "ok")
        assert cache.index.idle(30)
        traced: list[tuple[str, TracedLock]] = []
        if args.trace_locks:
            for label, owner, attr in (("SemanticCache._lock", cache, "_lock"), ("SQLiteStore._lock", store, "_lock")):
                lock = TracedLock(getattr(owner, attr))
                setattr(owner, attr, lock)
                traced.append((label, lock))
        threading.current_thread().name = "B"

        alone = run_b(cache, args.seconds, args.b_entries, "alone")

        stop = threading.Event()
        written = [0] * args.writers

        def writer(w: int) -> None:
            n = 0
            while not stop.is_set():
                cache.store(a, chat(f"a question {w} {n}"), "ok")
                n += 1
                written[w] = n

        threads = [threading.Thread(target=writer, args=(w,), name=f"A-{w}", daemon=True) for w in range(args.writers)]
        load0 = os.getloadavg()[0]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        time.sleep(0.5)  # the flood under way
        flooded = run_b(cache, args.seconds, args.b_entries, "flood")
        stop.set()
        for t in threads:
            t.join()
        elapsed = time.perf_counter() - t0
        load1 = os.getloadavg()[0]
        cache.index.idle(60)
        rows = [("alone", alone), ("with A", flooded)]
        if args.async_in_flight:
            a_alone, a_flooded, a_written, b_stores_alone, b_stores_flood = asyncio.run(
                run_async(cache, args.seconds, args.b_entries, args.async_in_flight, args.b_store_every))
            rows += [("async alone", a_alone), ("async w/ A", a_flooded)]
            if args.b_store_every:
                rows += [("B store alone", b_stores_alone), ("B store w/ A", b_stores_flood)]
            cache.index.idle(60)
        cache.close()

    print(f"cores={os.cpu_count()} writers={args.writers} seconds={args.seconds} "
          f"loadavg(1m) before/after flood: {load0:.2f}/{load1:.2f}")
    print(f"A stored {sum(written)} entries in {elapsed:.1f} s ({sum(written) / elapsed:.0f}/s)")
    print(f"{'B lookups':<14}{'n':>7}{'p50 ms':>9}{'p95 ms':>9}{'p99 ms':>9}{'max ms':>9}")
    if args.async_in_flight:
        print(f"async: A kept {args.async_in_flight} astores in flight, stored {a_written} entries in "
              f"{args.seconds + 0.5:.1f} s")
    for name, xs in rows:
        print(f"{name:<14}{len(xs):>7}{statistics.median(xs):>9.2f}{pct(xs, 0.95):>9.2f}{pct(xs, 0.99):>9.2f}"
              f"{max(xs):>9.2f}")
    for label, lock in traced:
        print(lock.summary(label))


if __name__ == "__main__":
    main()
