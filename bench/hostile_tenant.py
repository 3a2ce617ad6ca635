"""A hostile tenant against a victim, through `tiergate serve` with the real SmolLM2 engines (mid and full).

    .venv/bin/python -m bench.hostile_tenant [--victim-requests 40] [--out results.json]

The victim sends short requests in a loop, one at a time, alternating `mid` and `full` (cache bypassed,
so every one runs on an engine). Its latency is measured alone, then while the attacker repeats each
attack from several threads, all in one run. A second victim takes the cache's path: temperature 0 and a
question it never asked before, so each request is looked up (its last turn embedded on the queue every
tenant shares), answered by an engine and stored; it meets the attacks on what that path shares. For each
attack the table gives the victim's p50 and p95 and their ratio to the victim alone, and the status codes
the attacker got. Isolation holds when every victim request succeeds, the victim's p95 stays within 3x of
alone, and the attacker never gets a 5xx.

The attacks are classes, not strings (tests/adversarial/ runs the same ones with fewer requests):
regex bait (a cached digit prompt, then megabytes of digits), one 100k-character word on `auto`, seeds
and temperatures at and past their bounds, stop strings at and past their limits, thousands of messages,
deeply nested JSON, 160,000 content parts, unknown and unsupported fields, a flood that the tenant's
rate limit refuses, response formats whose grammar fails mid-answer (a replica's breaker must not count them; then
each one new, a grammar compile each),
an allOf of anyOfs of patterns (seconds of a grammar compiler's time), 4 MB of tools with tool_choice
"none", a body as wide as the size limit allows (160,512 content parts in 4 MiB) with a `NaN` in a tool's
`parameters` (not JSON: such bodies once skipped the width check and were validated part by part), and a header
flood (as many headers as allowed, padded to just under the head's size limit; then ten times the count; then a
512 KiB header; these two are built in bench/hostile_floods.py); against the cache's victim: embeddings of 2,048
texts a request, prompts that cannot fit after the answer to their history was cached, long prompts on `auto`
(counted and predicted on threads tenants take in turn), and a tenant over its budget asking new questions (each
one looked up, then refused).

Honours the same TIERGATE_* settings as `tiergate serve` (models directory, engine threads through the
tiers file it writes; the body size limit, which the widest bodies fill). The machine's CPU and the engines'
thread counts are printed with the results; the JSON (--out) has each phase's p50, p95 and p99 besides its
latencies.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import re
import string
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from bench.hostile_floods import HEADER_FLOOD, header_flood_sender, nan_wide, nan_wide_name
from bench.serve_gateway import free_port, tiergate_serve
from gateway.settings import Settings

ROOT = Path(__file__).resolve().parents[1]
VICTIM_BODY = {"messages": [{"role": "user", "content": "Say hello in one short sentence."}], "max_tokens": 8,
               "temperature": 0}
PLANS = """
default_plan: standard
plans:
  standard:
    priority: standard
    allowed_tiers: [mid, full]
    default_tier: mid
  attacker:
    priority: standard
    allowed_tiers: [mid, full]
    default_tier: mid
    limits: {rpm: 100000, max_concurrent: 8}
  flooder:
    priority: standard
    allowed_tiers: [mid, full]
    default_tier: mid
    limits: {rpm: 5, max_concurrent: 2}
  broke:
    priority: standard
    allowed_tiers: [mid, full]
    default_tier: mid
    limits: {rpm: 100000, max_concurrent: 8, budget_day_usd: "0.00005"}
