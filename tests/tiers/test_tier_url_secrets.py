"""A tier URL that holds a secret is refused when the tiers file loads. A URL is written to the logs with each health
check and tier error, and to the admin /health as a replica's reason: credentials in it (`https://user:key@host`)
or a key in its query (Azure's `?api-key=`) were written there. The refusal names the file, line and tier, says
where the key goes instead (`api_key_env`), and never repeats the URL."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.config_files import ConfigFileError, load_yaml
from tiers.catalogue import TierCatalogue

SECRET = "s3cr3t-upstream-key"
TIER = """tiers:
  remote:
    backend: openai
    model: m
    urls:
      - "http://ok-0.internal:8000"
      - "{url}"
    price_per_1k_input: "0.001"
    price_per_1k_output: "0.002"
    hardware_cost_per_hour: "1"
    context_limit: 4096
"""
VERSIONED = TIER.replace('"{url}"', '"http://ok-1.internal:8000"') + """    serving: v1
    versions:
      - name: v1
      - name: v2
        urls: ["{url}"]
"""


def _load(tmp_path: Path, text: str) -> TierCatalogue:
    path = tmp_path / "tiers.yaml"
    path.write_text(text)
    return load_yaml(path, TierCatalogue)


def _every_text(exc: BaseException) -> str:
    """The error's message and every exception chained to it (what a traceback would print)."""
    texts = []
    while exc is not None:
        texts.append(str(exc))
        exc = exc.__cause__ or exc.__context__  # type: ignore[assignment]
    return "\n".join(texts)


@pytest.mark.parametrize("url", [f"https://gateway:{SECRET}@llm.example.com/v1", f"https://{SECRET}@llm.example.com",
                                 f"https://llm.example.com/openai?api-key={SECRET}",
                                 f"https://llm.example.com/v1#{SECRET}"],
                         ids=["user_password", "user_only", "query_key", "fragment"])
@pytest.mark.parametrize("template", [TIER, VERSIONED], ids=["tier", "version"])
def test_a_tier_url_holding_a_secret_is_refused_by_name(tmp_path: Path, url: str, template: str) -> None:
    with pytest.raises(ConfigFileError) as err:
        _load(tmp_path, template.format(url=url))
    message = str(err.value)
    assert str(tmp_path / "tiers.yaml") in message and "tiers.remote." in message
    assert "api_key_env" in message and err.value.line is not None
    assert SECRET not in _every_text(err.value)


def test_a_plain_base_url_loads(tmp_path: Path) -> None:
    catalogue = _load(tmp_path, TIER.format(url="https://llm.example.com:8443/v1"))
    assert catalogue.tiers["remote"].urls[1] == "https://llm.example.com:8443/v1"
