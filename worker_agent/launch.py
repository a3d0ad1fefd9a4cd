"""Any torchrun script under Pitstop: ``python -m worker_agent launch`` in torchrun's place.

    python -m worker_agent launch --nnodes 2 --nproc-per-node 4 --node-rank 0 \\
        --master-addr 10.0.0.1 --master-port 29500 \\
        --server ws://CONTROL:8000 --job NAME    train.py --its --own --flags

It takes torchrun's own command line (its parser, ``torch.distributed.run.get_args_parser``,
so every flag and ``PET_*`` variable torchrun knows is accepted) plus the control plane's
address, the job's name and one agent token for the whole job (``--server``, ``--job``,
``--token`` or ``PITSTOP_SERVER``, ``PITSTOP_JOB``, ``PITSTOP_AGENT_TOKEN``), and runs the
script's processes under the agent (``worker_agent/agent.py``): each with the environment
torchrun gives it (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``,
``GROUP_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``, ``TORCHELASTIC_RESTART_COUNT``, ...), so a
script that runs under torchrun runs under this unchanged, and the node reports heartbeats,
crashes and its goodbye to the control plane like any agent.

The node is ``node-<node rank>`` (or ``--node-name``) and holds the global devices
``node_rank × nproc_per_node`` onward, one per process: device ids are the global ranks, given
by no one. ``--standalone`` is one node on this host, its master on 127.0.0.1 and a free port.

With an admin's API token instead of an agent token (``--api-token``, ``PITSTOP_API_TOKEN``)
the job need not exist: every node asks the control plane for it (``POST /api/v1/jobs/launch/``)
and gets an agent token of its own; the first creates it from the command line
(``job_scenario``: ``--nnodes`` × ``--nproc-per-node`` devices, one data-parallel replica a
process, the ``restart`` policy, or ``restart_shrink`` down to ``MIN`` nodes for
``--nnodes MIN:MAX``). A node that joins in a lost one's place (its node rank) takes it: the
control plane restarts the job with it when no policy could go on without it.

Why not torchrun's own elastic agent, with a Pitstop rendezvous backend: that agent restarts a
node's workers by itself on any local failure (``--max-restarts``) and forms the next world
from whichever nodes reach the rendezvous, whereas under Pitstop the control plane decides
(``decide()``, an operator's approval) whether, when and on which nodes the job goes on, and
the agent already supervises the processes, watches for hangs and speaks to the control plane.
torchrun's parser and its environment are what a script sees, and those are kept exactly.

The launcher exits like torchrun: 0 when every process exited 0; 1 once every process has
exited, one of them failed, and ``--max-restarts`` restarts have been made (with torchrun's
default, 0, at the first failure). Before that limit a failure waits for the control plane: it
decides with the same ``decide()`` as for any job (restart on the surviving devices, wait for a
spare or a replacement node, or an operator's choice) and sends an ``apply_plan``, which this
launcher carries out as a coordinated restart (``Launcher``).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import os
import shutil
import socket
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from worker_agent import protocol
from worker_agent.agent import Agent, Settings, check_plan
from worker_agent.connection import server_url

log = logging.getLogger("worker_agent.launch")


@dataclass(frozen=True)
class World:
    """This node's place in a job launched torchrun's way (static rendezvous)."""

    nnodes: int
    nproc_per_node: int
    node_rank: int
    master_addr: str
    master_port: int
    run_id: str
    max_restarts: int
    signals_to_handle: str
    error_dir: str  # each process's TORCHELASTIC_ERROR_FILE is under it
    restart_count: int = 0

    members: tuple[int, ...] = ()  # after a restart: the devices of the world, else all
    elastic: bool = False  # the script recovers in memory (worker_agent.elastic): --elastic
    replica_size: int = 1  # devices a data-parallel replica (an HSDP replica group)

    @property
    def everyone(self) -> tuple[int, ...]:
        """The world's devices, in rank order (a device's global rank is its index)."""
        return self.members or tuple(range(self.nnodes * self.nproc_per_node))

    @property
    def world_size(self) -> int:
        return len(self.everyone)

    @property
    def devices(self) -> list[int]:
        """This node's devices, the global ranks it started with."""
        first = self.node_rank * self.nproc_per_node
        return list(range(first, first + self.nproc_per_node))

    def restarted(self, members: list[int], restart_count: int) -> World:
        """The world of a coordinated restart: ``members`` (devices), ranks in their order."""
        return dataclasses.replace(
            self, members=tuple(sorted(members)), restart_count=restart_count
        )

    def error_file(self, device: int) -> Path:
        """Where ``torch.distributed.elastic``'s ``@record`` writes the process's uncaught
        exception: ``<error_dir>/attempt_<restart>/<local rank>/error.json``, as torchrun's."""
        local = device - self.node_rank * self.nproc_per_node
        return Path(self.error_dir) / f"attempt_{self.restart_count}" / str(local) / "error.json"

    def exit_detail(self, device: int) -> str | None:
        """The exception the process's ``@record`` wrote to its error file, if it did."""
        try:
            message = json.loads(self.error_file(device).read_text())["message"]
        except (OSError, ValueError, KeyError, TypeError):
            return None
        text = message.get("message") if isinstance(message, dict) else message
        return str(text)[:500] if text else None

    def environment(self, device: int) -> dict[str, str]:
        """What torchrun's elastic agent puts in the environment of the process of global rank
        ``device`` (``LocalElasticAgent._start_workers``), with one role, ``default``."""
        error_file = self.error_file(device)
        error_file.parent.mkdir(parents=True, exist_ok=True)  # @record writes only the file
        everyone = self.everyone
        here = [d for d in everyone if d in self.devices]
        # nodes are blocks of nproc_per_node devices; a node's group rank is its place among
        # the world's nodes
        nodes = sorted({d // self.nproc_per_node for d in everyone})
        rank = everyone.index(device)
        env = {
            "RANK": str(rank),
            "LOCAL_RANK": str(here.index(device)),
            "GROUP_RANK": str(nodes.index(self.node_rank)),
            "ROLE_RANK": str(rank),
            "ROLE_NAME": "default",
            "LOCAL_WORLD_SIZE": str(len(here)),
            "WORLD_SIZE": str(len(everyone)),
            "GROUP_WORLD_SIZE": str(len(nodes)),
            "ROLE_WORLD_SIZE": str(len(everyone)),
            "MASTER_ADDR": self.master_addr,
            "MASTER_PORT": str(self.master_port),
            "TORCHELASTIC_RESTART_COUNT": str(self.restart_count),
            "TORCHELASTIC_MAX_RESTARTS": str(self.max_restarts),
            "TORCHELASTIC_RUN_ID": self.run_id,
            # rank 0 hosts the store at MASTER_PORT, as under a static rendezvous; with
            # --elastic node 0's launcher does, and keeps it through a rank's loss
            "TORCHELASTIC_USE_AGENT_STORE": str(self.elastic),
            "TORCH_NCCL_ASYNC_ERROR_HANDLING": os.environ.get(
                "TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"
            ),
            "TORCHELASTIC_ERROR_FILE": str(error_file),
            # torchrun's own environment, which its processes inherit
            "TORCHELASTIC_SIGNALS_TO_HANDLE": self.signals_to_handle,
            # Pitstop's: the world's devices in rank order (worker_agent.elastic reads them)
            "PITSTOP_MEMBERS": ",".join(map(str, everyone)),
            "PITSTOP_REPLICA_SIZE": str(self.replica_size),
        }
        if self.nproc_per_node > 1 and "OMP_NUM_THREADS" not in os.environ:
            env["OMP_NUM_THREADS"] = "1"  # torchrun's default for several processes a node
        return env


STEP_HOOK = Path(__file__).resolve().parent / "stephook"


class Launcher(Agent):
    """The agent in torchrun's place: its ranks are the script's processes, in ``world``.

    An ``apply_plan`` is a coordinated restart: every process of this node is stopped (SIGTERM,
    SIGKILL after the grace), and the node's devices in the plan are started again in the plan's
    world (its devices, ranked in order; ``TORCHELASTIC_RESTART_COUNT`` one more), so the script
    resumes from its own checkpoint as under torchrun. A device the plan leaves out stays idle.
    The restart is acknowledged once the processes run; their first step (the step hook's)
    shows on the heartbeats.
    """

    def __init__(self, settings: Settings, world: World) -> None:
        self.world = world
        self.restarting: set[str] = set()  # apply_plan commands being carried out
        self.started_for: set[str] = set()  # --elastic: plans whose dead devices were started
        self._one_at_a_time = asyncio.Lock()  # restarts never overlap
        super().__init__(
            dataclasses.replace(
                settings, environment=self._environment, exit_detail=self._exit_detail
            )
        )

    async def _first_devices(self) -> list[int]:
        """--elastic: none when the job's first world is over (this node joins a job that went
        on without it: a replacement): its ranks start with the control plane's plan, in its
        generation (``on_command``), not in a world whose store keys dead processes wrote."""
        store = self.store if self.world.elastic and not self.settings.serve_store else None
        if store is not None and await store.over(self.generation):
            log.info("the job's first world is over: this node's ranks wait for a plan")
            return []
        return await super()._first_devices()

    def _environment(self, device: int) -> dict[str, str]:
        env = self.world.environment(device)
        path = os.environ.get("PYTHONPATH")
        env["PYTHONPATH"] = os.pathsep.join([str(STEP_HOOK), *([path] if path else [])])
        env["PITSTOP_STEP_HOOK"] = str(os.getpid())
        return env

    def _exit_detail(self, device: int) -> str | None:
        return self.world.exit_detail(device)

    def _ends_when_all_exited(self) -> bool:
        # torchrun's limit: past --max-restarts a failure ends the launcher (with 1); before,
        # the processes wait for the control plane's coordinated restart
        return self.world.restart_count >= self.world.max_restarts

    def _refusal(self, command: protocol.Command) -> protocol.Error | None:
        if command.action is protocol.Action.APPLY_PLAN:
            # every process restarts: a dead one is no reason to refuse
            return check_plan(command, set(self.settings.devices), set(), self.settings.layers)
        return super()._refusal(command)

    def _restarts_for(self, command: protocol.Command) -> bool:
        """Whether ``command`` is a coordinated restart: every ``apply_plan`` of an unmodified
        script; with ``--elastic`` only one that restores from a checkpoint (the others go to
        the ranks, which join the new world in memory)."""
        if command.action is not protocol.Action.APPLY_PLAN:
            return False
        return not self.world.elastic or command.restore is protocol.RestoreMode.CHECKPOINT

    async def on_command(self, command: protocol.Command) -> None:
        await super().on_command(command)
        if self._restarts_for(command) or command.action is not protocol.Action.APPLY_PLAN:
            return
        # --elastic, in memory: the running processes had the plan; one of this node's devices
        # in it whose process is gone (it crashed) starts again in the plan's generation and
        # takes its state from a live replica as it joins (worker_agent.elastic)
        if command.id in self.started_for or self._refusal(command) is not None:
            return  # sent again (done once already), or refused
        self.started_for.add(command.id)
        members = sorted(protocol.plan_devices(command.plan))
        self.world = dataclasses.replace(self.world, members=tuple(members))
        for device in self.settings.devices:
            rank = self.ranks.get(device)
            if device in members and (rank is None or not rank.alive):
                await self._start_rank(device)
                log.info("device %d: started again in %s from its peers", device, self.generation)

    async def _carried_out_here(self, command: protocol.Command) -> bool:
        if not self._restarts_for(command):
            return False
        if command.id in self.restarting:
            return True  # sent again while under way: acknowledged when done
        self.restarting.add(command.id)
        try:
            async with self._one_at_a_time:
                await self._restart(command)
        finally:
            self.restarting.discard(command.id)
        ack = protocol.Ack(command=command.id, ok=True, at=time.time())
        self.outcomes[command.id] = ack
        self.uplink.ack(ack)
        return True

    async def _restart(self, command: protocol.Command) -> None:
        members = sorted(protocol.plan_devices(command.plan))
        if command.decision is not None:
            self.generation = f"d{command.decision}/"
        self.plan_devices = set(members)
        began = time.monotonic()
        for rank in self.ranks.values():
            rank.exit_expected = True
        self.stopping = True  # their exits are no faults, nor the end of the job
        try:
            await self._stop_ranks()
        finally:
            self.stopping = False
        for rank in self.ranks.values():
            rank.gone = rank.gone or "stopped"
        self.ranks.clear()
        self.world = self.world.restarted(members, self.world.restart_count + 1)
        mine = [d for d in self.settings.devices if d in self.plan_devices]
        for device in mine:
            await self._start_rank(device)
        log.info(
            "restart %d (command %s): devices %s of a world of %d started again in %.2f s",
            self.world.restart_count,
            command.id,
            mine,
            self.world.world_size,
            time.monotonic() - began,
        )


def parser() -> argparse.ArgumentParser:
    from torch.distributed.run import get_args_parser

    p = get_args_parser()
    p.prog = "python -m worker_agent launch"
    p.description = __doc__.split("\n\n")[0] + " torchrun's flags, then Pitstop's:"
    env = os.environ.get
    pitstop = p.add_argument_group("Pitstop", "the control plane this node reports to")
    pitstop.add_argument(
        "--server",
        default=env("PITSTOP_SERVER", "ws://127.0.0.1:8000"),
        help="the control plane's address, ws://HOST:PORT (PITSTOP_SERVER)",
    )
    pitstop.add_argument("--job", default=env("PITSTOP_JOB"), help="the job's name (PITSTOP_JOB)")
    pitstop.add_argument(
        "--token",
        default=env("PITSTOP_AGENT_TOKEN"),
        help="the job's agent token, one for every node (PITSTOP_AGENT_TOKEN)",
    )
    pitstop.add_argument(
        "--api-token",
        default=env("PITSTOP_API_TOKEN"),
        help="instead of --token: an admin's API token; the job is created from this command"
        " line by the first node that asks, and each node gets an agent token of its own"
        " (PITSTOP_API_TOKEN)",
    )
    pitstop.add_argument(
        "--approval-mode",
        default=env("PITSTOP_APPROVAL_MODE", "auto"),
        choices=("auto", "manual", "manual_with_timeout"),
        help="with --api-token, for a job this launch creates: apply a recovery at once, or"
        " wait for an operator (PITSTOP_APPROVAL_MODE; default auto)",
    )
    pitstop.add_argument(
        "--elastic",
        action="store_true",
        default=env("PITSTOP_ELASTIC", "") not in ("", "0"),
        help="the script recovers in memory (worker_agent.elastic): node 0's launcher hosts the"
        " job's store, and a plan that needs no checkpoint goes to the processes rather than"
        " restarting them (PITSTOP_ELASTIC=1)",
    )
    pitstop.add_argument(
        "--replica-size",
        type=int,
        default=int(env("PITSTOP_REPLICA_SIZE", "1")),
        metavar="N",
        help="devices a data-parallel replica, consecutive ranks of one node (an HSDP replica"
        " group: worker_agent.elastic.HybridSharded's shard_size); a failure takes its whole"
        " replica out (PITSTOP_REPLICA_SIZE; default 1)",
    )
    pitstop.add_argument(
        "--node-name",
        default=env("PITSTOP_NODE"),
        help="this node's name in the job (PITSTOP_NODE; default node-<node rank>)",
    )
    return p


# torchrun's flags the launcher does not honour, with their defaults: a value other than the
# default is named in a warning (logs, redirects and NUMA binding are left to the script's
# environment; the rendezvous is static, ranks by node rank).
IGNORED = {
    "log_dir": None,
    "redirects": "0",
    "tee": "0",
    "local_ranks_filter": "",
    "role": "default",
    "rdzv_conf": "",
    "numa_binding": None,
    "virtual_local_rank": False,
    "local_addr": None,
}


def _world(p: argparse.ArgumentParser, args: argparse.Namespace) -> World:
    from torch.distributed.run import determine_local_world_size, parse_min_max_nnodes

    try:
        _, nnodes = parse_min_max_nnodes(args.nnodes)
        nproc = determine_local_world_size(args.nproc_per_node)
    except (RuntimeError, ValueError) as exc:
        p.error(str(exc))
    if nnodes < 1 or nproc < 1 or not 0 <= args.node_rank < nnodes:
        p.error(f"--node-rank {args.node_rank}: expected 0..{nnodes - 1}, with --nnodes ≥ 1")
    if args.max_restarts < 0:
        p.error("--max-restarts must be ≥ 0")
    if args.replica_size < 1 or nproc % args.replica_size:
        p.error(
            f"--replica-size {args.replica_size}: expected a divisor of --nproc-per-node {nproc}"
            " (a replica's devices are on one node)"
        )
    if args.standalone and nnodes != 1:
        p.error("--standalone is one node: --nnodes 1")
    # torchrun's: one node with no port given is standalone; more nodes meet at 29500
    if args.standalone or (nnodes == 1 and not args.rdzv_endpoint and args.master_port is None):
        with socket.socket() as probe:  # a free port, as torchrun's standalone store takes
            probe.bind(("127.0.0.1", 0))
            addr, port = "127.0.0.1", int(probe.getsockname()[1])
    elif args.rdzv_endpoint:
        addr, _, given = args.rdzv_endpoint.rpartition(":")
        if not addr or not given.isdigit():
            p.error(f"--rdzv-endpoint: expected HOST:PORT, got {args.rdzv_endpoint!r}")
        port = int(given)
    else:
        addr, port = args.master_addr, int(args.master_port or 29500)
    run_id = args.rdzv_id if args.rdzv_id != "none" else str(uuid.uuid4())
    errors = tempfile.mkdtemp(prefix=f"pitstop-run-{run_id}-")
    return World(
        nnodes,
        nproc,
        args.node_rank,
        addr,
        port,
        run_id,
        args.max_restarts,
        args.signals_to_handle,
        errors,
        elastic=args.elastic,
        replica_size=args.replica_size,
    )


def _command(p: argparse.ArgumentParser, args: argparse.Namespace) -> list[str]:
    """The command torchrun would run for each process (``config_from_args``)."""
    if args.no_python:
        if args.module:
            p.error("--no-python and --module together: choose one")
        return [args.training_script, *args.training_script_args]
    python = os.environ.get("PYTHON_EXEC", sys.executable)
    module = ["-m"] if args.module else []
    return [python, "-u", *module, args.training_script, *args.training_script_args]


def _shutdown_timeout(args: argparse.Namespace) -> float:
    """torchrun's: ``--shutdown-timeout``, else TORCH_ELASTIC_SHUTDOWN_TIMEOUT, else 30 s."""
    if args.shutdown_timeout is not None:
        return float(args.shutdown_timeout)
    return float(os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "30"))


def job_scenario(world: World, min_nodes: int, script: str) -> dict[str, Any]:
    """The scenario of a job a launcher creates (docs/scenario.md): ``nnodes`` × ``nproc``
    devices, ``nproc`` a node, one data-parallel replica a process (as DDP runs), each a
    pipeline of one stage (of ``--replica-size`` devices: an HSDP replica group); the
    ``restart`` policy, or ``restart_shrink`` down to ``min_nodes``
    nodes, and with ``--elastic`` ``rerouting`` (the survivors take the lost replicas'
    micro-batches, in memory) and ``flashrecovery`` on the same devices (a crashed process
    starts again where it ran and takes a live replica's state) first. The model is not
    measured: its profile is a placeholder of one layer, enough for the restart policy, whose
    choice (in place, on spares, smaller) does not depend on it."""
    devices = world.nnodes * world.nproc_per_node
    size = world.replica_size
    stage = {"layers": [0, 1]}
    policies: dict[str, dict[str, Any]] = {"restart": {}}
    if min_nodes < world.nnodes:
        replicas = min_nodes * world.nproc_per_node // size
        policies = {"restart_shrink": {"min_replicas": replicas}}
    if world.elastic:
        # in memory: a lost replica's share to the others, or a crashed process started again
        # where it ran with a live replica's state (its start's seconds, not the paper's 85)
        in_place = {"same_devices": True, "restart_s": ELASTIC_START_S}
        policies = {"rerouting": {}, "flashrecovery": in_place, **policies}
    return {
        "model": {
            "name": f"{Path(script).name} (not profiled)",
            "layers": 1,
            "fwd_s": 0.01,
            "bwd_s": 0.02,
            "m_p": 1.0,
            "m_o": 0.0,
            "m_g": 1.0,
            "m_a": 1.0,
        },
        "cluster": {
            "devices": devices,
            "devices_per_node": world.nproc_per_node,
            "device_memory_bytes": 8e10,
            "intra_node_gbps": 100,
            "inter_node_gbps": 10,
            "failure_rate_per_device_hour": 0.001,
        },
        "training": {"global_batch": devices // size, "micro_batch": 1},
        "plan": {
            "pipelines": [
                {"stages": [{"devices": list(range(d, d + size)), **stage}], "micro_batches": 1}
                for d in range(0, devices, size)
            ]
        },
        "policies": policies,
    }


# A process of an elastic script started again to its first step, about: Python and torch
# imported, the generation joined, the state received (2 to 3 s on the 2-core machine).
ELASTIC_START_S = 3.0


class LaunchRefused(Exception):
    """The control plane refused this node's job (the message says why), or was not reached."""


def ask_for_job(
    server: str,
    api_token: str,
    name: str,
    scenario: dict[str, Any],
    *,
    approval_mode: str = "auto",
    patience_s: float = 60.0,
) -> tuple[str, bool]:
    """This node's agent token for the job ``name`` and whether this call created the job
    (``POST /api/v1/jobs/launch/`` with an admin's API token), trying again while the control
    plane cannot be reached or asks to wait (429), for ``patience_s`` at most."""
    url = urlsplit(server)
    endpoint = f"{'https' if url.scheme == 'wss' else 'http'}://{url.netloc}/api/v1/jobs/launch/"
    body = {
        "name": name,
        "scenario": scenario,
        "enabled_policies": list(scenario["policies"]),
        "approval_mode": approval_mode,
    }
    request = urllib.request.Request(
        endpoint,
        data=json.dumps(body).encode(),
        headers={"Authorization": f"Token {api_token}", "Content-Type": "application/json"},
    )
    deadline = time.monotonic() + patience_s
    while True:
        wait_s = 1.0
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                answer = json.load(response)
            return str(answer["agent_token"]), bool(answer["created"])
        except urllib.error.HTTPError as exc:
            try:
                error = json.loads(exc.read())
            except ValueError:
                error = {}
            if exc.code != 429:
                field = f" ({error['field']})" if error.get("field") else ""
                said = error.get("message") or exc.reason
                raise LaunchRefused(
                    f"{endpoint} refused job {name!r}: {exc.code} {said}{field}"
                ) from None
            wait_s = float(exc.headers.get("Retry-After") or 1)
            why = "throttled"
        except (urllib.error.URLError, OSError, ValueError) as exc:
            why = str(getattr(exc, "reason", exc))
        if time.monotonic() + wait_s > deadline:
            raise LaunchRefused(f"{endpoint}: no answer in {patience_s:.0f} s (last: {why})")
        log.warning("asking for job %s: %s; again in %.0f s", name, why, wait_s)
        time.sleep(wait_s)


def settings_from(argv: Sequence[str] | None) -> tuple[Settings, World]:
    from torch.distributed.run import parse_min_max_nnodes

    p = parser()
    args = p.parse_args(argv)
    for name, default in IGNORED.items():
        if getattr(args, name, default) not in (default, None):
            log.warning("--%s is torchrun's and is not honoured here", name.replace("_", "-"))
    world = _world(p, args)
    if not args.job or not (args.token or args.api_token):
        p.error(
            "--job and --token (or --api-token) are needed"
            " (or PITSTOP_JOB and PITSTOP_AGENT_TOKEN or PITSTOP_API_TOKEN)"
        )
    server_url(p, args.server)
    if len(world.devices) > protocol.MAX_DEVICES:  # before a job is made from these flags
        p.error(f"--nproc-per-node: at most {protocol.MAX_DEVICES}")
    token = args.token
    if token is None:
        min_nodes, _ = parse_min_max_nnodes(args.nnodes)
        scenario = job_scenario(world, min_nodes, args.training_script)
        try:
            token, created = ask_for_job(
                args.server, args.api_token, args.job, scenario, approval_mode=args.approval_mode
            )
        except LaunchRefused as exc:
            p.exit(2, f"{p.prog}: {exc}\n")
        log.info("job %s %s", args.job, "created" if created else "joined")
    settings = Settings(
        server=args.server,
        job=args.job,
        node=args.node_name or f"node-{world.node_rank}",
        token=token,
        devices=world.devices,
        command=_command(p, args),
        grace_s=_shutdown_timeout(args),
        control=False,
        template=False,  # the script's arguments are its own: nothing in them is replaced
        environment=world.environment,
        # --elastic: node 0 hosts the job's store at the master's address, which the ranks
        # and every node's abort use (the ranks' generations live in it)
        store=f"{world.master_addr}:{world.master_port}" if world.elastic else None,
        serve_store=world.elastic and world.node_rank == 0,
    )
    return settings, world


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    settings, world = settings_from(argv)
    log.info(
        "node %s: ranks %s of %d, master %s:%d",
        settings.node,
        world.devices,
        world.world_size,
        world.master_addr,
        world.master_port,
    )
    try:
        return asyncio.run(Launcher(settings, world).run())
    finally:
        shutil.rmtree(world.error_dir, ignore_errors=True)
