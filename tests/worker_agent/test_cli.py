"""The agent's and the injector's command lines refuse what they cannot do; the plan check
names the field at fault."""

from __future__ import annotations

import os
from typing import Any

import pytest

from worker_agent import __main__ as entry
from worker_agent import agent, faults, protocol

BASE = ["--job", "j", "--node", "n", "--token", "t"]


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        ([*BASE, "--devices", "0,1"], "trainer command is missing"),
        ([*BASE, "--devices", "0,x", "--", "true"], "expected numbers"),
        ([*BASE, "--devices", "0,0", "--", "true"], "distinct"),
        ([*BASE, "--devices", "0", "--server", "http://h:1", "--", "true"], "ws://HOST:PORT"),
        ([*BASE, "--devices", "0", "--serve-store", "--", "true"], "needs --store"),
        ([*BASE, "--devices", "0", "--store", "nohost", "--", "true"], "HOST:PORT"),
        (["--devices", "0", "--", "true"], "--job, --node and --token"),
        ([*BASE, "--devices", "0", "--straggler-factor", "1", "--", "true"], "> 1"),
    ],
)
def test_run_refuses_what_it_cannot_do(
    argv: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as stopped:
        agent.settings_from(argv)
    assert stopped.value.code == 2
    assert says in capsys.readouterr().err


def test_run_takes_the_trainer_command_after_the_dashes() -> None:
    settings = agent.settings_from(
        [
            *BASE,
            "--devices",
            "2,3",
            "--store",
            "h:29500",
            "--",
            "python",
            "train.py",
            "--device",
            "{device}",
        ]
    )
    assert settings.devices == [2, 3] and settings.store == "h:29500"
    assert settings.command == ["python", "train.py", "--device", "{device}"]


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["kill", "--pid", str(os.getpid())], "is not a rank of a running agent"),
        (["slow", "--pid", "1", "--seconds", "601"], "--seconds must be within"),
        (["slow", "--pid", "1", "--stopped-fraction", "1"], "--stopped-fraction"),
        (["kill", "--agent", "1"], "needs --device"),
        (["kill"], "name the target"),
        (["explode", "--pid", "1"], "invalid choice"),
    ],
)
def test_inject_refuses_what_it_cannot_do(
    argv: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as stopped:
        faults.main(argv)
    assert stopped.value.code == 2
    assert says in capsys.readouterr().err


def test_the_entry_point_names_its_commands(capsys: pytest.CaptureFixture[str]) -> None:
    assert entry.main([]) == 2
    assert entry.main(["nope"]) == 2
    out = capsys.readouterr()
    assert "run,launch,inject,simulate" in out.out and "unknown command 'nope'" in out.err


def apply(plan: Any) -> protocol.Command:
    return protocol.Command(id="c", action=protocol.Action.APPLY_PLAN, decision=1, plan=plan)


def test_the_plan_check_refuses_a_dead_rank_and_takes_a_plan_without_this_node() -> None:
    two = {
        "pipelines": [
            {
                "stages": [{"devices": [0], "layers": [0, 4]}, {"devices": [1], "layers": [4, 8]}],
                "micro_batches": 2,
            }
        ]
    }
    error = agent.check_plan(apply(two), {0, 1}, {1}, None)
    assert error is not None and error.code is protocol.ErrorCode.INVALID
    assert error.field == "plan.pipelines[0].stages[1].devices"
    assert "whose trainer is not running" in error.message
    elsewhere = {
        "pipelines": [{"stages": [{"devices": [4], "layers": [0, 8]}], "micro_batches": 2}]
    }
    assert agent.check_plan(apply(elsewhere), {0, 1}, set(), None) is None, "a spare node"
    short = agent.check_plan(apply(two), {0, 1}, set(), 12)
    assert short is not None and short.field == "plan.pipelines[0].stages"
    assert agent.check_plan(apply(two), {0, 1}, set(), 8) is None
    huge = {
        "pipelines": [{"stages": [{"devices": [0], "layers": [0, 10**12]}], "micro_batches": 1}]
    }
    past = agent.check_plan(apply(huge), {0, 1}, set(), None)
    assert past is not None and past.field == "plan.pipelines[0].stages[0].layers"
    broken = agent.check_plan(apply({"pipelines": "no"}), {0, 1}, set(), None)
    assert broken is not None and broken.field == "plan.pipelines"
