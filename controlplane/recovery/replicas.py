"""The replicas of a plan whose pipelines share one layer split, kept per plan.

At scale, walking the plan is the cost of a decision: 131,072 devices are 131,072 stages at
TP 1, and rerouting, the step-time estimate, the gradient sync and the memory estimate each walk
them all, while a failure changes one stage. ``of(plan)`` gives what those walks read off a plan
whose pipelines all have the same layer split (the plan a job starts from, a grid re-plan, and
every plan rerouting makes of them): per stage, its live replicas in pipeline order and the
micro-batches rerouted off it; per pipeline, what its step time depends on; and every device
that runs a stage of its own. It is built in one walk and kept for the last few plans, and
``rerouted`` derives a successor's from it in the time of the stages that change.

Callers (``policies/rerouting.py``, ``estimator/``) read it instead of walking the plan and get
the same plan and the same numbers, bit for bit: tests/recovery/test_replicas.py holds every
reading to the walks over random plans.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import threading
from collections import Counter, OrderedDict
from collections.abc import Iterator
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field

from controlplane.recovery.model import (
    Cluster,
    ExecutionPlan,
    Family,
    Group,
    LayerRange,
    Pipeline,
    Stage,
)

# A pipeline's eq. 11 time depends on its micro-batches and, per stage boundary, whether the
# two stages' first devices share a node (``estimator.time.p2p_times``).
Links = tuple[int, tuple[bool, ...]]


@dataclass(slots=True)
class Replicas:
    """A same-split plan's replicas. Nothing in it changes once it is built (``rerouted``
    copies what it changes, and the device set is the first plan's less the devices lost
    since), so the plan it describes can be asked again."""

    split: tuple[LayerRange, ...]
    tp: int
    devices_per_node: int
    micro_batches: tuple[int, ...]  # per pipeline
    micro_batch_counts: frozenset[int]  # the distinct values of ``micro_batches``
    live: list[dict[int, Group]]  # per stage: pipeline -> its own group, in pipeline order
    rerouted: list[dict[int, int]]  # per stage: pipeline -> micro-batches rerouted off it
    peers: list[Group]  # per stage: its live replicas' devices in order (a rerouted copy's)
    # every device of a live stage -> (pipeline, stage); never changed after the first build,
    # so an entry holds only while its pipeline is still in ``live`` of that stage
    owner: dict[int, tuple[int, int]]
    links: Counter[Links]  # pipelines per ``Links``
    device_count: int
    idle: frozenset[int]  # the cluster's devices (spares too) that run no stage of their own
    # every device that ran a stage of its own when the plan was built, and those lost since
    base: frozenset[int] = field(default=frozenset(), repr=False)
    dropped: frozenset[int] = field(default=frozenset(), repr=False)

    @property
    def devices(self) -> AbstractSet[int]:
        """Every device that runs a stage of its own (``ExecutionPlan.devices``), as a set view
        that is not copied at every failure."""
        return self.base if not self.dropped else Without(self.base, self.dropped)

    def one_node(self, stage: int) -> bool:
        """Whether the live replicas of a stage all sit on one node (or there are none)."""
        peers = self.peers[stage]
        if len(peers) > self.devices_per_node:
            return False  # more devices than a node holds
        return len({d // self.devices_per_node for d in peers}) <= 1


class Without(AbstractSet[int]):
    """A set less a few of its members, read without copying the set (131,072 devices at
    TP 1, of which a failure drops a handful). ``dropped`` is a subset of ``base``."""

    __slots__ = ("base", "dropped")

    def __init__(self, base: frozenset[int], dropped: frozenset[int]) -> None:
        self.base, self.dropped = base, dropped

    def __contains__(self, device: object) -> bool:
        return device in self.base and device not in self.dropped

    def __len__(self) -> int:
        return len(self.base) - len(self.dropped)

    def __iter__(self) -> Iterator[int]:
        return (d for d in self.base if d not in self.dropped)


def _links(devices_per_node: int, m: int, stages: tuple[Stage, ...]) -> Links:
    firsts = [s.devices[0] // devices_per_node for s in stages]
    return m, tuple(a == b for a, b in itertools.pairwise(firsts))


def build(plan: ExecutionPlan, cluster: Cluster) -> Replicas | None:
    """One walk over a plan; None unless every pipeline has the same layer split, every live
    stage has its own devices and every rerouted stage lists its live replicas, as
    ``rerouted`` makes them."""
    if not plan.pipelines:
        return None
    devices_per_node = cluster.devices_per_node
    split = tuple(s.layers for s in plan.pipelines[0].stages)
    tp = plan.tp
    if not split or tp == 0:
        return None
    depth = len(split)
    live: list[dict[int, Group]] = [{} for _ in split]
    rerouted: list[dict[int, int]] = [{} for _ in split]
    owner: dict[int, tuple[int, int]] = {}
    links: Counter[Links] = Counter()
    count = 0
    for p, pipeline in enumerate(plan.pipelines):
        stages = pipeline.stages
        if len(stages) != depth:
            return None
        for s, stage in enumerate(stages):
            if stage.layers != split[s]:
                return None
            if stage.rerouted:
                rerouted[s][p] = pipeline.micro_batches
            else:
                if len(stage.devices) != tp:
                    return None
                live[s][p] = stage.devices
                for d in stage.devices:
                    owner[d] = (p, s)
                count += tp
        links[_links(devices_per_node, pipeline.micro_batches, stages)] += 1
    if len(owner) != count:
        return None  # a device runs two stages
    peers = [tuple(itertools.chain.from_iterable(stage.values())) for stage in live]
    checked: set[tuple[int, int]] = set()  # a stage's rerouted copies share one tuple
    for s, lost in enumerate(rerouted):
        for p in lost:
            listed = plan.pipelines[p].stages[s].devices
            if (s, id(listed)) not in checked:
                if listed != peers[s]:
                    return None
                checked.add((s, id(listed)))
    return Replicas(
        split=split,
        tp=tp,
        devices_per_node=devices_per_node,
        micro_batches=tuple(p.micro_batches for p in plan.pipelines),
        micro_batch_counts=frozenset(p.micro_batches for p in plan.pipelines),
        live=live,
        rerouted=rerouted,
        peers=peers,
        owner=owner,
        links=links,
        device_count=count,
        idle=frozenset(range(cluster.total_devices)).difference(owner),
        base=frozenset(owner),
    )


def rerouted(
    plan: ExecutionPlan, replicas: Replicas, failed: frozenset[int]
) -> tuple[ExecutionPlan, Replicas] | str:
    """``policies.rerouting.reroute``: every stage with a failed device served by its live
    replicas, and its ``Replicas``, in the time of the stages that change. Returns the same
    reason as ``reroute`` when a stage has no live replica left."""
    hit: dict[int, set[int]] = {}  # stage -> pipelines that lose it now
    for p, s in _hit(replicas, failed):
        hit.setdefault(s, set()).add(p)
    live, peers = list(replicas.live), list(replicas.peers)
    lost = list(replicas.rerouted)
    gone: set[int] = set()
    for s, lose in hit.items():
        live[s] = dict(live[s])
        for p in lose:
            del live[s][p]
    # as ``reroute`` walks the plan: the first stage, pipeline by pipeline, left with no replica
    orphaned = [
        (min(hit.get(s, set()) | replicas.rerouted[s].keys()), s)
        for s in range(len(live))
        if not live[s] and (s in hit or replicas.rerouted[s])
    ]
    if orphaned:
        layers = list(replicas.split[min(orphaned)[1]])
        return f"layers {layers} lost every replica; no peer to reroute their micro-batches to"
    for s, lose in hit.items():
        peers[s] = tuple(itertools.chain.from_iterable(live[s].values()))
        lost[s] = dict(lost[s])
        for p in lose:
            lost[s][p] = replicas.micro_batches[p]
            gone.update(replicas.live[s][p])
    # The pipelines whose stages change: a stage lost now, or a rerouted copy of a stage whose
    # replicas changed. Every rerouted copy of a stage is the same: its live replicas' devices.
    copies = {s: Stage(devices=peers[s], layers=replicas.split[s], rerouted=True) for s in hit}
    changes: dict[int, list[int]] = {}
    for s in hit:
        for p in lost[s]:
            changes.setdefault(p, []).append(s)
    # A copy's links change only when its stage's first device moves to another node (or the
    # stage is lost now): a stage that loses a replica keeps its first one, most of the time.
    per_node = replicas.devices_per_node
    moved = {s for s in hit if replicas.peers[s][0] // per_node != peers[s][0] // per_node}
    pipelines = list(plan.pipelines)
    links = replicas.links.copy()
    for p, stages_of in changes.items():
        old = pipelines[p]
        stages = list(old.stages)
        for s in stages_of:
            stages[s] = copies[s]
        pipelines[p] = new_pipeline = Pipeline(
            stages=tuple(stages), micro_batches=old.micro_batches
        )
        if any(s in moved or p in hit[s] for s in stages_of):
            before = _links(per_node, old.micro_batches, old.stages)
            after = _links(per_node, old.micro_batches, new_pipeline.stages)
            links[before] -= 1
            if not links[before]:
                del links[before]
            links[after] += 1
    new = ExecutionPlan(pipelines=tuple(pipelines), family=Family.REROUTING)
    base, dropped = replicas.base, replicas.dropped.union(gone)
    if len(dropped) > len(base) // 4:  # read through often enough: copy it now
        base, dropped = base - dropped, frozenset()
    return new, dataclasses.replace(
        replicas,
        live=live,
        rerouted=lost,
        peers=peers,
        links=links,
        device_count=replicas.device_count - len(gone),
        idle=replicas.idle.union(gone),
        base=base,
        dropped=dropped,
    )


# The plans a thread asked about last (a simulated job's running plan and its candidates).
MEMO_PLANS = 8


class _Memo(threading.local):
    def __init__(self) -> None:
        # id(plan) -> (plan, cluster, its replicas or None); the plan is kept so that its id is
        # not reused while the entry lives
        self.plans: OrderedDict[int, tuple[ExecutionPlan, Cluster, Replicas | None]] = OrderedDict()
        self.walking = False


@contextlib.contextmanager
def walking() -> Iterator[None]:
    """Within it, this thread's readings walk the plan as they did before replicas: for the
    tests that hold the two equal and the benchmark that compares their speed."""
    earlier, _MEMO.walking = _MEMO.walking, True
    try:
        yield
    finally:
        _MEMO.walking = earlier


_MEMO = _Memo()


def of(plan: ExecutionPlan, cluster: Cluster) -> Replicas | None:
    """The plan's ``Replicas`` (None when its pipelines do not share one split), remembered."""
    if _MEMO.walking:
        return None
    entry = _MEMO.plans.get(id(plan))
    if entry is not None and entry[0] is plan and entry[1] == cluster:
        _MEMO.plans.move_to_end(id(plan))
        return entry[2]
    found = build(plan, cluster)
    remember(plan, cluster, found)
    return found