"""


@dataclass
class Served:
    url: str
    proc: subprocess.Popen[str]
    admin_key: str
    victim_key: str
    attacker_key: str = ""
    flooder_key: str = ""
    broke_key: str = ""  # a tenant whose daily budget one answer spends
    asked: int = 0  # the cache's victim's questions so far (each one new)
    max_body_bytes: int = 4 * 1024 * 1024  # the gateway's (TIERGATE_MAX_BODY_BYTES)


@dataclass(frozen=True)
class Attack:
    """One class of hostile request: `send` makes one and returns its status code."""

    name: str
    send: Callable[[httpx.Client], int]
    threads: int = 2
    refused: bool = True  # its hostile part is refused (else it is heavy work the tenant's plan allows)
    tenant: str = "attacker"  # whose key sends it: "attacker", "flooder" (5 requests a minute), "broke" (no budget)


@dataclass
class Phase:
    name: str
    victim_s: list[float] = field(default_factory=list)
    victim_failed: list[str] = field(default_factory=list)
    attacker: Counter[int] = field(default_factory=Counter)

    def p(self, q: float) -> float:
        values = sorted(self.victim_s)
        return values[min(len(values) - 1, round(q * (len(values) - 1)))]


@contextmanager
def served(models_dir: Path, *, engine_threads: int = 1) -> Iterator[Served]:
    """`tiergate serve` on a free port with the real tiers (`small` left unbuilt) and the plans above."""
    with tempfile.TemporaryDirectory(prefix="tiergate-hostile-") as tmp:
        data = Path(tmp)
        tiers = (ROOT / "tiers" / "tiers.yaml").read_text().replace(
            "model: students/smollm2-small", "model: students/not-built-here")
        tiers = re.sub(r"(\n  (mid|full):\n)", rf"\1    threads: {engine_threads}\n", tiers)
        (data / "tiers.yaml").write_text(tiers)
        (data / "plans.yaml").write_text(PLANS)
        port = free_port()
        env = os.environ | {"TIERGATE_MODELS_DIR": str(models_dir), "TIERGATE_DATA_DIR": str(data / "data"),
                            "TIERGATE_PORT": str(port), "TIERGATE_TIERS_FILE": str(data / "tiers.yaml"),
                            "TIERGATE_PLANS_FILE": str(data / "plans.yaml"), "TIERGATE_BUILD_MISSING_MODELS": "0"}
        with tiergate_serve(env, ready_timeout_s=500) as started:
            s = Served(f"http://127.0.0.1:{port}", started.proc, started.admin_key, started.demo_key,
                       max_body_bytes=_served_settings().max_body_bytes)
            s.attacker_key = _tenant_key(s, "mallory", "attacker")
            s.flooder_key = _tenant_key(s, "flood", "flooder")
            s.broke_key = _tenant_key(s, "broke", "broke")
            yield s


def _served_settings() -> Settings:
    """The settings `tiergate serve` reads besides what `served` sets: this environment's TIERGATE_* variables, and
    the .env file where it runs."""
    return Settings(_env_file=ROOT / ".env")  # type: ignore[call-arg]


def _tenant_key(s: Served, name: str, plan: str) -> str:
    with httpx.Client(base_url=s.url, headers={"authorization": f"Bearer {s.admin_key}"}, timeout=30) as c:
        c.post("/admin/tenants", json={"name": name, "plan": plan}).raise_for_status()
        r = c.post("/admin/keys", json={"tenant": name, "name": "bench"})
        r.raise_for_status()
        return str(r.json()["key"])


def _post(c: httpx.Client, body: dict | bytes) -> int:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return c.post("/v1/chat/completions", content=content, headers={"content-type": "application/json"}).status_code


def _schema(schema: dict[str, object]) -> dict[str, object]:
    return {"type": "json_schema", "json_schema": {"name": "x", "strict": True, "schema": schema}}


def _user(text: str, **extra: object) -> dict[str, object]:
    return {"model": "mid", "messages": [{"role": "user", "content": text}], "max_tokens": 4, **extra}


def attacks(s: Served) -> list[Attack]:
    """The attack classes; bodies are built once, so the attacker's own CPU goes into sending them."""
    rng = random.Random(16)
    digits = "".join(rng.choice(string.digits) for _ in range(150))
    megadigits = json.dumps(_user("7" * 3_900_000, temperature=0)).encode()  # under the 4 MiB body limit
    word = json.dumps({**_user("".join(rng.choice(string.ascii_letters) for _ in range(100_000))),
                       "model": "auto"}).encode()
    nested = b'{"model": "mid", "messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    many = json.dumps({"model": "mid", "max_tokens": 4,
                       "messages": [{"role": "user", "content": "hi"}] * 2000}).encode()
    too_many = json.dumps({"model": "mid", "messages": [{"role": "user", "content": "hi"}] * 5000}).encode()
    wide = json.dumps({"model": "mid", "max_tokens": 4, "messages": [  # 160,000 content parts, each one bad: 3.7 MB
        {"role": "user", "content": [{"type": "t", "text": ""}] * 80}] * 2000}, separators=(",", ":")).encode()
    stops_ok = json.dumps(_user("Count to ten.", max_tokens=16, stop=[("z" * 255) + c for c in "abcd"])).encode()
    stop_long = json.dumps(_user("Count to ten.", stop="x" * 20_000)).encode()
    optional = {"type": "object", "additionalProperties": False,  # llguidance: "max_items_in_row" at token 2
                "properties": {f"p{i}": {"type": "integer"} for i in range(1000)}}
    failing_schemas = [json.dumps({**_user("Give me JSON.", max_tokens=16, temperature=1.0,
                                           response_format=_schema(optional)), "model": m}).encode()
                       for m in ("mid", "full")]
    # the same schema under a new title each time: never in an engine's grammar cache, ~90 ms of llguidance each
    new_failing = [json.dumps({**_user("Give me JSON.", max_tokens=16, temperature=1.0,
                                       response_format=_schema({**optional, "title": "t-NEW"})), "model": m}).encode()
                   for m in ("mid", "full")]
    params = {f"p{j:04d}": {"type": "string", "description": "d" * 8} for j in range(630)}
    tools_none = json.dumps({**_user("hi", max_tokens=1), "tool_choice": "none", "tools": [  # 4 MB, not offered
        {"type": "function", "function": {"name": f"f{i}", "parameters": {"type": "object", "properties": params}}}
        for i in range(124)]}, separators=(",", ":")).encode()

    nan_body = nan_wide(s.max_body_bytes)

    def regex_bait(c: httpx.Client) -> int:
        _post(c, _user(digits, temperature=0))  # cached (the first time) for the attacker's own tenant
        return _post(c, megadigits)

    def each_one_new(c: httpx.Client) -> int:
        each_one_new.sent += 1  # type: ignore[attr-defined]
        n = each_one_new.sent  # type: ignore[attr-defined]
        return _post(c, new_failing[n % 2].replace(b"t-NEW", f"t-{n}".encode()))
    each_one_new.sent = 0  # type: ignore[attr-defined]

    def cycle(*bodies: dict | bytes) -> Callable[[httpx.Client], int]:
        state = {"i": 0}

        def send(c: httpx.Client) -> int:
            state["i"] += 1
            return _post(c, bodies[state["i"] % len(bodies)])
        return send

    return [
        Attack("regex bait: cached digits, then 3.9 MB of digits", regex_bait, threads=1),
        Attack("one 100k-character word on auto", cycle(word), threads=1),
        Attack("extreme seeds", cycle(_user("Hi", seed=2**64), _user("Hi", seed=-1), _user("Hi", seed=2**64 - 1,
                                                                                          temperature=1.0))),
        Attack("tiny and huge temperatures", cycle(_user("Hi", temperature=1e-40), _user("Hi", temperature=1e308),
                                                   _user("Hi", temperature=0.01))),
        Attack("stop strings at and past their limits", cycle(stops_ok, stop_long,
                                                              _user("Hi", stop=["a", "b", "c", "d", "e"]))),
        Attack("thousands of messages", cycle(many, too_many), threads=1),
        Attack("deeply nested JSON", cycle(nested), threads=1),
        Attack("160,000 content parts", cycle(wide), threads=2),
        Attack("unknown and unsupported fields", cycle(_user("Hi", prediction={"type": "content", "content": "x"}),
                                                       _user("Hi", audio={"voice": "alloy", "format": "wav"}),
                                                       _user("Hi", logit_bias={"1": 100}), _user("Hi", bogus=1))),
        Attack("a flood the rate limit refuses", cycle(_user("Hi")), threads=6, tenant="flooder"),
        Attack("schemas whose grammar fails mid-answer", cycle(*failing_schemas), threads=4),
        Attack("schemas whose grammar fails mid-answer, each one new", each_one_new, threads=4),
        Attack("an allOf of anyOfs of patterns", cycle(_user("Give me JSON.", response_format=_schema({"allOf": [
            {"anyOf": [{"type": "string", "pattern": f"^.*{chr(97 + i)}{j}.*$"} for i in range(5)]}
            for j in range(6)]}))), threads=6),
        Attack("4 MB of tools nobody calls", cycle(tools_none), threads=2),
        Attack(nan_wide_name(nan_body), cycle(nan_body), threads=2),
        Attack(HEADER_FLOOD, header_flood_sender(), threads=2),
    ]


