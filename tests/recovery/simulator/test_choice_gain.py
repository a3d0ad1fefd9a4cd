"""What choosing per failure earns against the best fixed policy of a sweep (its summary's
``choice_gain``), checked against sums written out here."""

from __future__ import annotations

import json
import statistics

import pytest
from hypothesis import given
from hypothesis import strategies as st

from controlplane.recovery.causes import Cause
from controlplane.recovery.simulator.metrics import choice_gain, summarize
from controlplane.recovery.simulator.timeline import Run, Segment

BATCH = 8


def run(policy: str, seed: int, samples: float) -> Run:
    """A run that trained ``samples`` in one running segment of 100 s."""
    step_s = BATCH * 100.0 / samples
    return Run(policy, seed, 100.0, BATCH, (Segment(0.0, 100.0, Cause.RUNNING, step_s),), ())


SAMPLES = st.floats(min_value=1.0, max_value=1e6, allow_nan=False)


@given(
    seeds=st.integers(1, 6).flatmap(
        lambda n: st.lists(st.lists(SAMPLES, min_size=n, max_size=n), min_size=2, max_size=5)
    )
)
def test_the_gain_is_over_the_fixed_policy_with_the_most_samples(seeds: list[list[float]]) -> None:
    names = ["pitstop", *(f"fixed{i}" for i in range(len(seeds) - 1))]
    runs = {
        name: [run(name, seed, value) for seed, value in enumerate(values)]
        for name, values in zip(names, seeds, strict=True)
    }
    gain = choice_gain(runs)
    assert gain is not None
    means = {name: sum(values) / len(values) for name, values in zip(names, seeds, strict=True)}
    best = max(names[1:], key=lambda name: means[name])
    assert gain["against"] == best
    per_seed = [
        mine / theirs for mine, theirs in zip(seeds[0], seeds[names.index(best)], strict=True)
    ]
    assert gain["mean"] == pytest.approx(statistics.fmean(per_seed), rel=1e-9)
    low, high = gain["ci95"]
    assert low <= gain["mean"] * (1 + 1e-12) and gain["mean"] <= high * (1 + 1e-12)
    assert gain["pays"] == (gain["mean"] >= 1.05)


def test_a_sweep_without_the_chooser_or_with_it_alone_has_no_gain() -> None:
    alone = {"pitstop": [run("pitstop", 0, 10.0)]}
    fixed = {"odyssey": [run("odyssey", 0, 10.0)], "rerouting": [run("rerouting", 0, 9.0)]}
    assert choice_gain(alone) is None and choice_gain(fixed) is None
    assert "choice_gain" not in summarize(fixed)


def test_the_summary_says_whether_choosing_paid_and_against_which_policy() -> None:
    runs = {
        "odyssey_spares": [run("odyssey_spares", s, v) for s, v in enumerate((100.0, 120.0))],
        "pitstop": [run("pitstop", s, v) for s, v in enumerate((110.0, 132.0))],
        "flashrecovery": [run("flashrecovery", s, v) for s, v in enumerate((90.0, 130.0))],
    }
    gain = summarize(runs)["choice_gain"]
    # odyssey_spares and flashrecovery tie at 110 samples on average: the first is kept
    assert gain["against"] == "odyssey_spares" and gain["mean"] == pytest.approx(1.1)
    assert gain["ci95"] == pytest.approx([1.1, 1.1]) and gain["pays"] is True
    assert json.loads(json.dumps(gain)) == gain
