"""A node whose devices the applied plan leaves out (a standby, a spare nobody took) is sent the
command and acknowledges it, but is not waited for to train: the decision recovers when the
nodes that run the plan have made their step."""

from __future__ import annotations

import copy
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio
from channels.db import database_sync_to_async

from controlplane.incidents.models import DecisionStatus
from controlplane.jobs.models import Job
from controlplane.jobs.services import create_job
from tests.controlplane.test_applying import (
    NODES,
    SCENARIO,
    Agent,
    eventually,
    kinds,
    latest,
)

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.asyncio,
    pytest.mark.usefixtures("eager_planning"),  # planning runs in the test's process
]

SPARES = ("node-2", [8, 9])  # two spares, on a node of their own (4 devices a node)


class Standby(Agent):
    def __init__(self, job: Job, token: str) -> None:
        self.job, self.token, self.node, self.devices = job, token, SPARES[0], SPARES[1]
        self.seq = 0


@pytest_asyncio.fixture
async def cluster() -> AsyncIterator[tuple[Job, dict[str, Agent]]]:
    scenario = copy.deepcopy(SCENARIO)
    scenario["cluster"]["spares"] = len(SPARES[1])
    job, token = await database_sync_to_async(create_job)(
        "llama", scenario, approval_mode="auto", enabled_policies=["dynamic"]
    )
    agents: dict[str, Agent] = {name: Agent(job, token, name) for name in NODES}
    agents[SPARES[0]] = Standby(job, token)
    for agent in agents.values():
        assert (await agent.connect())["type"] == "welcome"
    yield job, agents
    for agent in agents.values():
        await agent.socket.disconnect()


async def status(job: Job) -> str:
    return str((await latest(job)).status)


async def test_a_standby_node_acknowledges_but_is_not_waited_for(
    cluster: tuple[Job, dict[str, Agent]],
) -> None:
    job, agents = cluster
    await agents["node-1"].fault(5)
    sent = {name: await agent.said() for name, agent in agents.items()}
    decision = await latest(job)
    plan = decision.plan or {}
    plan_devices = {d for p in plan["pipelines"] for s in p["stages"] for d in s["devices"]}
    assert not plan_devices & set(SPARES[1])  # dynamic: the survivors, without the spares
    for name, agent in agents.items():
        assert sent[name]["action"] == "apply_plan"
        await agent.ack(sent[name]["id"])
    await agents[SPARES[0]].beat(0, state="idle")
    for name in NODES:
        await agents[name].beat(100)
    for name in NODES:
        await agents[name].beat(101)
    done = await eventually(lambda: _recovered(job))
    assert done, await kinds(decision)
    assert (await latest(job)).resumed_step == 100


async def _recovered(job: Job) -> bool:
    return await status(job) == DecisionStatus.RECOVERED
