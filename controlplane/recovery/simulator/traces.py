"""Failure traces: drawn up front from a seed (Poisson, Weibull, nodes, bursts) or read from CSV."""

from __future__ import annotations

import csv
import heapq
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import TextIO

import numpy as np
from scipy.special import gamma

from controlplane.recovery.errors import InvalidScenario
from controlplane.recovery.model import Cluster, FailureKind

SECONDS_PER_HOUR = 3600.0
CSV_COLUMNS = ("time_s", "devices", "kind", "repair_s")


@dataclass(frozen=True, slots=True)
class TraceFailure:
    """Devices that go down together at ``time_s``; they return after ``repair_s`` (None: never)."""

    time_s: float
    devices: tuple[int, ...]
    kind: FailureKind = FailureKind.CRASH
    repair_s: float | None = None

    @property
    def repaired_at_s(self) -> float:
        return math.inf if self.repair_s is None else self.time_s + self.repair_s


@dataclass(frozen=True, slots=True)
class Trace:
    """Failures in time order, the same for every policy that replays them."""

    failures: tuple[TraceFailure, ...]

    def within(self, horizon_s: float) -> Trace:
        return Trace(tuple(f for f in self.failures if f.time_s <= horizon_s))


class Distribution(StrEnum):
    POISSON = "poisson"
    WEIBULL = "weibull"


class RepairDistribution(StrEnum):
    FIXED = "fixed"
    EXPONENTIAL = "exponential"


def _check(ok: bool, field: str, message: str) -> None:
    if not ok:
        raise InvalidScenario(message, field=field)


@dataclass(frozen=True, slots=True)
class TraceSpec:
    """How to draw a trace; rates are per device-hour (per node-hour for whole-node failures).

    Every device, spares included, runs its own renewal process: Poisson (exponential gaps at
    ``failure_rate_per_device_hour``) or Weibull gaps with ``weibull_shape`` and a scale that keeps
    the same mean gap unless ``weibull_scale_hours`` is given. A failure takes its whole node with
    ``node_failure_prob``; nodes also fail on their own at ``node_failure_rate_per_node_hour``.
    With ``burst_prob`` a failure sets off ``burst_size`` more, on random live devices, within
    ``burst_window_s``. Devices come back after ``repair_hours`` (fixed or exponential; None:
    never), and their clock restarts then.
    """

    distribution: Distribution = Distribution.POISSON
    failure_rate_per_device_hour: float = 0.0
    weibull_shape: float = 1.0
    weibull_scale_hours: float | None = None
    node_failure_prob: float = 0.0
    node_failure_rate_per_node_hour: float = 0.0
    burst_prob: float = 0.0
    burst_size: int = 0
    burst_window_s: float = 60.0
    repair_hours: float | None = None
    repair_distribution: RepairDistribution = RepairDistribution.FIXED

    def __post_init__(self) -> None:
        finite = math.isfinite
        rate = self.failure_rate_per_device_hour
        _check(
            finite(rate) and rate >= 0,
            "failure_rate_per_device_hour",
            "must be a rate ≥ 0 per device-hour",
        )
        _check(
            finite(self.weibull_shape) and self.weibull_shape > 0, "weibull_shape", "must be > 0"
        )
        scale = self.weibull_scale_hours
        _check(scale is None or (finite(scale) and scale > 0), "weibull_scale_hours", "must be > 0")
        for name, p in (
            ("node_failure_prob", self.node_failure_prob),
            ("burst_prob", self.burst_prob),
        ):
            _check(0 <= p <= 1, name, f"must be a probability in [0, 1], got {p}")
        node_rate = self.node_failure_rate_per_node_hour
        _check(
            finite(node_rate) and node_rate >= 0, "node_failure_rate_per_node_hour", "must be ≥ 0"
        )
        _check(self.burst_size >= 0, "burst_size", "must be ≥ 0")
        window = self.burst_window_s
        _check(finite(window) and window >= 0, "burst_window_s", "must be ≥ 0")
        repair = self.repair_hours
        _check(repair is None or (finite(repair) and repair > 0), "repair_hours", "must be > 0")

    @property
    def mean_gap_hours(self) -> float:
        """Mean time between two failures of one device (∞ when it never fails)."""
        if self.distribution is Distribution.WEIBULL and self.weibull_scale_hours is not None:
            return self.weibull_scale_hours * float(gamma(1 + 1 / self.weibull_shape))
        rate = self.failure_rate_per_device_hour
        return math.inf if rate <= 0 else 1 / rate


