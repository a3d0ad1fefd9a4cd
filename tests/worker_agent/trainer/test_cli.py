"""``python -m worker_agent.trainer``: ``local``'s table, JSON and the default model's losses;
``rank --resume`` refused in one line without a complete checkpoint."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np

from tests.worker_agent.trainer.reference import pipeline, plan, stage, train_reference
from worker_agent.trainer import checkpoint
from worker_agent.trainer.engine import TrainConfig, TrainPlan, Worker
from worker_agent.trainer.model import ModelConfig

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


def _resume(plan_file: Path, directory: Path) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "worker_agent.trainer", "rank", "--plan", str(plan_file)]
    command += ["--device", "0", "--store", "127.0.0.1:1"]  # refused before it connects
    command += ["--resume", "--checkpoint-dir", str(directory)]
    return subprocess.run(
        command, cwd=ROOT, capture_output=True, text=True, timeout=120, check=False
    )


def test_rank_resume_without_a_complete_checkpoint_says_what_is_missing(tmp_path: Path) -> None:
    four = plan(pipeline(1, stage(0, 0, 2), stage(1, 2, 4)))
    plan_file, directory = tmp_path / "plan.json", tmp_path / "ckpt"
    plan_file.write_text(json.dumps(four))
    # a checkpoint of step 3 with layers 0 and 1 only: device 1 never wrote its own
    worker = Worker(0, TrainConfig(model=ModelConfig(layers=4)))
    worker.hold(0, 2)
    cases = [("does not exist", None), ("lacks 2 of the model's 4 layer files", 3)]
    for expected, step in cases:
        if step is not None:
            checkpoint.save(worker, TrainPlan.parse(four, 4), directory, step)
        result = _resume(plan_file, directory)
        assert result.returncode == 2, result.stderr[-2000:]
        assert "Traceback" not in result.stderr
        [line] = result.stderr.strip().splitlines()
        assert line.startswith("rank: --resume: ") and str(directory) in line, line
        assert expected in line, line
    assert "step-00000003" in line and "layer-0002.pt, layer-0003.pt" in line, line
