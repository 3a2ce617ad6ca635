"""`build_student` (what `models distill` and serve's first use run) refuses a device torch cannot use before it
prepares the teacher (a download of hundreds of MB); it was refused only inside distill(), after that."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tiers.catalogue import TierCatalogue
from training import students
from training.distill import DistillError
from training.students import StudentRequest, build_student


def test_a_bad_device_is_refused_before_the_teacher_is_prepared(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    prepared: list[Any] = []
    monkeypatch.setattr(students, "prepare_model", lambda *a, **k: prepared.append(a))
    catalogue = TierCatalogue.model_validate({"tiers": {"full": {
        "backend": "local", "model": "smollm2-135m-instruct", "price_per_1k_input": "0",
        "price_per_1k_output": "0", "hardware_cost_per_hour": "0", "context_limit": 1024}}})
    with pytest.raises(DistillError, match="tpu"):
        build_student(StudentRequest(teacher="full", device="tpu"), catalogue=catalogue, models_dir=tmp_path)
    assert prepared == [] and list(tmp_path.iterdir()) == []
