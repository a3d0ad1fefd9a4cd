"""An unmodified torchrun DDP script under the launcher and a real control plane: a SIGKILLed
rank is a crash, the control plane decides with ``decide()`` (the job asks the launcher's
policy, ``restart``), and the launchers restart every rank in place; the script resumes from its
own checkpoint and the recovery ends ``recovered`` with every phase on its timeline."""

from __future__ import annotations

import functools
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.stack import Stack, setup
from tests.processes import REPO_ROOT, free_port
from tests.worker_agent.helpers import children_of, ranks_of

pytestmark = pytest.mark.e2e

SCENARIO = REPO_ROOT / "examples" / "torchrun-ddp-2x1.json"
SCRIPT = str(REPO_ROOT / "examples" / "torchrun_ddp.py")
ELASTIC_SCRIPT = str(REPO_ROOT / "examples" / "elastic_ddp.py")
HSDP_SCRIPT = str(REPO_ROOT / "examples" / "elastic_hsdp.py")
ELASTIC_LINE = re.compile(r"^rank (\d+) step (\d+) loss \S+ world (\d+)$", re.M)
LINE = re.compile(r"^rank (\d+) step (\d+) loss \S+ restart (\d+) world (\d+)$", re.M)


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[Stack]:
    running = Stack(tmp_path)
    running.manage("migrate", "-v", "0")
    try:
        yield running
    finally:
        running.stop_all()


def launch(
    stack: Stack,
    rank: int,
    port: int,
    *,
    token: str | None = None,
    api_token: str | None = None,
    nnodes: str = "2",
    job: str = "drill",
    elastic: bool = False,
    hsdp: bool = False,
    approval_mode: str = "auto",
) -> None:
    """``pitstop-run`` for node ``rank`` with the job's agent token, or an admin's API token
    (the job made by the first node that asks); ``elastic``: ``--elastic`` on
    examples/elastic_ddp.py rather than the plain DDP script; ``hsdp``: on
    examples/elastic_hsdp.py, two processes a node, a replica group each."""
    env = {**stack.env, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO_ROOT)}
    # the elastic scripts' model is made heavy enough that a replica's compute outweighs its
    # gradient sync (so that two replicas train faster than one, as the cost model measures:
    # at 512 samples a micro-batch a loaded CI machine measured them as fast as one, and the
    # cost model rerouted where the test wanted the restore)
    # (AdamW: SGD's step diverges at this width)
    work = ["--width", "2048", "--samples", "2048", "--optimizer", "adamw"]
    script = [ELASTIC_SCRIPT, "--micro-batches", "4", *work] if elastic else [SCRIPT]
    flags = ["--elastic"] if elastic else []
    if hsdp:
        script = [HSDP_SCRIPT, "--width", "512", "--samples", "1024"]
        flags = ["--elastic", "--nproc-per-node", "2", "--replica-size", "2"]
    script += ["--steps", "100000", "--step-s", "0.05"]
    if not elastic:
        script += ["--checkpoint-dir", str(stack.tmp / "checkpoint")]
    env.update({"PITSTOP_AGENT_TOKEN": token} if token else {"PITSTOP_API_TOKEN": api_token or ""})
    flags += ["--approval-mode", approval_mode]
    stack.processes[f"agent-node-{rank}"] = subprocess.Popen(
        [sys.executable, "-m", "worker_agent", "launch",
         "--nnodes", nnodes, "--nproc-per-node", "1", "--node-rank", str(rank),
         "--master-addr", "127.0.0.1", "--master-port", str(port), "--max-restarts", "3",
         "--server", f"ws://127.0.0.1:{stack.port}", "--job", job,
         *flags, *script],
        env=env, cwd=REPO_ROOT, stdout=(stack.tmp / f"node-{rank}.out").open("ab"),
        stderr=(stack.tmp / f"agent-node-{rank}.log").open("ab"),
    )  # fmt: skip


def both_training(stack: Stack, token: str, job: int, step: int, nodes: int = 2) -> None:
    """Until the ``nodes`` are connected and the job's step (none before the first) is past
    ``step``."""
    live = f"/api/v1/jobs/{job}/live/"

    def check() -> bool:
        now = stack.api(live, token)
        return bool(now["nodes_connected"] == nodes and (now["step"] or 0) >= step)

    stack.wait(check, "both nodes training", 150)


