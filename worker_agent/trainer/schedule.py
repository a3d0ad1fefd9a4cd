"""Which device runs which micro-batch of which stage, and in which order.

Every pipeline runs its own micro-batches through its own stages. A stage that runs on its own
device runs all of its pipeline's micro-batches; a rerouted stage (``Stage.rerouted``) lists the
devices of the live replicas of its layers, and its pipeline's micro-batch m runs on replica
``m mod (number of replicas)``, next to that replica's own work.

The order on each device is fixed before the step by a list-scheduling simulation of the whole
plan with unit costs (forward = layers, backward = 2 · layers): among the operations whose
inputs are ready, a device takes backwards before forwards, then the lowest micro-batch, and a
stage keeps at most (depth − stage index) forwards in flight, which is 1F1B on every pipeline of
a plan without rerouting. Since the simulated start times order every device's operations and
every dependency the same way, running each device's list in order can never deadlock, however
long the real operations take; and the order, hence the sum order of gradients, is the same in
every run.

An operation's ``stage`` is the micro-batch's position in its pipeline: the stage of that index,
except in a pipeline trained out of order (CheckFree+, ``swapped``), where the odd micro-batches
run the first two stages and the last two in swapped order (``stage_at``).
"""

from __future__ import annotations

import heapq
from collections.abc import Collection
from dataclasses import dataclass

from controlplane.recovery.model import ExecutionPlan


@dataclass(frozen=True, slots=True, order=True)
class Op:
    """The forward or backward pass of one micro-batch through one stage of one pipeline
    (``stage``: the position in the pipeline, ``stage_at``)."""

    backward: bool
    pipeline: int
    stage: int
    micro: int


def stage_at(
    plan: ExecutionPlan, pipeline: int, position: int, micro: int, swapped: Collection[int] = ()
) -> int:
    """The stage micro-batch ``micro`` runs at ``position`` of ``pipeline``: the same index,
    except in a pipeline of ``swapped`` (CheckFree+'s out-of-order training), where an odd
    micro-batch runs stage 1 before stage 0 and the last stage before the one before it."""
    if pipeline not in swapped or micro % 2 == 0:
        return position
    last = plan.pipelines[pipeline].depth - 1
    return {0: 1, 1: 0, last - 1: last, last: last - 1}.get(position, position)


def executor(
    plan: ExecutionPlan, pipeline: int, stage: int, micro: int, swapped: Collection[int] = ()
) -> int:
    """The device that runs micro-batch ``micro`` at position ``stage`` of ``pipeline``
    (tp = 1)."""
    s = plan.pipelines[pipeline].stages[stage_at(plan, pipeline, stage, micro, swapped)]
    return s.devices[micro % len(s.devices)] if s.rerouted else s.devices[0]


def build_schedule(
    plan: ExecutionPlan, *, cap: bool = True, swapped: Collection[int] = ()
) -> dict[int, list[Op]]:
    """Every device's operations of one step, in the order it runs them (``swapped``: the
    pipelines trained out of order)."""
    ops: list[Op] = []
    for p, pipeline in enumerate(plan.pipelines):
        for s in range(pipeline.depth):
            for m in range(pipeline.micro_batches):
                ops += [Op(False, p, s, m), Op(True, p, s, m)]

    def deps(op: Op) -> list[Op]:
        last = plan.pipelines[op.pipeline].depth - 1
        if not op.backward:
            return [] if op.stage == 0 else [Op(False, op.pipeline, op.stage - 1, op.micro)]
        own = Op(False, op.pipeline, op.stage, op.micro)
        if op.stage == last:
            return [own]
        return [own, Op(True, op.pipeline, op.stage + 1, op.micro)]

    def cost(op: Op) -> int:
        stage = stage_at(plan, op.pipeline, op.stage, op.micro, swapped)
        layers = plan.pipelines[op.pipeline].stages[stage].layer_count
        return layers * (2 if op.backward else 1)

    device_of = {op: executor(plan, op.pipeline, op.stage, op.micro, swapped) for op in ops}
    waiting = {op: len(deps(op)) for op in ops}
    users: dict[Op, list[Op]] = {op: [] for op in ops}
    for op in ops:
        for dep in deps(op):
            users[dep].append(op)
    end_time: dict[Op, int] = {}
    free_at: dict[int, int] = {}
    in_flight: dict[tuple[int, int, int], int] = {}
    # ready[device]: (ready time, backward first, micro, pipeline, stage, op)
    ready: dict[int, list[tuple[int, bool, int, int, int, Op]]] = {}

    def push(op: Op, at: int) -> None:
        entry = (at, not op.backward, op.micro, op.pipeline, op.stage, op)
        heapq.heappush(ready.setdefault(device_of[op], []), entry)

    for op in ops:
        if not waiting[op]:
            push(op, 0)
    order: dict[int, list[Op]] = {}
    while len(end_time) < len(ops):
        best: tuple[int, tuple[bool, int, int, int], int, Op] | None = None
        for device, heap in ready.items():
            start_floor = free_at.get(device, 0)
            for at, fwd, micro, p, s, op in heap:
                role = (p, s, device)
                depth = plan.pipelines[p].depth
                if cap and fwd and in_flight.get(role, 0) >= depth - s:
                    continue
                key = (max(at, start_floor), (fwd, micro, p, s), device, op)
                if best is None or key[:3] < best[:3]:
                    best = key
        if best is None:
            if cap:  # cannot happen for the plans the core makes; never deadlock in any case
                return build_schedule(plan, cap=False, swapped=swapped)
            raise RuntimeError("the plan's operations depend on each other in a cycle")
        start, _, device, op = best
        heap = ready[device]
        heap.remove(next(e for e in heap if e[-1] == op))
        heapq.heapify(heap)
        role = (op.pipeline, op.stage, device)
        in_flight[role] = in_flight.get(role, 0) + (-1 if op.backward else 1)
        end_time[op] = start + cost(op)
        free_at[device] = end_time[op]
        order.setdefault(device, []).append(op)
        for user in users[op]:
            waiting[user] -= 1
            if not waiting[user]:
                push(user, max(end_time[d] for d in deps(user)))
    return order
