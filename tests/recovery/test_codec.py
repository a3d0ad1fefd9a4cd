"""The codec: every object survives a trip through JSON, and bad plans name their field."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from controlplane.recovery.codec import (
    candidate_from_dict,
    candidate_to_dict,
    decision_from_dict,
    decision_to_dict,
    plan_to_dict,
    state_from_dict,
    state_to_dict,
    validate_plan,
)
from controlplane.recovery.codes import MEANINGS, Code
from controlplane.recovery.decision import decide
from controlplane.recovery.errors import InvalidScenario
from controlplane.recovery.model import (
    Assumptions,
    ClusterState,
    Failure,
    FailureKind,
    ModelProfile,
)
from controlplane.recovery.policies.dynamic import plan_dynamic
from controlplane.recovery.policies.rerouting import plan_rerouting
from tests.recovery.builders import examples, grid_state


def through_json(data: Any) -> Any:
    return json.loads(json.dumps(data, allow_nan=False))


@st.composite
def states(draw: st.DrawFn) -> ClusterState:
    pp = draw(st.integers(1, 4))
    dp = draw(st.integers(1, 3))
    tp = draw(st.sampled_from([1, 2]))
    layers = draw(st.integers(pp, 12))
    seconds = st.floats(0.01, 5.0, allow_nan=False)
    per_layer = st.one_of(
        seconds.map(lambda x: (x,) * layers),
        st.lists(seconds, min_size=layers, max_size=layers).map(tuple),
    )
    profile = ModelProfile(
        name=draw(st.text(min_size=1, max_size=8)),
        fwd_s=draw(per_layer),
        bwd_s=draw(per_layer),
        m_p=draw(per_layer),
        m_o=draw(per_layer),
        m_g=draw(per_layer),
        m_a=draw(per_layer),
        boundary_bytes=draw(st.one_of(st.none(), st.floats(1.0, 1e6))),
    )
    devices = pp * dp * tp
    failed = draw(st.sets(st.integers(0, devices - 1), max_size=2))
    return grid_state(
        layers=layers,
        pp=pp,
        dp=dp,
        tp=tp,
        micro_batches=draw(st.integers(1, 6)),
        failed=sorted(failed),
        profile=profile,
        spares=draw(st.integers(0, 2)),
        devices_per_node=draw(st.sampled_from([1, 2, 8])),
        memory_bytes=draw(st.sampled_from([math.inf, 1e3, 1e12])),
        failure_rate=draw(st.sampled_from([0.0, 0.1])),
        bandwidth_gbps=draw(st.sampled_from([None, (400.0, 100.0)])),
        assumptions=Assumptions(
            restart_s=draw(st.sampled_from([2.0, 60.0])),
            checkpoint_interval_steps=draw(st.integers(1, 200)),
        ),
    )


@given(state=states())
@settings(max_examples=examples(100), deadline=None)
def test_states_round_trip_through_json(state: ClusterState) -> None:
    assert state_from_dict(through_json(state_to_dict(state))) == state


@given(state=states())
@settings(max_examples=examples(60), deadline=None)
def test_candidates_round_trip_through_json(state: ClusterState) -> None:
    for candidate in (plan_rerouting("rerouting", state), plan_dynamic("dynamic", state)):
        data = through_json(candidate_to_dict(candidate))
        back = candidate_from_dict(data, profile=state.profile, cluster=state.cluster)
        assert back == candidate


@given(state=states(), kind=st.sampled_from(FailureKind))
@settings(max_examples=examples(40), deadline=None)
def test_decisions_round_trip_through_json(state: ClusterState, kind: FailureKind) -> None:
    failure = Failure(kind=kind, devices=state.failed or frozenset({0}), detected_at_s=1.5)
    decision = decide(
        state.with_failure(failure), failure, policies=["odyssey", "flashrecovery", "checkfree"]
    )
    data = through_json(decision_to_dict(decision))
    assert decision_from_dict(data, profile=state.profile, cluster=state.cluster) == decision


def test_a_stored_choice_must_be_a_feasible_candidate() -> None:
    state = grid_state(pp=2, dp=2, failed=[1])
    failure = Failure(kind=FailureKind.CRASH, devices=state.failed)
    data = decision_to_dict(decide(state, failure, policies=["rerouting", "checkpoint"]))
    assert data["candidates"][1]["code"] == "no_spare"  # checkpoint needs a spare
    data["chosen"] = 1
    with pytest.raises(InvalidScenario, match=r"^decision\.chosen: does not name a feasible"):
        decision_from_dict(data, profile=state.profile, cluster=state.cluster)
    data["chosen"], data["failure"]["devices"] = 0, [99]
    with pytest.raises(InvalidScenario, match=r"^decision\.failure\.devices\[0\]"):
        decision_from_dict(data, profile=state.profile, cluster=state.cluster)


def test_examples_round_trip(tmp_path: Any) -> None:
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    for path in sorted((root / "examples").glob("*.json")):
        state = state_from_dict(json.loads(path.read_text()))
        assert state_from_dict(through_json(state_to_dict(state))) == state


# --- an operator's edited plan ---


def edited(state: ClusterState, **changes: Any) -> dict[str, Any]:
    """The state's own plan as a dict, for a test to break one field of."""
    data = plan_to_dict(state.plan)
    for path, value in changes.items():
        target: Any = data
        *parents, last = path.split("__")
        for key in parents:
            target = target[int(key)] if key.isdigit() else target[key]
        target[int(last) if last.isdigit() else last] = value
    return data