def steps(stack: Stack, rank: int) -> list[tuple[int, int, int, int]]:
    path = stack.tmp / f"node-{rank}.out"
    found = LINE.findall(path.read_text()) if path.exists() else []
    return [(int(r), int(s), int(n), int(w)) for r, s, n, w in found]


def test_a_killed_rank_of_an_unmodified_script_is_restarted_from_its_checkpoint(
    stack: Stack,
) -> None:
    made = json.loads(stack.manage("shell", "-c", setup(SCENARIO, ("restart",))))
    for name in ("redis", "server", "worker"):
        stack.start(name)
    token, job = made["api_token"], made["job"]
    port = free_port()
    for rank in (0, 1):
        launch(stack, rank, port, token=made["agent_token"])
    both_training(stack, token, job, 12)
    (rank,) = children_of(stack.processes["agent-node-1"].pid)
    os.kill(rank, signal.SIGKILL)
    killed_at = time.monotonic()

    def recovered() -> list[dict[str, Any]]:
        found = stack.api(f"/api/v1/recoveries/?job={job}", token)["results"]
        return found if found and found[0]["status"] in ("recovered", "failed") else []

    decision = stack.wait(recovered, "the recovery", 120)[0]
    recovered_s = time.monotonic() - killed_at
    assert decision["status"] == "recovered", decision
    assert decision["candidates"][decision["chosen"]]["policy"] == "restart"
    used = {d for p in decision["plan"]["pipelines"] for s in p["stages"] for d in s["devices"]}
    assert used == {0, 1}  # in place: the killed rank's device runs the new process
    failures = stack.api(f"/api/v1/failures/?job={job}", token)["results"]
    assert {d for f in failures for d in f["devices"]} <= {0, 1}
    assert all(f["kind"] == "crash" for f in failures)
    # the script itself resumed from its checkpoint, in a world of two, once restarted
    again = [line for r in (0, 1) for line in steps(stack, r) if line[2] == 1]
    assert {(r, w) for r, _, _, w in again} == {(0, 2), (1, 2)}
    before = max(s for r, s, n, _ in steps(stack, 0) if n == 0)
    assert min(s for _, s, _, _ in again) == before - before % 5 + 1
    timeline = stack.api(f"/api/v1/recoveries/{decision['id']}/timeline/?format=json", token)
    kinds = [event["kind"] for event in timeline["results"]]
    for kind in ("failure_detected", "planning_started", "recovered"):
        assert kind in kinds, kinds
    devices = stack.api(f"/api/v1/jobs/{job}/", token)["devices"]
    assert devices["healthy"] == 2 and devices["failed"] == 0
    print(f"launcher restart: kill to recovered {recovered_s:.1f} s")


# ``manage.py shell -c`` text: a superuser and its API token, printed; no job.
ADMIN = """
from django.contrib.auth.models import User
from rest_framework.authtoken.models import Token
print(Token.objects.create(user=User.objects.create_superuser("root", password="x")).key)
"""


def latest_recovery(stack: Stack, token: str, job: int) -> dict[str, Any]:
    found = stack.api(f"/api/v1/recoveries/?job={job}", token)["results"]
    return found[0] if found else {}


