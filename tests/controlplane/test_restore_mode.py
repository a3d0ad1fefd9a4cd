"""The ``restore`` an ``apply_plan`` command carries follows the chosen candidate's policy."""

from __future__ import annotations

from typing import Any

import pytest
from django.utils import timezone

from controlplane.incidents.applying import restore_mode
from controlplane.incidents.models import RecoveryDecision
from worker_agent import protocol


def _decision(chosen: int | None, *policies: str, decision: Any = ...) -> RecoveryDecision:
    body = {"candidates": [{"policy": p} for p in policies]} if decision is ... else decision
    return RecoveryDecision(chosen=chosen, decision=body)


@pytest.mark.parametrize(
    ("policy", "mode"),
    [
        ("checkfree", "neighbours"),
        ("checkfree_plus", "neighbours_plus"),
        ("checkpoint", "checkpoint"),
        ("varuna", "checkpoint"),
        ("flashrecovery", None),
        ("rerouting", None),
        ("dynamic", None),
    ],
)
def test_the_chosen_candidates_policy_names_the_mode(policy: str, mode: str | None) -> None:
    got = restore_mode(_decision(1, "rerouting", policy))
    assert (None if got is None else got.value) == mode


def test_an_edited_plan_or_a_broken_decision_restores_from_peers() -> None:
    assert restore_mode(_decision(None, "checkfree")) is None
    assert restore_mode(_decision(3, "checkfree")) is None
    assert restore_mode(_decision(0, decision=None)) is None


def test_the_command_carries_it_and_an_old_command_still_parses() -> None:
    frame = protocol.Command(
        id="c", action=protocol.Action.APPLY_PLAN, restore=protocol.RestoreMode.NEIGHBOURS
    )
    assert frame.model_dump(mode="json", exclude_none=True)["restore"] == "neighbours"
    old = protocol.Command.model_validate({"type": "command", "id": "c", "action": "apply_plan"})
    assert old.restore is None
    with pytest.raises(ValueError):
        protocol.Command.model_validate(
            {"type": "command", "id": "c", "action": "apply_plan", "restore": "tape"}
        )


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("chosen", "decision", "mode"),
    [
        (
            1,
            {"candidates": [{"policy": "rerouting"}, {"policy": "checkfree_plus"}]},
            "neighbours_plus",
        ),
        (0, {"candidates": [{"policy": "checkpoint"}, {"policy": "checkfree"}]}, "checkpoint"),
        (0, {"candidates": [{"policy": "dynamic"}]}, None),
        (2, {"candidates": [{"policy": "checkfree"}]}, None),
        (0, None, None),
    ],
)
def test_a_decision_read_without_its_candidates_reads_the_chosen_policy_from_its_row(
    chosen: int, decision: Any, mode: str | None
) -> None:
    """A status change leaves the candidates unread (they are megabytes at 16,384 devices);
    the mode is then the chosen candidate's policy as the row keeps it."""
    from controlplane.incidents.models import DECISION_HEAVY, Failure
    from controlplane.jobs.models import Job

    job = Job.objects.create(name="j", scenario={}, plan={})
    now = timezone.now()
    failure = Failure.objects.create(
        job=job, kind="crash", devices=[0], source="agent", occurred_at=now, detected_at=now
    )
    stored = RecoveryDecision.objects.create(
        job=job, failure=failure, chosen=chosen, decision=decision
    )
    unread = RecoveryDecision.objects.defer(*DECISION_HEAVY).get(pk=stored.pk)
    assert "decision" in unread.get_deferred_fields()
    got = restore_mode(unread)
    assert (None if got is None else got.value) == mode
    assert "decision" in unread.get_deferred_fields()  # still unread