class _Draws:
    """The random numbers of one trace, from one seeded generator, always in the same order."""

    def __init__(self, spec: TraceSpec, seed: int) -> None:
        self.spec = spec
        self.rng = np.random.default_rng(seed)
        mean_s = spec.mean_gap_hours * SECONDS_PER_HOUR
        self.mean_gap_s = mean_s
        # Weibull: mean = scale · Γ(1 + 1/k), so this scale keeps the requested mean gap
        self.weibull_scale_s = mean_s / float(gamma(1 + 1 / spec.weibull_shape))

    def gaps_s(self, n: int) -> list[float]:
        if math.isinf(self.mean_gap_s):
            return [math.inf] * n
        if self.spec.distribution is Distribution.WEIBULL:
            values = self.weibull_scale_s * self.rng.weibull(self.spec.weibull_shape, size=n)
        else:
            values = self.rng.exponential(self.mean_gap_s, size=n)
        return [float(v) for v in values]

    def repair_s(self) -> float | None:
        hours = self.spec.repair_hours
        if hours is None:
            return None
        if self.spec.repair_distribution is RepairDistribution.EXPONENTIAL:
            return float(self.rng.exponential(hours * SECONDS_PER_HOUR))
        return hours * SECONDS_PER_HOUR

    def chance(self, p: float) -> bool:
        return p > 0 and bool(self.rng.random() < p)


# kinds of happenings in the generator's queue, in the order they run at equal times
_REPAIR, _DEVICE, _NODE, _BURST = range(4)