def test_nodes_make_their_job_and_a_node_in_a_lost_ones_place_brings_it_back(
    stack: Stack,
) -> None:
    admin = stack.manage("shell", "-c", ADMIN)
    for name in ("redis", "server", "worker"):
        stack.start(name)
    port = free_port()
    for rank in (0, 1):  # no job, no agent token: an admin's API token only
        launch(stack, rank, port, api_token=admin, job="selfmade")
    jobs = stack.wait(lambda: stack.api("/api/v1/jobs/", admin)["results"], "the job", 60)
    (job,) = [j["id"] for j in jobs if j["name"] == "selfmade"]
    details = stack.api(f"/api/v1/jobs/{job}/", admin)
    assert details["enabled_policies"] == ["restart"]
    assert details["devices"]["healthy"] + details["devices"]["unheard"] == 2
    both_training(stack, admin, job, 8)
    # node-1's host goes away (its launcher and, with it, its rank): no spare, no smaller
    # world allowed, so the job waits for a node in its place
    stack.kill("agent-node-1")
    waiting = stack.wait(
        lambda: (
            latest_recovery(stack, admin, job).get("status") == "failed"
            and stack.api(f"/api/v1/jobs/{job}/", admin)["status"] == "failed"
        ),
        "the job waiting for a replacement",
        60,
    )
    assert waiting
    before = max(s for r, s, n, _ in steps(stack, 0) if n == 0)
    replaced_at = time.monotonic()
    launch(stack, 1, port, api_token=admin, job="selfmade")  # a new host, node rank 1
    decision = stack.wait(
        lambda: (d := latest_recovery(stack, admin, job)).get("status") == "recovered" and d,
        "the recovery with the replacement",
        120,
    )
    chosen = decision["candidates"][decision["chosen"]]
    assert chosen["policy"] == "restart"
    used = {d for p in decision["plan"]["pipelines"] for s in p["stages"] for d in s["devices"]}
    assert used == {0, 1}
    # both ranks train again, in a world of two, from node-0's last checkpoint
    stack.wait(
        lambda: (
            {(r, w) for r, _, n, w in steps(stack, 0) + steps(stack, 1) if n >= 1}
            == {(0, 2), (1, 2)}
        ),
        "both ranks training after the restart",
        60,
    )
    again = [line for r in (0, 1) for line in steps(stack, r) if line[2] >= 1]
    assert min(s for _, s, _, _ in again) == before - before % 5 + 1
    timeline = stack.api(f"/api/v1/recoveries/{decision['id']}/timeline/?format=json", admin)
    started = [e for e in timeline["results"] if e["kind"] == "planning_started"]
    assert started and started[0]["payload"]["joined"] == "node-1"
    print(f"replacement: joined to recovered {time.monotonic() - replaced_at:.1f} s")


def test_a_node_that_never_joins_leaves_a_smaller_world_down_to_the_minimum(
    stack: Stack,
) -> None:
    stack.env["PITSTOP_JOIN_DEADLINE_S"] = "6"
    admin = stack.manage("shell", "-c", ADMIN)
    for name in ("redis", "server", "worker", "detector"):
        stack.start(name)
    launch(stack, 0, free_port(), api_token=admin, nnodes="1:2", job="elastic")
    # node-1 never comes: node-0's rank waits for it in its rendezvous, idle, until the join
    # deadline fails node-1 and restart_shrink restarts node-0 alone (MIN is 1 node)
    stack.wait(
        lambda: any(w == 1 and n == 1 for _, _, n, w in steps(stack, 0)),
        "node-0 training alone",
        90,
    )
    (job,) = [j["id"] for j in stack.api("/api/v1/jobs/", admin)["results"]]
    assert stack.api(f"/api/v1/jobs/{job}/", admin)["enabled_policies"] == ["restart_shrink"]
    decision = latest_recovery(stack, admin, job)
    assert decision["candidates"][decision["chosen"]]["policy"] == "restart_shrink"
    failures = stack.api(f"/api/v1/failures/?job={job}", admin)["results"]
    assert [(f["kind"], f["devices"]) for f in failures] == [("never_joined", [1])]
    assert not [line for line in steps(stack, 0) if line[2] == 0]  # it never trained before


def elastic_job(
    stack: Stack,
    *,
    hsdp: bool = False,
    mode: str = "auto",
    port: int | None = None,
    nodes: int = 2,
) -> tuple[str, int]:
    """``nodes`` launchers of examples/elastic_ddp.py (or elastic_hsdp.py) under --elastic,
    the job made by the first with an admin's token, all training: the admin's token and the
    job. ``port``: node 0's, where it hosts the job's store."""
    admin = stack.manage("shell", "-c", ADMIN)
    for name in ("redis", "server", "worker"):
        stack.start(name)
    port = port or free_port()
    for rank in range(nodes):
        launch(
            stack, rank, port, api_token=admin, job="elastic", elastic=True, hsdp=hsdp,
            approval_mode=mode, nnodes=str(nodes),
        )  # fmt: skip
    jobs = stack.wait(lambda: stack.api("/api/v1/jobs/", admin)["results"], "the job", 60)
    (job,) = [j["id"] for j in jobs]
    both_training(stack, admin, job, 8, nodes)
    # the script measured itself: the job's model is its modules, not the placeholder
    stack.wait(
        lambda: stack.api(f"/api/v1/jobs/{job}/", admin)["scenario"]["model"]["name"].endswith(
            "(measured by the script)"
        ),
        "the script's profile",
        60,
    )
    return admin, job


