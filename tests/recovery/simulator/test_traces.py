"""Failure traces: drawn with the right statistics, whole nodes, bursts, repairs, CSV replay."""

from __future__ import annotations

import io
import math
import statistics

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from controlplane.recovery.errors import InvalidScenario
from controlplane.recovery.model import Cluster, FailureKind
from controlplane.recovery.simulator.traces import (
    Distribution,
    RepairDistribution,
    Trace,
    TraceFailure,
    TraceSpec,
    generate,
    parse_csv,
    write_csv,
)

HOUR = 3600.0


def cluster(devices: int = 16, per_node: int = 4, spares: int = 0) -> Cluster:
    return Cluster(devices=devices, devices_per_node=per_node, spares=spares)


def failed_count(trace: Trace) -> int:
    return sum(len(f.devices) for f in trace.failures)


def test_poisson_trace_fails_the_expected_share_of_devices() -> None:
    # without repairs each device fails at most once, by T with probability 1 − e^(−λT)
    spec = TraceSpec(failure_rate_per_device_hour=0.5)
    counts = [failed_count(generate(spec, cluster(200), 2 * HOUR, seed)) for seed in range(20)]
    expected = 200 * (1 - math.exp(-1.0))
    assert statistics.fmean(counts) == pytest.approx(expected, rel=0.03)


def test_poisson_trace_with_repairs_keeps_the_rate_of_up_devices() -> None:
    # short repairs keep almost every device up, so failures come at about N·λ·T
    spec = TraceSpec(failure_rate_per_device_hour=0.2, repair_hours=0.01)
    counts = [failed_count(generate(spec, cluster(100), 10 * HOUR, seed)) for seed in range(10)]
    assert statistics.fmean(counts) == pytest.approx(100 * 0.2 * 10, rel=0.05)


def test_weibull_trace_follows_its_distribution() -> None:
    # shape 2, scale 1 h: P(fail by 1 h) = 1 − e^(−1)
    spec = TraceSpec(distribution=Distribution.WEIBULL, weibull_shape=2.0, weibull_scale_hours=1)
    counts = [failed_count(generate(spec, cluster(200), HOUR, seed)) for seed in range(20)]
    assert statistics.fmean(counts) == pytest.approx(200 * (1 - math.exp(-1.0)), rel=0.03)


def test_weibull_scale_defaults_to_the_poisson_mean_gap() -> None:
    spec = TraceSpec(
        distribution=Distribution.WEIBULL, weibull_shape=3.0, failure_rate_per_device_hour=0.25
    )
    assert spec.mean_gap_hours == pytest.approx(4.0)


def test_same_seed_draws_the_same_trace_and_another_seed_another() -> None:
    spec = TraceSpec(failure_rate_per_device_hour=1.0, repair_hours=0.5, node_failure_prob=0.2)
    assert generate(spec, cluster(), 5 * HOUR, 7) == generate(spec, cluster(), 5 * HOUR, 7)
    assert generate(spec, cluster(), 5 * HOUR, 7) != generate(spec, cluster(), 5 * HOUR, 8)