def test_a_valid_edit_is_the_plan_it_describes() -> None:
    state = grid_state(pp=2, dp=2)
    assert validate_plan(plan_to_dict(state.plan), state) == state.plan


@pytest.mark.parametrize(
    ("changes", "field", "words"),
    [
        (
            {"pipelines__0__stages__1__layers": [5, 8]},
            "plan.pipelines[0].stages[1].layers",
            "layer",
        ),
        ({"pipelines__1__stages__0__devices": [0]}, "plan.pipelines[1].stages[0].devices", "used"),
        ({"pipelines__0__stages__0__devices": [99]}, "plan.pipelines[0].stages[0].devices", "99"),
        ({"pipelines__0__micro_batches": 9}, "plan.pipelines", "micro-batches"),
        ({"pipelines__0__colour": "red"}, "plan.pipelines[0].colour", "extra"),
        ({"family": "teleport"}, "plan.family", "input"),
    ],
)
def test_a_bad_edit_names_its_field(changes: dict[str, Any], field: str, words: str) -> None:
    state = grid_state(pp=2, dp=2)
    with pytest.raises(InvalidScenario) as error:
        validate_plan(edited(state, **changes), state)
    assert error.value.field == field
    assert words in str(error.value)


def test_an_edit_may_not_use_a_failed_device() -> None:
    state = grid_state(pp=2, dp=2, failed=[3])
    with pytest.raises(InvalidScenario) as error:
        validate_plan(plan_to_dict(state.plan), state)
    assert error.value.field == "plan.pipelines[1].stages[1].devices"
    assert "failed devices [3]" in str(error.value)


def test_an_edit_over_memory_names_the_stage() -> None:
    """8 layers of 1 byte static and 1 byte activation each, 2 stages of 4, 4 micro-batches:
    eq. 14 gives stage 0 4 + 2·4 = 12 bytes and stage 1 4 + 1·4 = 8 bytes."""
    profile = ModelProfile.uniform(name="m", layers=8, fwd_s=1.0, bwd_s=2.0, m_p=1.0, m_a=1.0)
    fits = grid_state(pp=2, dp=1, profile=profile, memory_bytes=12.0)
    assert validate_plan(plan_to_dict(fits.plan), fits) == fits.plan
    tight = grid_state(pp=2, dp=1, profile=profile, memory_bytes=11.0)
    with pytest.raises(InvalidScenario) as error:
        validate_plan(plan_to_dict(tight.plan), tight)
    assert error.value.field == "plan.pipelines[0].stages[0]"


def test_every_code_has_the_meaning_the_docs_give_it() -> None:
    """docs/scenario.md's table of codes and ``codes.MEANINGS`` (the dashboard's explanations)
    say the same, for every code."""
    docs = (Path(__file__).resolve().parents[2] / "docs" / "scenario.md").read_text()
    table = docs[docs.index("### Candidate codes") :]
    documented = {
        c: m.replace("`", "") for c, m in re.findall(r"^\| `(\w+)` \| (.+) \|$", table, re.M)
    }
    assert documented == {code.value: MEANINGS[code] for code in Code}