def ended(stack: Stack, admin: str, job: int) -> dict[str, Any]:
    """The job's latest recovery once it ended, recovered or failed."""
    return stack.wait(  # type: ignore[no-any-return]
        lambda: (
            (d := latest_recovery(stack, admin, job)).get("status") in ("recovered", "failed") and d
        ),
        "the recovery",
        90,
    )


def test_an_elastic_script_loses_a_node_and_goes_on_in_memory_on_the_other(
    stack: Stack,
) -> None:
    admin, job = elastic_job(stack)
    made = stack.api(f"/api/v1/jobs/{job}/", admin)
    assert made["enabled_policies"] == ["rerouting", "flashrecovery", "restart"]
    model = made["scenario"]["model"]  # examples/elastic_ddp.py: linear, ReLU, linear
    assert model["layers"] == 3 and model["m_p"] == [(32 * 2048 + 2048) * 4, 0, (2048 + 1) * 4]
    survivor = children_of(stack.processes["agent-node-0"].pid)
    stack.kill("agent-node-1")  # the node is gone: no restart in place, no spare
    killed_at = time.monotonic()
    decision = ended(stack, admin, job)
    recovered_s = time.monotonic() - killed_at
    assert decision["status"] == "recovered", decision
    assert decision["candidates"][decision["chosen"]]["policy"] == "rerouting"
    used = {d for p in decision["plan"]["pipelines"] for s in p["stages"] for d in s["devices"]}
    assert used == {0}
    # the control plane saw the step; the script prints its line after its sleep
    stack.wait(
        lambda: [
            s
            for _, s, w in ELASTIC_LINE.findall((stack.tmp / "node-0.out").read_text())
            if w == "1"
        ],
        "node 0's first step alone",
        30,
    )
    assert children_of(stack.processes["agent-node-0"].pid) == survivor  # never restarted
    print(f"elastic reroute: kill to recovered {recovered_s:.1f} s")


@pytest.mark.parametrize("hsdp", [False, True], ids=["ddp", "hsdp"])
def test_an_elastic_job_grows_back_onto_a_replacement_node_restored_from_its_peer(
    stack: Stack, hsdp: bool
) -> None:
    """node-1 lost: node-0 goes on alone (rerouted); a new host in node-1's place: the control
    plane decides to grow (the running plan kept, or the replica restored from peers: eq. 8
    chooses) and node-1's new process takes node-0's model, optimizer and step, in memory
    (HSDP: node-1's two ranks, a replica group, take node-0's group's shards)."""
    port = free_port()
    admin, job = elastic_job(stack, port=port, hsdp=hsdp)
    survivor = children_of(stack.processes["agent-node-0"].pid)
    stack.kill("agent-node-1")
    rerouted = ended(stack, admin, job)
    assert rerouted["candidates"][rerouted["chosen"]]["policy"] == "rerouting", rerouted

    def lines(rank: int) -> list[tuple[int, int]]:
        text = (stack.tmp / f"node-{rank}.out").read_text()
        return [(int(s), int(w)) for _, s, w in ELASTIC_LINE.findall(text)]

    alone = 2 if hsdp else 1
    stack.wait(lambda: [s for s, w in lines(0) if w == alone], "node 0 training alone", 30)
    (stack.tmp / "node-1.out").rename(stack.tmp / "node-1.before.out")
    joined_at = time.monotonic()
    launch(stack, 1, port, api_token=admin, job="elastic", elastic=True, hsdp=hsdp)
    grown = stack.wait(
        lambda: (
            (d := latest_recovery(stack, admin, job))["id"] != rerouted["id"]
            and d["status"] in ("recovered", "failed", "dismissed")
            and d
        ),
        "the decision to grow",
        120,
    )
    grown_s = time.monotonic() - joined_at
    assert grown["grows"] and grown["status"] == "recovered", grown
    chosen = grown["candidates"][grown["chosen"]]
    assert chosen["policy"] == "flashrecovery", json.dumps(grown["candidates"])
    assert grown["candidates"][0]["policy"] == "keep"
    used = {d for p in grown["plan"]["pipelines"] for s in p["stages"] for d in s["devices"]}
    assert used == ({0, 1, 2, 3} if hsdp else {0, 1})
    assert children_of(stack.processes["agent-node-0"].pid) == survivor  # never restarted
    world = 4 if hsdp else 2
    stack.wait(lambda: len([s for s, w in lines(1) if w == world]) >= 3, "node-1 training", 60)
    # the new process started at node-0's step, not at 1: its state came from its peer
    first = min(s for s, _ in lines(1))
    steps_alone = [s for s, w in lines(0) if w == alone]
    assert first > max(steps_alone), (first, steps_alone)
    assert {s for s, w in lines(0) if w == world} >= {s for s, _ in lines(1)[:3]}
    timeline = stack.api(f"/api/v1/recoveries/{grown['id']}/timeline/?format=json", admin)
    started = [e for e in timeline["results"] if e["kind"] == "planning_started"]
    assert started[0]["payload"]["joined"] == "node-1" and started[0]["payload"]["grows"]
    print(f"elastic growth onto a replacement: joined to recovered {grown_s:.1f} s")


