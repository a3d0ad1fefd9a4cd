"""A simulated node's heartbeat: every device's state as an agent reports it, each beat, with the
device reports made again only when a state changed."""

from __future__ import annotations

from worker_agent import protocol
from worker_agent.sim import Node

TRAINING, FAILED, IDLE = (
    protocol.DeviceState.TRAINING,
    protocol.DeviceState.FAILED,
    protocol.DeviceState.IDLE,
)


def states(node: Node, seq: int) -> dict[int, protocol.DeviceState]:
    beat = node.heartbeat(seq)
    assert beat.seq == seq
    return {report.device: report.state for report in beat.devices}


def test_each_beat_reports_every_devices_state_as_it_is_now() -> None:
    node = Node("node-1", [8, 9, 10, 11], step_s=0.5, restore_s=0.0)
    assert states(node, 1) == dict.fromkeys([8, 9, 10, 11], TRAINING)
    reports = node.reports()
    assert states(node, 2) == dict.fromkeys([8, 9, 10, 11], TRAINING)
    assert node.reports() is reports  # nothing changed: the same reports
    node.failed.add(9)  # a drill killed device 9: failed while the plan uses it
    assert states(node, 3) == {8: TRAINING, 9: FAILED, 10: TRAINING, 11: TRAINING}
    node.plan_devices = {8, 10, 11}  # a plan without it: idle
    assert states(node, 4) == {8: TRAINING, 9: IDLE, 10: TRAINING, 11: TRAINING}
    node.pause(protocol.DeviceState.RESTORING)
    assert states(node, 5) == {8: protocol.DeviceState.RESTORING, 9: IDLE,
                               10: protocol.DeviceState.RESTORING,
                               11: protocol.DeviceState.RESTORING}  # fmt: skip
    node.train()
    assert states(node, 6) == {8: TRAINING, 9: IDLE, 10: TRAINING, 11: TRAINING}