def remember(plan: ExecutionPlan, cluster: Cluster, replicas: Replicas | None) -> None:
    _MEMO.plans[id(plan)] = (plan, cluster, replicas)
    _MEMO.plans.move_to_end(id(plan))
    while len(_MEMO.plans) > MEMO_PLANS:
        _MEMO.plans.popitem(last=False)


def devices(plan: ExecutionPlan, cluster: Cluster) -> AbstractSet[int]:
    """``plan.devices()``, read off its replicas where it has them."""
    found = of(plan, cluster)
    return plan.devices() if found is None else found.devices


def device_count(plan: ExecutionPlan, cluster: Cluster) -> int:
    found = of(plan, cluster)
    return len(plan.devices()) if found is None else found.device_count


def _hit(known: Replicas, failed: frozenset[int]) -> set[tuple[int, int]]:
    """The live stages (pipeline, stage) with a failed device."""
    found = set()
    for d in failed:
        where = known.owner.get(d)
        if where is not None and where[0] in known.live[where[1]]:
            found.add(where)
    return found


def usable_group_count(
    plan: ExecutionPlan, cluster: Cluster, failed: frozenset[int], *, include_spares: bool
) -> int | None:
    """``len(planner.usable_groups(...))`` without listing them; None without replicas."""
    known = of(plan, cluster)
    if known is None:
        return None
    hit = _hit(known, failed)
    loose = set(known.idle)
    for p, s in hit:
        loose.update(known.live[s][p])
    loose.difference_update(failed)
    if not include_spares:
        loose.difference_update(cluster.spare_ids)
    per_node = Counter(d // cluster.devices_per_node for d in loose)
    regrouped = sum(n // known.tp for n in per_node.values())
    return known.device_count // known.tp - len(hit) + regrouped