def test_node_failures_take_every_live_device_of_the_node() -> None:
    spec = TraceSpec(failure_rate_per_device_hour=1.0, node_failure_prob=1.0)
    trace = generate(spec, cluster(16, per_node=4), 10 * HOUR, 3)
    assert trace.failures
    for f in trace.failures:
        assert f.kind is FailureKind.NODE_LOST
        # nothing is repaired, so a node fails once, whole
        assert f.devices == tuple(range(f.devices[0], f.devices[0] + 4))
    nodes = [f.devices[0] // 4 for f in trace.failures]
    assert len(nodes) == len(set(nodes))


def test_node_failure_rate_fails_nodes_on_their_own() -> None:
    spec = TraceSpec(node_failure_rate_per_node_hour=2.0)
    trace = generate(spec, cluster(32, per_node=8), 10 * HOUR, 1)
    assert {f.kind for f in trace.failures} == {FailureKind.NODE_LOST}
    assert sorted(d for f in trace.failures for d in f.devices) == list(range(32))


def test_bursts_follow_a_failure_within_the_window() -> None:
    # rare device failures, each setting off 3 more within 30 s: groups of 4 in 30 s
    spec = TraceSpec(
        failure_rate_per_device_hour=0.01, burst_prob=1.0, burst_size=3, burst_window_s=30
    )
    trace = generate(spec, cluster(64), 10 * HOUR, 5)
    groups: list[list[float]] = []
    for f in trace.failures:
        if groups and f.time_s - groups[-1][0] <= 30:
            groups[-1].append(f.time_s)
        else:
            groups.append([f.time_s])
    assert len(groups) >= 2
    assert all(len(g) == 4 for g in groups)


def test_spares_fail_too() -> None:
    spec = TraceSpec(failure_rate_per_device_hour=5.0)
    trace = generate(spec, cluster(4, spares=4), HOUR, 0)
    assert {d for f in trace.failures for d in f.devices} == set(range(8))


def test_repairs_return_devices_before_they_fail_again() -> None:
    spec = TraceSpec(failure_rate_per_device_hour=2.0, repair_hours=0.5)
    trace = generate(spec, cluster(8), 20 * HOUR, 2)
    back_at: dict[int, float] = {}
    refailed = 0
    for f in trace.failures:
        assert f.repair_s == 0.5 * HOUR
        for d in f.devices:
            assert f.time_s >= back_at.get(d, 0.0), "a device fails only while it is up"
            refailed += d in back_at
            back_at[d] = f.repaired_at_s
    assert refailed > 0, "repaired devices fail again"


def test_exponential_repairs_vary_around_their_mean() -> None:
    spec = TraceSpec(
        failure_rate_per_device_hour=1.0,
        repair_hours=2.0,
        repair_distribution=RepairDistribution.EXPONENTIAL,
    )
    trace = generate(spec, cluster(100), 10 * HOUR, 4)
    repairs = [f.repair_s for f in trace.failures if f.repair_s is not None]
    assert len(set(repairs)) == len(repairs)
    assert statistics.fmean(repairs) == pytest.approx(2 * HOUR, rel=0.15)


@given(
    seed=st.integers(0, 2**32 - 1),
    rate=st.floats(0.01, 5.0),
    node_prob=st.floats(0, 1),
    repair=st.one_of(st.none(), st.floats(0.01, 3.0)),
)
@settings(max_examples=30, deadline=None)
def test_csv_round_trip_replays_the_trace_exactly(
    seed: int, rate: float, node_prob: float, repair: float | None
) -> None:
    spec = TraceSpec(
        failure_rate_per_device_hour=rate,
        node_failure_prob=node_prob,
        repair_hours=repair,
        repair_distribution=RepairDistribution.EXPONENTIAL,
    )
    trace = generate(spec, cluster(12, per_node=4, spares=2), 8 * HOUR, seed)
    stream = io.StringIO()
    write_csv(trace, stream)
    assert parse_csv(stream.getvalue(), cluster(12, per_node=4, spares=2)) == trace


def test_csv_documented_example_reads() -> None:
    text = (
        "# time_s,devices,kind,repair_s\n"
        "time_s,devices,kind,repair_s\n"
        "3600,3,crash,7200\n"
        "5400.5,8;9;10;11,node_lost,\n"
        "\n"
        "6000,4,,\n"
    )
    trace = parse_csv(text, cluster(16))
    assert trace.failures == (
        TraceFailure(3600.0, (3,), FailureKind.CRASH, 7200.0),
        TraceFailure(5400.5, (8, 9, 10, 11), FailureKind.NODE_LOST, None),
        TraceFailure(6000.0, (4,), FailureKind.CRASH, None),
    )


def test_csv_without_optional_columns_reads() -> None:
    trace = parse_csv("devices,time_s\n1;2,10\n", cluster(4))
    assert trace.failures == (TraceFailure(10.0, (1, 2)),)


@pytest.mark.parametrize(
    ("text", "field", "message"),
    [
        ("", "t.csv", "empty"),
        ("time,devices\n", "t.csv:1", "header"),
        ("time_s,devices\nabc,1\n", "t.csv:2:time_s", "not a number"),
        ("time_s,devices\n-5,1\n", "t.csv:2:time_s", "≥ 0"),
        ("time_s,devices\ninf,1\n", "t.csv:2:time_s", "finite"),
        ("time_s,devices\n10,1\n5,2\n", "t.csv:3:time_s", "before"),
        ("time_s,devices\n1,\n", "t.csv:2:devices", "names no device"),
        ("time_s,devices\n1,a\n", "t.csv:2:devices", "not a device id"),
        ("time_s,devices\n1,99\n", "t.csv:2:devices", "does not exist"),
        ("time_s,devices\n1,2;2\n", "t.csv:2:devices", "twice"),
        ("time_s,devices,repair_s\n1,2,100\n50,2,\n", "t.csv:3:devices", "still down"),
        ("time_s,devices,kind\n1,2,meteor\n", "t.csv:2:kind", "unknown kind"),
        ("time_s,devices,repair_s\n1,2,0\n", "t.csv:2:repair_s", "> 0"),
        ("time_s,devices\n1,2,3\n", "t.csv:2", "fields"),
    ],
)
def test_bad_csv_names_line_and_column(text: str, field: str, message: str) -> None:
    with pytest.raises(InvalidScenario) as caught:
        parse_csv(text, cluster(8), source="t.csv")
    assert caught.value.field == field
    assert message in str(caught.value)


def test_device_may_fail_again_once_repaired() -> None:
    trace = parse_csv("time_s,devices,repair_s\n1,2,100\n101,2,\n", cluster(4))
    assert len(trace.failures) == 2


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("failure_rate_per_device_hour", -1.0),
        ("weibull_shape", 0.0),
        ("weibull_scale_hours", -2.0),
        ("node_failure_prob", 1.5),
        ("node_failure_rate_per_node_hour", math.inf),
        ("burst_prob", -0.1),
        ("burst_window_s", -1.0),
        ("repair_hours", 0.0),
        ("burst_size", -1),
    ],
)
def test_bad_trace_spec_names_its_field(field: str, value: float) -> None:
    """The spec's errors speak its own words; only the command line maps them to flags."""
    with pytest.raises(InvalidScenario) as caught:
        TraceSpec(**{field: value})  # type: ignore[arg-type]
    assert caught.value.field == field