def cache_attacks(s: Served) -> list[Attack]:
    """The attack classes on what the cache's path shares: the embedding queue and the counting and prediction
    threads."""
    rng = random.Random(21)
    texts = [" ".join(rng.choice(WORDS) for _ in range(12)) for _ in range(2048)]
    embeddings = json.dumps({"model": "all-MiniLM-L6-v2", "input": texts}).encode()
    history = [{"role": "user", "content": "Name a colour."}]
    overflow = json.dumps({"model": "mid", "temperature": 0, "max_tokens": 4, "messages": [
        *history, {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": " ".join(rng.choice(WORDS) for _ in range(12000))}]}).encode()  # > 8,192 tokens
    long_auto = json.dumps({**_user(" ".join(rng.choice(WORDS) for _ in range(12000))), "model": "auto"}).encode()

    def embed(c: httpx.Client) -> int:
        return c.post("/v1/embeddings", content=embeddings, headers={"content-type": "application/json"}).status_code

    def cannot_fit(c: httpx.Client) -> int:
        _post(c, {"model": "mid", "temperature": 0, "max_tokens": 4, "messages": history})  # cached for the attacker
        return _post(c, overflow)

    def over_budget(c: httpx.Client) -> int:  # a new cacheable question each time: each one a lookup, then refused
        over_budget.asked += 1  # type: ignore[attr-defined]
        question = " ".join(rng.choice(WORDS) for _ in range(200))
        return _post(c, {"model": "mid", "temperature": 0, "max_tokens": 64, "messages": [
            {"role": "user", "content": f"{over_budget.asked} {question}"}]})  # type: ignore[attr-defined]
    over_budget.asked = 0  # type: ignore[attr-defined]

    return [
        Attack("embeddings of 2,048 texts a request", embed, threads=2, refused=False),
        Attack("prompts that cannot fit, after their history's answer was cached", cannot_fit, threads=4),
        Attack("prompts too long for any tier, on auto", lambda c: _post(c, long_auto), threads=4),
        Attack("a tenant over its budget asking new questions", over_budget, threads=4, tenant="broke"),
    ]


WORDS = ("river", "mountain", "lamp", "orange", "quiet", "engine", "paper", "window", "seven", "garden", "cloud",
         "silver", "market", "winter", "table", "bridge")


def run_phase(s: Served, name: str, n: int, attack: Attack | None = None, *, cache: bool = False) -> Phase:
    """The victim's `n` requests alone or under `attack`: the engine's victim, or with `cache` the cache's."""
    phase = Phase(name)
    stop = threading.Event()

    def attacker() -> None:
        key = getattr(s, f"{attack.tenant}_key")  # type: ignore[union-attr]
        with httpx.Client(base_url=s.url, headers={"authorization": f"Bearer {key}"}, timeout=120) as c:
            while not stop.is_set():
                try:
                    phase.attacker[attack.send(c)] += 1  # type: ignore[union-attr]
                except httpx.HTTPError as exc:
                    phase.attacker[-1] += 1  # a transport failure counts as a failure of ours
                    print(f"  attacker transport error: {exc!r}", file=sys.stderr)

    threads = [threading.Thread(target=attacker, daemon=True) for _ in range(attack.threads if attack else 0)]
    for t in threads:
        t.start()
    if attack is not None:
        time.sleep(1.0)  # the attack is under way before the victim starts
    headers = {"authorization": f"Bearer {s.victim_key}"} | ({} if cache else {"cache-control": "no-cache"})
    with httpx.Client(base_url=s.url, headers=headers, timeout=120) as c:
        for i in range(n):
            body = {**VICTIM_BODY, "model": "mid" if i % 2 == 0 else "full"}
            if cache:  # a question never asked before: looked up, embedded, answered, stored
                s.asked += 1
                body["messages"] = [{"role": "user", "content": f"Say hello to guest number {s.asked} in one "
                                                                f"short sentence, politely."}]
            t0 = time.perf_counter()
            try:
                r = c.post("/v1/chat/completions", json=body)
                ok = r.status_code == 200
                why = f"{r.status_code}: {r.text[:200]}"
            except httpx.HTTPError as exc:
                ok, why = False, repr(exc)
            phase.victim_s.append(time.perf_counter() - t0)
            if not ok:
                phase.victim_failed.append(why)
    stop.set()
    for t in threads:
        t.join(timeout=180)
    return phase


def all_tiers_answer(s: Served) -> dict[str, int]:
    with httpx.Client(base_url=s.url, headers={"authorization": f"Bearer {s.victim_key}"}, timeout=120) as c:
        return {tier: c.post("/v1/chat/completions", json={**VICTIM_BODY, "model": tier}).status_code
                for tier in ("mid", "full")}


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--victim-requests", type=int, default=40, help="victim requests per phase (default 40)")
    ap.add_argument("--engine-threads", type=int, default=1, help="torch threads per engine (default 1)")
    ap.add_argument("--attacks", action="append", help="run only the attacks whose name contains this text; "
                    "given again, those that contain any of them (both victims' alone phases run when one of theirs "
                    "does); default every attack")
    ap.add_argument("--out", type=Path, help="also write the results as JSON here")
    args = ap.parse_args()
    models_dir = Settings().resolved_models_dir  # TIERGATE_MODELS_DIR / TIERGATE_DATA_DIR, as `tiergate serve`
    print(f"CPU: {cpu_model()}, {os.cpu_count()} cores; engines: mid (int8) and full, "
          f"{args.engine_threads} torch thread(s) each; {args.victim_requests} victim requests per phase")
    with served(models_dir, engine_threads=args.engine_threads) as s:
        run_phase(s, "warm-up", 4)
        wanted = args.attacks or [""]
        chosen = [a for a in attacks(s) if any(w in a.name for w in wanted)]
        cache_chosen = [a for a in cache_attacks(s) if any(w in a.name for w in wanted)]
        alone = run_phase(s, "victim alone", args.victim_requests if chosen else 0)
        phases = [run_phase(s, a.name, args.victim_requests, a) for a in chosen]
        cache_alone = run_phase(s, "cache's victim alone", args.victim_requests if cache_chosen else 0, cache=True)
        cache_phases = [run_phase(s, a.name, args.victim_requests, a, cache=True) for a in cache_chosen]
        after = all_tiers_answer(s)
    for title, first, rest in (("engine's victim (cache bypassed)", alone, phases),
                               ("cache's victim (temperature 0, new questions)", cache_alone, cache_phases)):
        if not rest:
            continue
        print(f"\n{title}\n\n| phase | victim ok | victim p50 s | victim p95 s | p95 / alone | attacker statuses |")
        print("|---|---|---|---|---|---|")
        for ph in (first, *rest):
            ok = f"{len(ph.victim_s) - len(ph.victim_failed)}/{len(ph.victim_s)}"
            statuses = ", ".join(f"{code}: {n}" for code, n in sorted(ph.attacker.items())) or "-"
            print(f"| {ph.name} | {ok} | {ph.p(0.5):.3f} | {ph.p(0.95):.3f} | {ph.p(0.95) / first.p(0.95):.2f} "
                  f"| {statuses} |")
    print(f"\nafterwards: {after}")
    if args.out:
        args.out.write_text(json.dumps({
            "cpu": cpu_model(), "engine_threads": args.engine_threads, "after": after,
            "phases": [{"name": ph.name, "victim": victim, "victim_s": ph.victim_s,
                        **{f"p{q}": ph.p(q / 100) if ph.victim_s else None for q in (50, 95, 99)},
                        "victim_failed": ph.victim_failed, "attacker": dict(ph.attacker)}
                       for victim, group in (("engine", (alone, *phases)), ("cache", (cache_alone, *cache_phases)))
                       for ph in group]}, indent=1))


if __name__ == "__main__":
    main()