def steps_in_world(lines: Callable[[int], list[tuple[int, int]]], world: int) -> list[int]:
    """Node 0's steps in a world of ``world``."""
    return [s for s, n in lines(0) if n == world]


def test_a_second_node_lost_before_the_replacement_and_the_replacement_grows_one_back(
    stack: Stack,
) -> None:
    """Three replicas, a node each: node-2 lost (rerouted onto two), then node-1 before any
    replacement came (rerouted onto node-0 alone), then a new host in node-1's place: the job
    grows by the one replica it can hold, restored from node-0, and node-2's share is now
    rerouted onto both."""
    port = free_port()
    admin, job = elastic_job(stack, port=port, nodes=3)
    survivor = children_of(stack.processes["agent-node-0"].pid)

    def lines(rank: int) -> list[tuple[int, int]]:
        text = (stack.tmp / f"node-{rank}.out").read_text()
        return [(int(s), int(w)) for _, s, w in ELASTIC_LINE.findall(text)]

    decided = []
    for lost, world in ((2, 2), (1, 1)):
        stack.kill(f"agent-node-{lost}")
        decision = stack.wait(
            lambda: (
                (d := latest_recovery(stack, admin, job)).get("id") not in decided
                and d.get("status") in ("recovered", "failed")
                and d
            ),
            f"the recovery from node-{lost}'s loss",
            90,
        )
        assert decision["status"] == "recovered", decision
        assert decision["candidates"][decision["chosen"]]["policy"] == "rerouting"
        decided.append(decision["id"])
        in_world = functools.partial(steps_in_world, lines, world)
        stack.wait(in_world, f"a world of {world}", 30)
    (stack.tmp / "node-1.out").rename(stack.tmp / "node-1.before.out")
    launch(stack, 1, port, api_token=admin, job="elastic", elastic=True, nnodes="3")
    grown = stack.wait(
        lambda: (
            (d := latest_recovery(stack, admin, job))["id"] not in decided
            and d["status"] in ("recovered", "failed", "dismissed")
            and d
        ),
        "the decision to grow",
        120,
    )
    assert grown["grows"] and grown["status"] == "recovered", grown
    assert grown["candidates"][grown["chosen"]]["policy"] == "flashrecovery"
    stages = [p["stages"][0] for p in grown["plan"]["pipelines"]]
    assert [(s["devices"], s.get("rerouted", False)) for s in stages] == [
        ([0], False), ([1], False), ([0, 1], True)
    ]  # fmt: skip
    assert children_of(stack.processes["agent-node-0"].pid) == survivor
    stack.wait(lambda: len([s for s, w in lines(1) if w == 2]) >= 3, "node-1 training", 60)
    first = min(s for s, _ in lines(1))
    assert first > max(s for s, w in lines(0) if w == 1)  # node-0's state, not a fresh start


