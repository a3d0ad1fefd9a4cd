"""``python -m worker_agent.trainer local``: the table, the JSON, and the default model's losses."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np

from tests.worker_agent.trainer.reference import pipeline, plan, stage, train_reference
from worker_agent.trainer.engine import TrainConfig

ROOT = Path(__file__).resolve().parents[3]


def test_local_prints_and_writes_the_steps_of_the_default_model(tmp_path: Path) -> None:
    plan_file, out = tmp_path / "plan.json", tmp_path / "steps.json"
    plan_file.write_text(json.dumps(plan(pipeline(2, stage(0, 0, 4), stage(1, 4, 8)))))
    command = [sys.executable, "-m", "worker_agent.trainer", "local", "--plan", str(plan_file)]
    command += ["--steps", "2", "--json", str(out)]
    result = subprocess.run(
        command, cwd=ROOT, capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "step" in result.stdout and "median step time" in result.stdout
    report = json.loads(out.read_text())
    assert report["devices"] == 2 and report["samples_per_step"] == 4
    losses = [s["loss"] for s in report["steps"]]
    assert [s["step"] for s in report["steps"]] == [0, 1]
    # the command's defaults are TrainConfig's: the reference gives the same losses
    np.testing.assert_allclose(
        losses, train_reference(TrainConfig(), 4, range(2)).losses, rtol=1e-5
    )