def generate(spec: TraceSpec, cluster: Cluster, horizon_s: float, seed: int) -> Trace:
    """Draw the failures of every device (spares included) over ``horizon_s`` seconds.

    The trace depends only on the spec, the cluster's size and the seed, never on a policy.
    """
    draws = _Draws(spec, seed)
    n = cluster.total_devices
    per_node = cluster.devices_per_node
    nodes = -(-n // per_node)
    up = [True] * n
    version = [0] * n
    queue: list[tuple[float, int, int, int, tuple[int, ...]]] = []
    order = 0

    def push(time_s: float, what: int, device: int = -1, devices: tuple[int, ...] = ()) -> None:
        nonlocal order
        if time_s <= horizon_s:
            heapq.heappush(queue, (time_s, what, order, device, devices))
            order += 1

    for device, gap in enumerate(draws.gaps_s(n)):
        push(gap, _DEVICE, device, (0,))
    node_rate_s = spec.node_failure_rate_per_node_hour * nodes / SECONDS_PER_HOUR
    if node_rate_s > 0:
        push(float(draws.rng.exponential(1 / node_rate_s)), _NODE)

    failures: list[TraceFailure] = []

    def fail(time_s: float, devices: tuple[int, ...], kind: FailureKind) -> None:
        repair = draws.repair_s()
        for d in devices:
            up[d] = False
            version[d] += 1
        failures.append(TraceFailure(time_s, devices, kind, repair))
        if repair is not None:
            push(time_s + repair, _REPAIR, devices=devices)

    def node_devices(node: int) -> tuple[int, ...]:
        return tuple(d for d in range(node * per_node, min((node + 1) * per_node, n)) if up[d])

    while queue:
        time_s, what, _, device, devices = heapq.heappop(queue)
        if what == _REPAIR:
            gaps = draws.gaps_s(len(devices))
            for d, gap in zip(devices, gaps, strict=True):
                up[d] = True
                version[d] += 1
                push(time_s + gap, _DEVICE, d, (version[d],))
        elif what == _NODE:
            hit = node_devices(int(draws.rng.integers(nodes)))
            if hit:
                fail(time_s, hit, FailureKind.NODE_LOST)
            push(time_s + float(draws.rng.exponential(1 / node_rate_s)), _NODE)
        elif what == _BURST:
            if up[device]:
                fail(time_s, (device,), FailureKind.CRASH)
        elif up[device] and devices[0] == version[device]:
            if draws.chance(spec.node_failure_prob):
                fail(time_s, node_devices(cluster.node_of(device)), FailureKind.NODE_LOST)
            else:
                fail(time_s, (device,), FailureKind.CRASH)
            if draws.chance(spec.burst_prob) and spec.burst_size:
                # a burst's own failures set off no further bursts
                alive = [d for d in range(n) if up[d]]
                count = min(spec.burst_size, len(alive))
                picked = draws.rng.choice(len(alive), size=count, replace=False)
                offsets = draws.rng.uniform(0, spec.burst_window_s, size=count)
                for i, offset in zip(picked, offsets, strict=True):
                    push(time_s + float(offset), _BURST, alive[int(i)])
    return Trace(tuple(failures))


def write_csv(trace: Trace, stream: TextIO) -> None:
    """Write the documented CSV format; floats are written so that they read back exactly."""
    writer = csv.writer(stream, lineterminator="\n")
    writer.writerow(CSV_COLUMNS)
    for f in trace.failures:
        writer.writerow(
            [
                repr(f.time_s),
                ";".join(str(d) for d in f.devices),
                f.kind.value,
                "" if f.repair_s is None else repr(f.repair_s),
            ]
        )


def save_csv(trace: Trace, path: str | Path) -> None:
    with Path(path).open("w", newline="") as stream:
        write_csv(trace, stream)


def _rows(lines: Iterable[str]) -> Iterator[tuple[int, list[str]]]:
    """Rows with their line numbers; blank lines and lines starting with '#' are skipped."""
    numbered = ((i, line) for i, line in enumerate(lines, start=1))
    kept = [(i, line) for i, line in numbered if line.strip() and not line.lstrip().startswith("#")]
    for (i, _), row in zip(kept, csv.reader(line for _, line in kept), strict=True):
        yield i, [cell.strip() for cell in row]


def parse_csv(text: str, cluster: Cluster, *, source: str = "trace") -> Trace:
    """Read a trace; any bad cell raises InvalidScenario naming ``source:line:column``."""
    rows = _rows(text.splitlines())
    header = next(rows, None)
    if header is None:
        raise InvalidScenario(f"empty; expected a header {','.join(CSV_COLUMNS)}", field=source)
    line, columns = header
    unknown = [c for c in columns if c not in CSV_COLUMNS]
    missing = [c for c in ("time_s", "devices") if c not in columns]
    if unknown or missing or len(set(columns)) != len(columns):
        raise InvalidScenario(
            f"header {','.join(columns)} must name time_s and devices, optionally kind and "
            f"repair_s, once each",
            field=f"{source}:{line}",
        )
    down_until: dict[int, tuple[float, int]] = {}
    failures: list[TraceFailure] = []
    last = 0.0
    for line, cells in rows:
        if len(cells) != len(columns):
            raise InvalidScenario(
                f"has {len(cells)} fields, the header {len(columns)}", field=f"{source}:{line}"
            )
        row = dict(zip(columns, cells, strict=True))

        def where(column: str, line: int = line) -> str:
            return f"{source}:{line}:{column}"

        time_s = _float(row["time_s"], where("time_s"))
        if time_s < last:
            raise InvalidScenario(
                f"{time_s} comes before the previous row's {last}", field=where("time_s")
            )
        last = time_s
        devices = _devices(row["devices"], cluster, where("devices"))
        for d in devices:
            until, since = down_until.get(d, (-math.inf, 0))
            if time_s < until:
                raise InvalidScenario(
                    f"device {d} is still down (failed on line {since}, back at {until})",
                    field=where("devices"),
                )
        kind = _kind(row.get("kind", ""), where("kind"))
        repair_text = row.get("repair_s", "")
        repair = None if repair_text == "" else _float(repair_text, where("repair_s"))
        if repair is not None and repair <= 0:
            raise InvalidScenario("must be > 0 (leave it empty for never)", field=where("repair_s"))
        failure = TraceFailure(time_s, devices, kind, repair)
        for d in devices:
            down_until[d] = (failure.repaired_at_s, line)
        failures.append(failure)
    return Trace(tuple(failures))


def load_csv(path: str | Path, cluster: Cluster) -> Trace:
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise InvalidScenario(f"cannot read {path}: {exc.strerror}", field="trace") from None
    return parse_csv(text, cluster, source=str(path))


def _float(text: str, field: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise InvalidScenario(f"{text!r} is not a number", field=field) from None
    if not math.isfinite(value) or value < 0:
        raise InvalidScenario(f"{text!r} is not a finite number ≥ 0", field=field)
    return value


def _devices(text: str, cluster: Cluster, field: str) -> tuple[int, ...]:
    if not text:
        raise InvalidScenario("names no device; write ids as 3 or 3;4;5", field=field)
    out = []
    for part in text.split(";"):
        try:
            device = int(part)
        except ValueError:
            raise InvalidScenario(
                f"{part!r} is not a device id (3 or 3;4;5)", field=field
            ) from None
        cluster.check_device(device, field=field)
        out.append(device)
    if len(set(out)) != len(out):
        raise InvalidScenario(f"lists a device twice: {text}", field=field)
    return tuple(sorted(out))


def _kind(text: str, field: str) -> FailureKind:
    if text == "":
        return FailureKind.CRASH
    try:
        return FailureKind(text)
    except ValueError:
        known = ", ".join(k.value for k in FailureKind)
        raise InvalidScenario(f"unknown kind {text!r}; known: {known}", field=field) from None