def test_an_elastic_scripts_crashed_process_starts_again_with_its_peers_state(
    stack: Stack,
) -> None:
    admin, job = elastic_job(stack)

    def node_1_steps() -> list[int]:
        return [int(s) for _, s, _ in ELASTIC_LINE.findall((stack.tmp / "node-1.out").read_text())]

    survivor = children_of(stack.processes["agent-node-0"].pid)
    (victim,) = children_of(stack.processes["agent-node-1"].pid)
    os.kill(victim, signal.SIGKILL)  # the process, not its node: its device can run another
    before = max(node_1_steps())
    killed_at = time.monotonic()
    decision = ended(stack, admin, job)
    recovered_s = time.monotonic() - killed_at
    assert decision["status"] == "recovered", decision
    # the cost model's choice: every replica back (the rerouted world would be half as fast
    # until the next failure; a restart from a checkpoint would redo its steps)
    assert decision["candidates"][decision["chosen"]]["policy"] == "flashrecovery", json.dumps(
        decision["candidates"]
    )
    used = {d for p in decision["plan"]["pipelines"] for s in p["stages"] for d in s["devices"]}
    assert used == {0, 1}
    assert children_of(stack.processes["agent-node-0"].pid) == survivor
    (again,) = children_of(stack.processes["agent-node-1"].pid)
    assert again != victim
    stack.wait(lambda: max(node_1_steps()) > before + 3, "node-1 training again", 30)
    # the new process went on from its peer's step: no step again from 1 (the killed process
    # may have died between its last step and that step's line: one line may be missing)
    steps = node_1_steps()
    assert steps == sorted(set(steps)), steps
    first = min(s for s in steps if s > before)
    assert first in (before + 1, before + 2), (before, steps)
    print(f"elastic restore from peers: kill to recovered {recovered_s:.1f} s")


def test_an_hsdp_scripts_crashed_rank_brings_its_group_back_from_the_other_groups_shards(
    stack: Stack,
) -> None:
    """examples/elastic_hsdp.py, a replica group of two processes a node, the job in manual
    mode: device 3 killed, the operator applies `flashrecovery` (approving the proposal, or
    overriding it where the cost model, on this loaded machine's measurement, proposed the
    reroute); the group comes back in place (the launcher starts device 3 again, device 2
    starts itself again on its link), restored from group 0's shards; node 0 is never
    restarted."""
    admin, job = elastic_job(stack, hsdp=True, mode="manual")
    survivors = set(children_of(stack.processes["agent-node-0"].pid))

    def node_1_steps() -> list[int]:
        return [int(s) for _, s, _ in ELASTIC_LINE.findall((stack.tmp / "node-1.out").read_text())]

    node_1 = ranks_of(stack.processes["agent-node-1"])
    victim, peer = node_1[3], node_1[2]
    os.kill(victim, signal.SIGKILL)
    before = max(node_1_steps())
    killed_at = time.monotonic()
    proposed = stack.wait(
        lambda: (d := latest_recovery(stack, admin, job)).get("status") == "proposed" and d,
        "the proposal",
        60,
    )
    policies = [c["policy"] if c["feasible"] else None for c in proposed["candidates"]]
    restore = policies.index("flashrecovery")
    body: dict[str, Any] = {"reason": "the group back"}
    verb = "approve" if proposed["chosen"] == restore else "override"
    if verb == "override":
        body["candidate"] = restore
    status, said = stack.post(f"/api/v1/recoveries/{proposed['id']}/{verb}/", admin, body)
    assert status == 200, said
    decision = ended(stack, admin, job)
    recovered_s = time.monotonic() - killed_at
    assert decision["status"] == "recovered", decision
    assert decision["candidates"][decision["chosen"]]["policy"] == "flashrecovery"
    groups = sorted(s["devices"] for p in decision["plan"]["pipelines"] for s in p["stages"])
    assert groups == [[0, 1], [2, 3]]
    assert set(children_of(stack.processes["agent-node-0"].pid)) == survivors
    again = ranks_of(stack.processes["agent-node-1"])
    assert again[2] == peer and again[3] != victim  # the peer started itself again in place
    stack.wait(lambda: max(node_1_steps()) > before + 3, "node-1 training again", 30)
    steps = [s for s in node_1_steps() if s > before]
    assert min(steps) in (before + 1, before + 2), (before, steps)
    print(f"hsdp group back from peers: kill to recovered {recovered_s:.1f} s")
