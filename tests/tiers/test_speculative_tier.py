"""`speculative: {draft: TIER, k, max_batch}` in tiers.yaml: checked against the catalogue at load, carried to the
engine's command as the draft tier's model, quantization and dtype, and waited for while the draft is unbuilt."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from tiers.catalogue import TierCatalogue
from tiers.client import TierClient
from tiers.replica import Replica
from tiers.supervisor import EngineProcess

LOCAL: dict[str, Any] = {"backend": "local", "price_per_1k_input": "0.001", "price_per_1k_output": "0.002",
                         "hardware_cost_per_hour": "1", "context_limit": 4096}
REMOTE: dict[str, Any] = LOCAL | {"backend": "openai", "model": "m", "urls": ["http://a:1"]}


def catalogue(full: dict[str, Any], **others: dict[str, Any]) -> TierCatalogue:
    tiers = {"mid": LOCAL | {"model": "draft-model", "quantize": "int8"}, "full": LOCAL | {"model": "big"} | full}
    return TierCatalogue.model_validate({"tiers": tiers | others})


def test_the_draft_is_another_local_tier_and_the_engine_gets_its_model(tmp_path: Path) -> None:
    cat = catalogue({"speculative": {"draft": "mid", "k": 3, "max_batch": 2},
                     "serving": "v1", "versions": [{"name": "v1"}, {"name": "v2", "dtype": "fp32"}]})
    full = cat.tiers["full"]
    assert full.draft is cat.tiers["mid"] and full.variant("v2").draft is cat.tiers["mid"]
    (tmp_path / "draft-model").mkdir()
    proc = EngineProcess(full.variant("v2"), Replica("full", 0), models_dir=tmp_path, log_dir=tmp_path,
                         client=TierClient(), start_timeout_s=1)
    cmd = proc.command(9000)
    flag = {name: cmd[cmd.index(name) + 1] for name in ("--draft-model", "--draft-quantize", "--draft-dtype",
                                                         "--speculative-k", "--speculative-max-batch", "--dtype")}
    assert flag == {"--draft-model": str(tmp_path / "draft-model"), "--draft-quantize": "int8",
                    "--draft-dtype": "auto", "--speculative-k": "3", "--speculative-max-batch": "2",
                    "--dtype": "fp32"}
    plain = EngineProcess(cat.tiers["mid"], Replica("mid", 0), models_dir=tmp_path, log_dir=tmp_path,
                          client=TierClient(), start_timeout_s=1)
    assert "--draft-model" not in plain.command(9000)


@pytest.mark.parametrize(("full", "others", "message"), [
    ({"speculative": {"draft": "nope"}}, {}, "is not another local tier"),
    ({"speculative": {"draft": "full"}}, {}, "is not another local tier"),
    ({"speculative": {"draft": "remote"}}, {"remote": REMOTE}, "is not another local tier"),
    ({"speculative": {"draft": "small"}}, {"small": LOCAL | {"model": "s", "speculative": {"draft": "mid"}}},
     "is itself speculative"),
    ({"speculative": {"draft": "mid", "k": 9}}, {}, "less than or equal to 8"),
    ({"speculative": {"draft": "mid", "depth": 2}}, {}, "Extra inputs"),
])
def test_a_bad_speculative_entry_stops_the_load(full: dict[str, Any], others: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        catalogue(full, **others)


def test_a_remote_tier_cannot_speculate() -> None:
    with pytest.raises(ValidationError, match="remote tier has its own server"):
        catalogue({}, remote=REMOTE | {"speculative": {"draft": "mid"}})


async def test_an_unbuilt_draft_keeps_the_engine_waiting_and_says_which(tmp_path: Path) -> None:
    cat = catalogue({"speculative": {"draft": "small"}},
                    small=LOCAL | {"model": "students/s", "distill": {"teacher": "full"}})
    (tmp_path / "big").mkdir()
    (tmp_path / "big" / "config.json").write_text("{}")
    (tmp_path / "big" / "model.safetensors").write_bytes(b"")
    replica = Replica("full", 0)
    proc = EngineProcess(cat.tiers["full"], replica, models_dir=tmp_path, log_dir=tmp_path, client=TierClient(),
                         start_timeout_s=1)
    proc._mark_unbuilt()
    assert replica.status == "unavailable"
    assert "speculative draft, tier 'small'" in replica.reason and "tiergate models distill" in replica.reason
