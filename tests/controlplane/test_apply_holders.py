"""An ``apply_plan`` lists the previous plan's live devices (``holders``) when the new plan leaves
one of them out, so that a layer only such a device holds can still be sent; the field's codec,
and the agent's refusal of a holder whose rank is down."""

from __future__ import annotations

import copy
import datetime as dt
import json
from pathlib import Path
from typing import Any

import pytest
from django.contrib.auth.models import User
from django.utils import timezone

from controlplane.incidents import decisions
from controlplane.incidents.models import AgentCommand, FailureSource, RecoveryDecision
from controlplane.jobs.models import ApprovalMode, Node, NodeStatus
from controlplane.jobs.services import create_job
from worker_agent import link, protocol
from worker_agent.agent import check_holders

ROOT = Path(__file__).resolve().parents[2]
# 32 layers on 4 stages × 2 pipelines (devices 0-7, node-0), spares 8 and 9 (node-1)
SCENARIO = json.loads((ROOT / "examples" / "llama2-7b-pp4-dp2-tp1.json").read_text())
SCENARIO["failed"] = []
SCENARIO["cluster"]["spares"] = 2


def _proposed(name: str) -> RecoveryDecision:
    job, _ = create_job(
        name,
        copy.deepcopy(SCENARIO),
        approval_mode=ApprovalMode.MANUAL,
        enabled_policies=["rerouting", "checkpoint"],
    )
    Node.objects.filter(job=job).update(status=NodeStatus.HEALTHY)  # both agents connected
    _, decision = decisions.record_failure(
        job,
        kind="crash",
        devices=[5],
        source=FailureSource.AGENT,
        occurred_at=timezone.now() - dt.timedelta(seconds=0.2),
    )
    decisions.plan(decision.pk)
    return RecoveryDecision.objects.select_related("job").get(pk=decision.pk)


def _with_second_pipeline(decision: RecoveryDecision, devices: list[int]) -> dict[str, Any]:
    plan: dict[str, Any] = copy.deepcopy(decision.job.plan)
    plan["family"] = "dynamic"
    for stage, device in zip(plan["pipelines"][1]["stages"], devices, strict=True):
        stage["devices"] = [device]
        stage.pop("rerouted", None)
    return plan


def _frames(decision: RecoveryDecision) -> dict[str, dict[str, Any]]:
    commands = AgentCommand.objects.filter(decision=decision).select_related("node")
    return {c.node.name: c.frame for c in commands}


@pytest.mark.django_db
def test_an_edited_plan_that_leaves_a_live_device_out_lists_the_live_holders() -> None:
    operator = User.objects.create_user("olga", password="x")
    decision = _proposed("leaves-7-out")
    # pipeline 1 on 4, 8, 6, 9: device 5 failed, device 7 is alive and left out
    edited = _with_second_pipeline(decision, [4, 8, 6, 9])
    decisions.override(decision.pk, user=operator, edited_plan=edited, reason="spares")
    frames = _frames(decision)
    assert set(frames) == {"node-0", "node-1"}
    for frame in frames.values():
        assert frame["holders"] == [0, 1, 2, 3, 4, 6, 7]  # not 5: failed
        parsed = protocol.parse_server_frame(json.dumps(frame))
        assert isinstance(parsed, protocol.Command) and parsed.holders == frame["holders"]


@pytest.mark.django_db
def test_a_plan_that_keeps_every_live_device_leaves_the_field_out() -> None:
    operator = User.objects.create_user("olga", password="x")
    decision = _proposed("keeps-all")
    edited = _with_second_pipeline(decision, [4, 8, 6, 7])  # only the failed device replaced
    decisions.override(decision.pk, user=operator, edited_plan=edited, reason="spare")
    frames = _frames(decision)
    assert frames and all("holders" not in f for f in frames.values())


def test_the_field_round_trips_and_an_old_command_still_parses() -> None:
    frame = protocol.Command(id="c", action=protocol.Action.APPLY_PLAN, holders=[3, 0, 1])
    text = protocol.encode(frame)
    assert json.loads(text)["holders"] == [3, 0, 1]
    assert protocol.parse_server_frame(text) == frame
    old = protocol.parse_server_frame('{"type": "command", "id": "c", "action": "apply_plan"}')
    assert isinstance(old, protocol.Command) and old.holders is None
    assert "holders" not in json.loads(protocol.encode(old))


@pytest.mark.parametrize(
    ("holders", "why"),
    [([1, 1], "lists a device twice"), ([], "at least 1"), ([-1], "greater than or equal")],
)
def test_a_bad_list_is_refused_naming_the_field(holders: list[int], why: str) -> None:
    raw = json.dumps({"type": "command", "id": "c", "action": "apply_plan", "holders": holders})
    with pytest.raises(protocol.ProtocolError) as error:
        protocol.parse_server_frame(raw)
    assert error.value.code == protocol.ErrorCode.INVALID
    assert error.value.field is not None and error.value.field.startswith("holders")
    assert why in error.value.message


def test_the_link_carries_it_to_the_rank_and_an_old_rank_ignores_it() -> None:
    message = link.CommandMessage(
        id="c", action="apply_plan", generation="d3/", plan={}, holders=[0, 1]
    )
    decoded = link.decode_from_agent(link.encode(message))
    assert isinstance(decoded, link.CommandMessage) and decoded.holders == [0, 1]
    line = json.dumps({"t": "command", "id": "c", "action": "pause", "generation": "d0/"})
    bare = link.decode_from_agent(line.encode())
    assert isinstance(bare, link.CommandMessage) and bare.holders is None


def test_the_agent_refuses_a_holder_of_its_own_whose_rank_is_down() -> None:
    command = protocol.Command(id="c", action=protocol.Action.APPLY_PLAN, holders=[0, 1, 2])
    error = check_holders(command, dead={1})
    assert error is not None and error.field == "holders" and "device 1" in error.message
    assert check_holders(command, dead={5}) is None
    assert check_holders(protocol.Command(id="c", action=protocol.Action.APPLY_PLAN), {1}) is None
