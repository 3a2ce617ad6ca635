"""Following the difficulty model's artifact: none yet, appearing later, replaced, broken, failing."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from tiers.predictor import PredictorSource, default_artifact
from tiers.routing import Prediction


class FakeModel:
    def __init__(self, version: str) -> None:
        self.version = version

    def predict(self, messages: list[dict[str, Any]]) -> dict[str, float]:
        if messages[-1]["content"] == "boom":
            raise RuntimeError("model bug")
        return {"small": 0.5, "full": 1.0}


def load(path: Path) -> FakeModel:
    data = json.loads(path.read_text())
    if "version" not in data:
        raise ValueError("not a difficulty artifact")
    return FakeModel(data["version"])


class Clock:
    t = 0.0

    def __call__(self) -> float:
        return self.t


def write(path: Path, body: dict[str, Any], mtime: int) -> None:
    path.write_text(json.dumps(body))
    os.utime(path, ns=(mtime, mtime))


MSG = [{"role": "user", "content": "hi"}]


def unasked() -> list[dict[str, Any]]:
    raise AssertionError("the turns were made with no model to ask")


async def test_no_artifact_then_one_appears_then_a_new_version_replaces_it(tmp_path: Path) -> None:
    path = tmp_path / "router" / "difficulty.json"
    clock = Clock()
    source = PredictorSource(path, load, check_every_s=5, clock=clock)
    assert await source.predict(MSG) == "no difficulty model yet"
    assert await source.predict(unasked) == "no difficulty model yet"  # no model to ask: the turns never made
    path.parent.mkdir()
    write(path, {"version": "v1"}, 1_000_000_000)
    assert await source.predict(MSG) == "no difficulty model yet"  # not looked at again within 5 s
    clock.t = 5
    assert await source.predict(MSG) == Prediction({"small": 0.5, "full": 1.0}, "v1")
    assert await source.predict(lambda: MSG) == Prediction({"small": 0.5, "full": 1.0}, "v1")  # turns made to ask
    write(path, {"version": "v2"}, 2_000_000_000)
    clock.t = 10
    got = await source.predict(MSG)
    assert isinstance(got, Prediction) and got.version == "v2"


async def test_a_broken_artifact_keeps_the_loaded_model_and_says_why_when_there_is_none(tmp_path: Path) -> None:
    path = tmp_path / "difficulty.json"
    write(path, {"nope": 1}, 1_000_000_000)
    clock = Clock()
    source = PredictorSource(path, load, check_every_s=1, clock=clock)
    reason = await source.predict(MSG)
    assert isinstance(reason, str) and "difficulty model unusable" in reason and "not a difficulty artifact" in reason
    write(path, {"version": "v1"}, 2_000_000_000)
    clock.t = 1
    assert isinstance(await source.predict(MSG), Prediction)
    write(path, {"nope": 2}, 3_000_000_000)
    clock.t = 2
    got = await source.predict(MSG)
    assert isinstance(got, Prediction) and got.version == "v1"


async def test_a_failing_model_routes_by_default_and_says_so(tmp_path: Path) -> None:
    path = tmp_path / "difficulty.json"
    write(path, {"version": "v1"}, 1_000_000_000)
    source = PredictorSource(path, load)
    assert await source.predict([{"role": "user", "content": "boom"}]) == "difficulty model v1 failed: RuntimeError"


async def test_the_default_loader_reports_a_bad_artifact_as_unusable(tmp_path: Path) -> None:
    path = default_artifact(tmp_path)
    assert path == tmp_path / "router" / "difficulty.json"
    path.parent.mkdir()
    path.write_text("{}")
    reason = await PredictorSource.for_data_dir(tmp_path).predict(MSG)
    assert isinstance(reason, str) and reason.startswith("difficulty model unusable")


async def test_the_real_artifact_says_which_tiers_it_cannot_predict_and_carries_the_calibration(
        tmp_path: Path) -> None:
    from tests.tiers.test_difficulty import HashEmbedder, make_model
    from tiers.difficulty import load_difficulty_model

    path = default_artifact(tmp_path)
    make_model().save(path)
    source = PredictorSource(path, lambda p: load_difficulty_model(p, embedder=HashEmbedder()))
    got = await source.predict(MSG)
    assert isinstance(got, Prediction)
    assert got.uninformative == {"small": "CV RMSE 0.1000 vs 0.1200 predicting the mean"}  # mid's head beats it
    calibration = await source.calibration()
    assert calibration is not None and calibration.pair("small", "mid") is not None


async def test_no_calibration_without_an_artifact_or_from_a_model_without_one(tmp_path: Path) -> None:
    path = tmp_path / "difficulty.json"
    source = PredictorSource(path, load)
    assert await source.calibration() is None
    write(path, {"version": "v1"}, 1_000_000_000)
    assert await PredictorSource(path, load).calibration() is None  # FakeModel has none
