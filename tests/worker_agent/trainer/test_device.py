"""Where the trainer computes: the choice of device and backend, and what it leaves unchanged.

The selection runs against a monkeypatched torch (CUDA, an NPU) as well as this machine. On the
CPU, a run asked for it explicitly trains bitwise as the default one. Two ranks over nccl run only
where two CUDA devices are; elsewhere they are skipped, saying why.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import types
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist

from tests.worker_agent.trainer.reference import pipeline, plan, stage, train_reference
from worker_agent.trainer.__main__ import main as trainer_main
from worker_agent.trainer.comm import request_abort
from worker_agent.trainer.device import CPU, Unavailable, check_ranks, npu_available, select
from worker_agent.trainer.engine import TrainConfig, Worker
from worker_agent.trainer.launch import Fault, Phase, run_local
from worker_agent.trainer.model import ModelConfig
from worker_agent.trainer.rank import Rank

ROOT = Path(__file__).resolve().parents[3]
HOST = "127.0.0.1"
SMALL = TrainConfig(model=ModelConfig(layers=2, d_model=32, heads=2, ffn=64, seq=16), lr=1e-2)
PP2 = plan(pipeline(2, stage(0, 0, 1), stage(1, 1, 2)))
DP2 = plan(pipeline(1, stage(0, 0, 2)), pipeline(1, stage(1, 0, 2)))
CUDA_DEVICES = torch.cuda.device_count() if torch.cuda.is_available() else 0
TWO_CUDA_DEVICES = pytest.mark.skipif(
    CUDA_DEVICES < 2,
    reason=f"two nccl ranks need two CUDA devices, this machine has {CUDA_DEVICES} "
    f"(torch {torch.__version__}, torch.cuda.is_available() is {torch.cuda.is_available()})",
)


@pytest.fixture
def no_accelerator(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """A machine with neither CUDA nor torch_npu (``import torch_npu`` raises ImportError)."""
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setitem(sys.modules, "torch_npu", None)
    return monkeypatch


# --- the choice ---


def test_auto_is_the_cpu_and_gloo_on_this_machine() -> None:
    if torch.cuda.is_available() or npu_available():
        pytest.skip("this machine has an accelerator: auto does not pick the CPU here")
    chosen = select("auto", device=5)
    assert chosen == CPU
    assert (chosen.kind, chosen.index, chosen.backend) == ("cpu", None, "gloo")
    assert chosen.torch_device == torch.device("cpu")
    assert Worker(5, replace(SMALL, accelerator="auto")).accelerator == CPU


def test_auto_takes_cuda_then_an_npu_then_the_cpu(no_accelerator: pytest.MonkeyPatch) -> None:
    monkeypatch = no_accelerator
    assert select("auto") == CPU
    # torch_npu imports and sees 4 NPUs
    monkeypatch.setitem(sys.modules, "torch_npu", types.ModuleType("torch_npu"))
    npu = types.SimpleNamespace(is_available=lambda: True, device_count=lambda: 4)
    monkeypatch.setattr(torch, "npu", npu, raising=False)
    chosen = select("auto", device=6)
    assert (chosen.kind, chosen.index, chosen.backend) == ("npu", 2, "hccl")
    # CUDA comes first
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    chosen = select("auto", device=3)
    assert (chosen.kind, chosen.index, chosen.backend) == ("cuda", 1, "nccl")
    assert chosen.torch_device == torch.device("cuda", 1)
    assert select("cpu", device=3) == CPU  # asked for explicitly, the CPU stays the CPU


def test_the_local_index_is_local_rank_else_the_device_id_modulo_the_devices(
    no_accelerator: pytest.MonkeyPatch,
) -> None:
    monkeypatch = no_accelerator
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert [select("cuda", device=d).index for d in (0, 3, 4, 13)] == [0, 3, 0, 1]
    monkeypatch.setenv("LOCAL_RANK", "2")
    assert select("cuda", device=13).index == 2
    monkeypatch.setenv("LOCAL_RANK", "4")
    with pytest.raises(Unavailable, match="LOCAL_RANK=4, but cuda has 4 devices here"):
        select("cuda", device=13)
    monkeypatch.delenv("LOCAL_RANK")
    check_ranks("cuda", 4)
    with pytest.raises(Unavailable, match="5 ranks need 5 cuda devices, this machine has 4"):
        check_ranks("cuda", 5)
    check_ranks("cpu", 64)  # ranks share the CPU


def test_an_absent_accelerator_is_refused_naming_the_option(
    no_accelerator: pytest.MonkeyPatch,
) -> None:
    with pytest.raises(
        Unavailable, match=r"^--accelerator cuda: .* use --accelerator cpu or auto$"
    ):
        select("cuda")
    with pytest.raises(Unavailable, match=r"^--accelerator npu: .*torch_npu does not import"):
        select("npu")
    with pytest.raises(Unavailable, match=r"^TrainConfig\.accelerator cuda: "):
        Worker(0, replace(SMALL, accelerator="cuda"))
    with pytest.raises(Unavailable, match=r"^TrainConfig\.accelerator npu: "):
        run_local(2, [Phase(PP2, 1)], replace(SMALL, accelerator="npu"))
    with pytest.raises(Unavailable, match="not one of auto, cpu, cuda, npu"):
        select("tpu")


def test_a_torch_npu_that_fails_to_import_is_reported_not_taken_for_absent(
    no_accelerator: pytest.MonkeyPatch,
) -> None:
    def broken(name: str) -> Any:
        raise OSError("libhccl.so: cannot open shared object file")

    no_accelerator.setattr("importlib.import_module", broken)
    with pytest.raises(
        Unavailable, match=r"^--accelerator auto: torch_npu is installed but failed to import"
    ):
        select("auto")


def _plan_file(tmp_path: Path, data: dict[str, Any]) -> Path:
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data))
    return path


def test_the_commands_refuse_an_absent_accelerator_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], no_accelerator: pytest.MonkeyPatch
) -> None:
    plan_file = str(_plan_file(tmp_path, PP2))
    # the whole command, as a user runs it: status 2, one line, no traceback
    if CUDA_DEVICES == 0:  # the fixture's torch sees none; the child sees this machine's
        command = [sys.executable, "-m", "worker_agent.trainer", "local", "--plan", plan_file]
        result = subprocess.run(
            [*command, "--accelerator", "cuda"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert result.returncode == 2, result.stderr
        assert result.stderr.startswith("local: --accelerator cuda: "), result.stderr
        assert len(result.stderr.strip().splitlines()) == 1, result.stderr
        assert "Traceback" not in result.stderr
    # the other two commands, in this process (no CUDA, no torch_npu)
    rank = ["rank", "--plan", plan_file, "--device", "0", "--store", "127.0.0.1:1"]
    assert trainer_main([*rank, "--accelerator", "npu"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("rank: --accelerator npu: ") and len(err.strip().splitlines()) == 1
    assert trainer_main(["profile", "--layers", "1", "--accelerator", "cuda"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("profile: --accelerator cuda: ") and len(err.strip().splitlines()) == 1


def test_importing_the_trainer_does_not_import_torch_npu(tmp_path: Path) -> None:
    """A stand-in torch_npu on the path: importing every module of the trainer leaves it alone,
    while asking whether an NPU is here does import it (so the check above could fail)."""
    fake = tmp_path / "torch_npu"
    fake.mkdir()
    (fake / "__init__.py").write_text(
        "import types\nimport torch\n"
        "torch.npu = types.SimpleNamespace(is_available=lambda: False, device_count=lambda: 0)\n"
    )
    script = (
        "import sys\n"
        "import worker_agent.trainer.__main__\n"
        "from worker_agent.trainer import (checkfree, checkpoint, comm, data, device, drill,\n"
        "    engine, handover, launch, model, profiler, rank, schedule, serve)\n"
        "print('torch_npu' in sys.modules)\n"
        "print(device.npu_available(), 'torch_npu' in sys.modules)\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    result = subprocess.run(
        [sys.executable, "-c", script],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["False", "False", "True"]


# --- the CPU path is unchanged ---


@functools.cache
def _master() -> dist.TCPStore:
    return dist.TCPStore(HOST, 0, is_master=True, wait_for_workers=False)


def _train(config: TrainConfig, tag: str) -> tuple[list[float], list[torch.Tensor]]:
    """Two ranks in threads: 2 steps of PP2 (point-to-point), then DP2 with the layers handed
    over (gradient all-reduce), 2 steps; every step's loss and every layer's state after."""
    ranks = [Rank(d, HOST, _master().port, config) for d in (0, 1)]
    prefixes = [f"{tag}0/", f"{tag}1/"]
    losses: list[float] = []
    with ThreadPoolExecutor(2) as pool:
        list(pool.map(lambda r: r.apply(PP2, prefixes[0], fresh=True), ranks))
        for _ in range(2):
            results = list(pool.map(lambda r: r.train_step(), ranks))
            losses.append(results[0].loss)
        list(pool.map(lambda r: r.apply(DP2, prefixes[1]), ranks))
        for _ in range(2):
            results = list(pool.map(lambda r: r.train_step(), ranks))
            losses.append(results[0].loss)
    states = [r.worker.export_layer(k) for r in ranks for k in sorted(r.worker.layers)]
    for rank in ranks:
        rank.leave()
    for prefix in prefixes:  # wake the stopped watchers, as test_rank.py does
        request_abort(_master(), prefix)
    return losses, states


def test_a_rank_asked_for_the_cpu_trains_bitwise_as_the_default() -> None:
    if select("auto").kind != "cpu":
        pytest.skip("auto is not the CPU on this machine: the two paths differ by design")
    default = _train(SMALL, "cpu-default-")
    for choice in ("cpu", "auto"):
        losses, states = _train(replace(SMALL, accelerator=choice), f"cpu-{choice}-")
        assert losses == default[0], choice
        assert len(states) == len(default[1]) == 4
        assert all(torch.equal(a, b) for a, b in zip(states, default[1], strict=True)), choice
    # and it is training: the single-process reference's losses
    reference = train_reference(SMALL, 4, range(4))
    np.testing.assert_allclose(default[0], reference.losses, rtol=1e-5)


def test_the_local_command_on_the_cpu_explicitly_is_the_default_bitwise(tmp_path: Path) -> None:
    if select("auto").kind != "cpu":
        pytest.skip("auto is not the CPU on this machine: the two paths differ by design")
    plan_file = str(_plan_file(tmp_path, PP2))
    command = [sys.executable, "-m", "worker_agent.trainer", "local", "--plan", plan_file]
    command += ["--steps", "2", "--d-model", "32", "--heads", "2", "--seq", "16"]
    reports = []
    for name, extra in (("default", []), ("cpu", ["--accelerator", "cpu"])):
        out = tmp_path / f"{name}.json"
        result = subprocess.run(
            [*command, *extra, "--json", str(out)],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert result.returncode == 0, result.stderr[-2000:]
        assert "on cpu (gloo)" in result.stderr
        reports.append(json.loads(out.read_text()))
    default, cpu = reports
    assert default["accelerator"] == cpu["accelerator"] == "cpu"
    assert [s["loss"] for s in cpu["steps"]] == [s["loss"] for s in default["steps"]]


# --- two ranks over nccl (only where two CUDA devices are) ---


@TWO_CUDA_DEVICES
def test_two_ranks_train_over_nccl_as_on_the_cpu() -> None:
    """PP2 (messages staged through the host over gloo, the loss all-reduced over nccl), then
    DP2 with the layers handed over (gradients all-reduced over nccl)."""
    config = replace(SMALL, accelerator="cuda")
    phases = [Phase(PP2, 2), Phase(DP2, 2, carry=True)]
    result = run_local(2, phases, config, collect_weights=True, timeout_s=300)
    losses = {**result.losses(0), **result.losses(1)}
    reference = train_reference(SMALL, 4, range(4))
    np.testing.assert_allclose([losses[s] for s in range(4)], reference.losses, rtol=1e-3)
    replicas = result.weights[1]
    for k, params in replicas[0].items():
        for name, value in params.items():
            np.testing.assert_array_equal(value, replicas[1][k][name], err_msg=f"{k} {name}")


@TWO_CUDA_DEVICES
def test_a_survivor_leaves_an_nccl_all_reduce_at_once_when_aborted() -> None:
    """Device 1 hangs before step 1 and is killed; device 0, in step 1's gradient all-reduce
    over nccl, leaves when the abort key is set, and trains on alone on a new generation."""
    config = replace(SMALL, accelerator="cuda")
    alone = plan(pipeline(2, stage(0, 0, 2)))
    phases = [Phase(DP2, 3, fault=Fault(device=1, before_step=1)), Phase(alone, 2, carry=True)]
    result = run_local(2, phases, config, timeout_s=300)
    [(_, failed, killed, at)] = result.faults
    assert (failed, killed) == (1, True)
    [(phase, device, step, left)] = result.aborts
    assert (phase, device, step) == (0, 0, 1)
    assert 0.0 <= left - at < 1.0  # not the group's timeout (60 s)
    assert sorted(result.losses(1)) == [1, 2]
