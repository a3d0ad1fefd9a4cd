"""``./dev demo``: the whole stack on this machine, training for real, with a failure a minute.

    python -m controlplane.demo [--port 8000] [--data-dir var] [--every 60] [--scale N]
        [--seconds S] [--no-faults]

It migrates the database, starts the ASGI server (Daphne, which starts the embedded Redis of
the data directory), a Celery worker and the failure detector, creates the admin ``demo`` with a
generated password (kept in ``DATA_DIR/demo_password``), and two jobs of the reference model
(8 layers, ``examples/reference-trainer-pp4-dp2.json``, PP4 × DP2 on 8 devices, 2 per node):

- ``demo-auto`` (approval ``auto``): the reference trainer for real, 8 CPU ranks over 4 agents
  (``python -m worker_agent run``, 2 devices each; node-0's agent hosts the job's TCPStore);
- ``demo-manual`` (approval ``manual``): 4 simulated nodes (``python -m worker_agent
  simulate``), so that its proposals wait for an operator in the dashboard without 8 more
  torch processes on the machine's cores;

and, with ``--scale N``, ``demo-scale``: N simulated nodes of 8 devices (auto, no faults).

Every ``--every`` seconds it injects a failure, in turn: ``demo-auto`` loses node-3 (its agent
SIGKILLed: the node's ranks die with it), ``demo-auto`` has a rank SIGKILLed (crash),
``demo-manual`` loses a simulated node, ``demo-auto`` has a rank SIGSTOPped (hang); the crash
and the hang are drills sent through the control plane (``POST /api/v1/jobs/{id}/drills/``), as
an operator would. The devices chosen keep a live holder for every layer. After the round the
two jobs start afresh with all their devices, and get an interval to start before the next
round's first failure, which also waits for ``demo-auto``'s first step. It prints one line per
event and a status line every ``--status`` seconds; the processes' own logs are in
``DATA_DIR/demo-logs/``. Ctrl-C or SIGTERM stops everything it started (agents first, the
server and its Redis last) and leaves nothing running.
Everything listens on 127.0.0.1.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import datetime as dt
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SCENARIO = ROOT / "examples" / "reference-trainer-pp4-dp2.json"
LARGE = ROOT / "examples" / "llama2-7b-pp4-dp2-tp1.json"  # the model of --scale's job
POLICIES = ["rerouting", "dynamic", "odyssey"]
# the rank's trainer command; {device} is the agent's
TRAINER = [sys.executable, "-m", "worker_agent.trainer", "rank", "--plan"]
# a hang is a rank without a step for 10 median step times and at least this long
HANG_FLOOR_S = 3.0
# ... and before a rank's first step, at least this long: 8 ranks importing torch and forming
# their groups on two busy cores took more than 3 s, and every round began with false hangs
FIRST_STEP_FLOOR_S = 30.0
STOP_GRACE_S = 15.0

SETUP = """
import json
import sys
from django.contrib.auth.models import User
from rest_framework.authtoken.models import Token
from controlplane.jobs.models import Job
from controlplane.jobs.services import create_job
spec = json.load(sys.stdin)
user, _ = User.objects.get_or_create(username=spec["user"])
user.is_staff = user.is_superuser = True
# a new hash would end every session of the user: the demo would log everyone out each round
if not user.check_password(spec["password"]):
    user.set_password(spec["password"])
user.save()
made = {}
for job in spec["jobs"]:
    for old in Job.objects.filter(name=job["name"]):  # an earlier run's: kept, renamed
        old.name = f"{old.name}-{old.pk}"
        old.save(update_fields=["name"])
    row, token = create_job(job["name"], job["scenario"], approval_mode=job["mode"],
                            enabled_policies=job["policies"])
    made[job["name"]] = {"id": row.pk, "token": token}
key, _ = Token.objects.get_or_create(user=user)
print(json.dumps({"jobs": made, "api_token": key.key}))
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def listening(port: int) -> bool:
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) == 0


def children_of(pid: int) -> list[int]:
    """The processes whose parent is ``pid``, from /proc."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError, ValueError):
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(stat.parent.name))
    return found


class Stopped(Exception):
    """SIGTERM or SIGINT arrived: stop everything."""


@dataclass
class Processes:
    """Named child processes with their output in ``logs/NAME.log``; stopped in reverse order."""

    logs: Path
    env: dict[str, str]
    running: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    def start(
        self, name: str, command: Sequence[str], extra_env: dict[str, str] | None = None
    ) -> subprocess.Popen[bytes]:
        """Start ``command`` as ``name``, with ``extra_env`` added to the environment: a secret
        such as an agent token goes there, never on a command line that ``ps`` shows."""
        with (self.logs / f"{name}.log").open("ab") as log:
            process = subprocess.Popen(
                list(command),
                cwd=ROOT,
                env={**self.env, **(extra_env or {})},
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # the terminal's Ctrl-C reaches the demo only
            )
        self.running[name] = process
        return process

    def died(self) -> list[str]:
        return [name for name, p in self.running.items() if p.poll() is not None]

    def post_mortem(self, names: Sequence[str], lines: int = 8) -> str:
        """Each of ``names``' exit status and the end of its log, for an error message."""
        parts = []
        for name in names:
            process = self.running.get(name)
            status = "running" if process is None else f"exit status {process.poll()}"
            try:
                tail = (self.logs / f"{name}.log").read_text(errors="replace").splitlines()
            except OSError:
                tail = []
            parts.append(f"--- {name} ({status}), the end of its log:")
            parts.extend(f"    {line}" for line in tail[-lines:])
        return "\n".join(parts)

    def stop(self, name: str, sig: signal.Signals = signal.SIGTERM) -> None:
        process = self.running.pop(name, None)
        if process is None:
            return
        if process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(sig)
        try:
            process.wait(timeout=STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=10)

    def stop_together(self, names: Sequence[str]) -> None:
        """SIGTERM every one of ``names`` at once, then wait for each (SIGKILL after a grace)."""
        for name in names:
            process = self.running.get(name)
            if process is not None and process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    process.send_signal(signal.SIGTERM)
        for name in names:
            self.stop(name)

    def stop_all(self, last: Sequence[str] = ()) -> None:
        """SIGTERM everyone (``last`` after the others), each waited for, then SIGKILL."""
        self.stop_together([n for n in reversed(list(self.running)) if n not in last])
        for name in last:
            self.stop(name, signal.SIGINT)


@dataclass
class ControlPlane:
    """The server, a Celery worker and the detector on the data directory's embedded defaults
    (or DATABASE_URL / REDIS_URL when set); the REST API with the demo user's token."""

    data: Path
    port: int
    processes: Processes
    token: str = ""

    def manage(self, *args: str, timeout: float = 300, stdin: str = "") -> str:
        done = subprocess.run(
            [sys.executable, "manage.py", *args],
            cwd=ROOT,
            env=self.processes.env,
            input=stdin,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if done.returncode != 0:
            raise RuntimeError(f"manage.py {args[0]} failed:\n{done.stdout}{done.stderr}")
        return done.stdout

    def start(self) -> None:
        self.manage("migrate", "--noinput", "-v", "0")
        self.processes.start(
            "server",
            [sys.executable, "-m", "daphne", "-b", "127.0.0.1", "-p", str(self.port),
             "controlplane.asgi:application"],
        )  # fmt: skip
        wait_for(lambda: self.healthy(), "the server's /healthz", 90, self.processes)
        self.processes.start(
            "worker",
            [sys.executable, "-m", "celery", "-A", "controlplane", "worker", "--pool", "solo",
             "--without-gossip", "--without-mingle", "--without-heartbeat", "-l", "info"],
        )  # fmt: skip
        self.processes.start("detector", [sys.executable, "manage.py", "detect_failures"])

    def healthy(self) -> bool:
        with urllib.request.urlopen(f"{self.url}/healthz", timeout=5) as response:
            return bool(json.loads(response.read()).get("status") == "ok")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def api(self, path: str, body: dict[str, Any] | None = None, *, raw: bool = False) -> Any:
        request = urllib.request.Request(
            f"{self.url}{path}",
            data=None if body is None else json.dumps(body).encode(),
            headers={"Authorization": f"Token {self.token}", "Content-Type": "application/json"},
            method="GET" if body is None else "POST",
        )
        with urllib.request.urlopen(request, timeout=15) as response:
            text = response.read()
            return text.decode() if raw else json.loads(text)

    def setup(self, user: str, password: str, jobs: list[dict[str, Any]]) -> dict[str, Any]:
        # on stdin: a scenario of thousands of nodes is longer than a command line may be
        spec = json.dumps({"user": user, "password": password, "jobs": jobs})
        out = self.manage("shell", "-c", SETUP, stdin=spec)
        made: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
        self.token = made["api_token"]
        return made


def wait_for(
    check: Callable[[], Any],
    what: str,
    timeout: float,
    processes: Processes | None = None,
    *,
    interval: float = 0.2,
) -> Any:
    """``check()``'s first true answer, asked every ``interval`` seconds; TimeoutError after
    ``timeout``, RuntimeError when one of ``processes`` died meanwhile."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if processes is not None and (dead := processes.died()):
            raise RuntimeError(
                f"{', '.join(dead)} exited; see {processes.logs}\n{processes.post_mortem(dead)}"
            )
        with contextlib.suppress(OSError, ValueError, urllib.error.URLError):
            found = check()
            if found:
                return found
        time.sleep(interval)
    raise TimeoutError(f"no {what} within {timeout:g} s")


@dataclass
class TrainerJob:
    """A job of the reference trainer: one agent per node over 127.0.0.1, node-0 hosting the
    job's TCPStore."""

    name: str
    id: int
    token: str
    scenario: Path
    nodes: dict[str, list[int]]
    plane: ControlPlane
    agent_options: tuple[str, ...] = ()
    trainer_options: tuple[str, ...] = ()  # after the rank command's ``--plan FILE``
    store_port: int = field(default_factory=free_port)

    def agent_name(self, node: str) -> str:
        return f"{self.name}-{node}"

    def start(self) -> None:
        for node, devices in self.nodes.items():
            self.start_agent(node, devices)

    def start_agent(self, node: str, devices: list[int]) -> subprocess.Popen[bytes]:
        serve = ["--serve-store"] if node == next(iter(self.nodes)) else []
        command = [
            *(sys.executable, "-m", "worker_agent", "run"),
            *("--server", f"ws://127.0.0.1:{self.plane.port}", "--job", self.name),
            *("--node", node, "--devices", ",".join(map(str, devices))),
            *("--store", f"127.0.0.1:{self.store_port}", *serve),
            *("--hang-floor", str(HANG_FLOOR_S), "--first-step-floor", str(FIRST_STEP_FLOOR_S)),
            *("--grace", "5", "--layers", "8"),
            *self.agent_options,
            *("--", *TRAINER, str(self.scenario), *self.trainer_options),
        ]
        return self.plane.processes.start(
            self.agent_name(node), command, {"PITSTOP_AGENT_TOKEN": self.token}
        )

    def agent(self, node: str) -> subprocess.Popen[bytes]:
        return self.plane.processes.running[self.agent_name(node)]

    def stop(self) -> None:
        """SIGTERM every agent at once, then wait for each (SIGKILL after a grace)."""
        names = [self.agent_name(node) for node in reversed(list(self.nodes))]
        self.plane.processes.stop_together(names)

    def kill_node(self, node: str) -> None:
        """The node is lost: its agent SIGKILLed (its ranks die with it)."""
        self.plane.processes.stop(self.agent_name(node), signal.SIGKILL)


def reference_scenario() -> dict[str, Any]:
    scenario: dict[str, Any] = json.loads(SCENARIO.read_text())
    return scenario


def scale_scenario(nodes: int) -> dict[str, Any]:
    """The 7B model's scenario on ``nodes`` × 8 devices: PP4 × DP(2 × nodes)."""
    scenario: dict[str, Any] = json.loads(LARGE.read_text())
    scenario.pop("failed", None)
    devices = nodes * 8
    scenario["cluster"].update(devices=devices, devices_per_node=8)
    scenario["training"]["global_batch"] = 16 * devices // 4
    scenario["plan"] = {
        "pipelines": [
            {
                "stages": [
                    {"devices": [p * 4 + s], "layers": [s * 8, s * 8 + 8]} for s in range(4)
                ],
                "micro_batches": 16,
            }
            for p in range(devices // 4)
        ]
    }
    return scenario


def password(data: Path) -> str:
    """The demo user's password: generated once, kept (owner only) in the data directory."""
    path = data / "demo_password"
    if not path.exists():
        path.write_text(base64.b32encode(secrets.token_bytes(10)).decode().lower() + "\n")
        path.chmod(0o600)
    return path.read_text().strip()


class Reporter:
    """A few lines per event: what was injected, each decision's status as it changes, the
    recovery's phases; a status line now and then."""

    def __init__(self, plane: ControlPlane, jobs: dict[str, int]) -> None:
        self.plane, self.jobs = plane, jobs
        self.seen: dict[int, str] = {}
        self.failed: set[str] = set()  # jobs with a failed recovery since the last look
        self.start = time.monotonic()

    def say(self, text: str) -> None:
        elapsed = int(time.monotonic() - self.start)
        print(f"[{elapsed // 60:02d}:{elapsed % 60:02d}] {text}", flush=True)

    def poll(self) -> None:
        for name, job in self.jobs.items():
            found = self.plane.api(f"/api/v1/recoveries/?job={job}")["results"]
            for decision in reversed(found):
                if self.seen.get(decision["id"]) != decision["status"]:
                    self.seen[decision["id"]] = decision["status"]
                    self.say(f"{name}: {self.describe(decision)}")
                    if decision["status"] == "failed":
                        self.failed.add(name)

    def describe(self, d: dict[str, Any]) -> str:
        failure = d["failure"] or {}
        what = f"recovery {d['id']} ({failure.get('kind')} of devices {failure.get('devices')})"
        status = d["status"]
        chosen = d.get("chosen")
        policy = ""
        if chosen is not None and d["candidates"]:
            candidate = d["candidates"][chosen]
            policy = str(candidate.get("policy") or candidate.get("name") or "")
        if status == "proposed":
            return (
                f"{what}: {policy} proposed, waiting for an operator: "
                f"{self.plane.url}/ (approve or override)"
            )
        if status == "recovered":
            timeline = self.plane.api(f"/api/v1/recoveries/{d['id']}/timeline/")
            phases = {p["phase"]: p["seconds"] for p in timeline["phases"]}
            parts = ", ".join(f"{k} {v:.2f}" for k, v in phases.items() if v is not None)
            failure_at = _time(failure.get("occurred_at") or failure.get("detected_at"))
            done = [e for e in timeline["results"] if e["kind"] == "first_step"]
            total = ""
            if failure_at and done:
                total = f" in {(_time(done[-1]['at']) or failure_at) - failure_at:.1f} s"
            return f"{what}: recovered{total} by {policy} ({parts} s)"
        if status == "failed":
            return f"{what}: failed: {d.get('reason') or ''}"
        return f"{what}: {status.replace('_', ' ')}{f' ({policy})' if policy else ''}"

    def trains(self, name: str) -> bool:
        """Whether the job has taken a step (its live loss is a number); False when the control
        plane does not answer."""
        try:
            live = self.plane.api(f"/api/v1/jobs/{self.jobs[name]}/live/")
        except (OSError, ValueError, urllib.error.URLError):
            return False
        return isinstance(live.get("loss"), float)

    def status(self) -> None:
        parts = []
        for name, job in self.jobs.items():
            live = self.plane.api(f"/api/v1/jobs/{job}/live/")
            step, loss, rate = live.get("step"), live.get("loss"), live.get("samples_per_s")
            nodes = f" nodes {live.get('nodes_connected', 0)}"
            if not isinstance(loss, float):  # no step taken yet: torch importing, groups forming
                parts.append(f"{name} starting{nodes}")
                continue
            parts.append(
                f"{name} step {step if step is not None else '-'} loss {loss:.3f}"
                + (f" {rate:.0f} samples/s" if isinstance(rate, int | float) else "")
                + nodes
            )
        self.say("status: " + "; ".join(parts))


def _time(text: str | None) -> float | None:
    if not text:
        return None
    return dt.datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m controlplane.demo",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--port", type=int, default=int(os.environ.get("PORT", "8000")))
    p.add_argument(
        "--data-dir",
        type=Path,
        default=Path(os.environ.get("PITSTOP_DATA_DIR", ROOT / "var")),
        help="where the database, the embedded Redis, the password and the logs go",
    )
    p.add_argument("--every", type=float, default=60.0, help="seconds between failures")
    p.add_argument("--status", type=float, default=10.0, help="seconds between status lines")
    p.add_argument("--scale", type=int, default=0, help="also N simulated nodes of 8 devices")
    p.add_argument("--seconds", type=float, help="stop after this long (default: Ctrl-C)")
    p.add_argument("--no-faults", action="store_true", help="inject no failure")
    return p


# The round of failures: (job, what, node, device); the devices keep a live holder of every
# layer of PP4 × DP2 (node-3's devices 6 and 7 are pipeline 1's last two stages, device 4 its
# first, device 5 its second: devices 2, 3, 0 and 1 hold the same layers).
ROUND = (
    ("auto", "node_loss", "node-3", None),
    ("auto", "crash", "node-2", 4),
    ("manual", "node_loss", "node-2", None),
    ("auto", "hang", "node-2", 5),
)
NODES = {f"node-{i}": [2 * i, 2 * i + 1] for i in range(4)}


class Demo:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.data: Path = args.data_dir.resolve()
        logs = self.data / "demo-logs"
        logs.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ, PITSTOP_DATA_DIR=str(self.data), OMP_NUM_THREADS="1")
        env.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")
        env.setdefault("PITSTOP_HEARTBEAT_INTERVAL_S", "0.5")
        self.processes = Processes(logs, env)
        self.plane = ControlPlane(self.data, args.port, self.processes)
        self.made: dict[str, Any] = {}
        self.auto: TrainerJob | None = None

    def jobs(self) -> list[dict[str, Any]]:
        scenario = reference_scenario()
        jobs = [
            {"name": "demo-auto", "scenario": scenario, "mode": "auto", "policies": POLICIES},
            {"name": "demo-manual", "scenario": scenario, "mode": "manual", "policies": POLICIES},
        ]
        if self.args.scale:
            jobs.append(
                {
                    "name": "demo-scale",
                    "scenario": scale_scenario(self.args.scale),
                    "mode": "auto",
                    "policies": POLICIES,
                }
            )
        return jobs

    def start_jobs(self) -> None:
        self.made = self.plane.setup("demo", password(self.data), self.jobs())
        made = self.made["jobs"]
        self.auto = TrainerJob(
            "demo-auto", made["demo-auto"]["id"], made["demo-auto"]["token"], SCENARIO,
            NODES, self.plane,
        )  # fmt: skip
        self.auto.start()
        for node in NODES:
            self.start_simulated("demo-manual", node)
        if self.args.scale:
            scale = self.data / "demo-scale.json"
            scale.write_text(json.dumps(scale_scenario(self.args.scale)))
            self.processes.start(
                "demo-scale-sim",
                self.simulate("demo-scale", self.args.scale, 8, 0, scale),
                self.token_env("demo-scale"),
            )

    def simulate(
        self, job: str, nodes: int, per_node: int, first: int, scenario: Path
    ) -> list[str]:
        return [
            *(sys.executable, "-m", "worker_agent", "simulate"),
            *("--server", f"ws://127.0.0.1:{self.plane.port}", "--job", job),
            *("--nodes", str(nodes)),
            *("--devices-per-node", str(per_node), "--first-node", str(first)),
            *("--scenario", str(scenario)),
        ]

    def start_simulated(self, job: str, node: str) -> None:
        index = int(node.split("-")[1])
        self.processes.start(
            f"{job}-{node}", self.simulate(job, 1, 2, index, SCENARIO), self.token_env(job)
        )

    def token_env(self, job: str) -> dict[str, str]:
        """The job's agent token, for a simulator's environment."""
        return {"PITSTOP_AGENT_TOKEN": self.made["jobs"][job]["token"]}

    def stop_jobs(self) -> None:
        names = [n for n in self.processes.running if n.startswith("demo-")]
        for name in names:
            with contextlib.suppress(ProcessLookupError):
                self.processes.running[name].send_signal(signal.SIGTERM)
        for name in names:
            self.processes.stop(name)

    def restart_jobs(self, reporter: Reporter) -> None:
        self.stop_jobs()
        self.start_jobs()
        reporter.jobs = {n: m["id"] for n, m in self.made["jobs"].items()}

    def inject(self, reporter: Reporter, turn: int) -> None:
        job, kind, node, device = ROUND[turn % len(ROUND)]
        assert self.auto is not None
        if job == "manual":
            self.processes.stop(f"demo-manual-{node}", signal.SIGKILL)
            reporter.say(f"demo-manual: injected node loss: {node}'s simulated agent killed")
        elif kind == "node_loss":
            self.auto.kill_node(node)
            reporter.say(f"demo-auto: injected node loss: {node}'s agent SIGKILLed with its ranks")
        else:
            # the drill an operator runs: the control plane sends it to the node's agent
            what = {"crash": ("kill", "SIGKILL"), "hang": ("hang", "SIGSTOP")}[kind]
            body = {"node": node, "kind": what[0], "device": device}
            try:
                self.plane.api(f"/api/v1/jobs/{self.auto.id}/drills/", body)
            except urllib.error.HTTPError as error:
                refusal = json.loads(error.read() or b"{}").get("message", error.reason)
                reporter.say(f"demo-auto: the {kind} drill was refused: {refusal}")
                return
            reporter.say(
                f"demo-auto: injected {kind}: {what[1]} to the rank of device {device} "
                f"(POST /api/v1/jobs/{self.auto.id}/drills/)"
            )

    def run(self) -> int:
        args = self.args
        print(f"Pitstop demo: data in {self.data}, logs in {self.processes.logs}/", flush=True)
        print("starting the control plane (migrate, Daphne + embedded Redis, Celery worker, "
              "detector) ...", flush=True)  # fmt: skip
        self.plane.start()
        self.start_jobs()
        jobs = {name: made["id"] for name, made in self.made["jobs"].items()}
        reporter = Reporter(self.plane, jobs)
        print(f"dashboard: {self.plane.url}/  user: demo  password: {password(self.data)}"
              f"  (kept in {self.data / 'demo_password'})", flush=True)  # fmt: skip
        print("jobs: demo-auto (auto: 8 reference-trainer ranks on 4 agents), demo-manual "
              "(manual: 4 simulated nodes of 2 devices; approve or override in the dashboard)"
              + (f", demo-scale ({args.scale} simulated nodes x 8 devices)" if args.scale else ""),
              flush=True)  # fmt: skip
        if not args.no_faults:
            print(f"a failure every {args.every:g} s: node loss, crash, node loss (manual job), "
                  "hang; then both jobs start afresh. Ctrl-C stops everything.",
                  flush=True)  # fmt: skip
        started = time.monotonic()
        next_status = started + args.status
        next_fault = started + args.every
        turn = 0
        fresh = True  # the jobs started afresh and no failure was injected since
        waiting = False  # said that the round's first failure waits for its job's first step
        while args.seconds is None or time.monotonic() - started < args.seconds:
            if dead := [n for n in self.processes.died() if not n.startswith("demo-")]:
                reporter.say(f"{', '.join(dead)} exited; see {self.processes.logs}/")
                return 1
            with contextlib.suppress(OSError, ValueError, urllib.error.URLError):
                reporter.poll()
                now = time.monotonic()
                if now >= next_status:
                    next_status = now + args.status
                    reporter.status()
            if reporter.failed:
                reporter.say("a recovery failed: both jobs start afresh")
                reporter.failed.clear()
                turn, fresh = 0, True
                self.restart_jobs(reporter)
                next_fault = time.monotonic() + args.every
            if not args.no_faults and time.monotonic() >= next_fault:
                # fresh jobs get an interval to start, as the first round's did: a node lost
                # before its hello is only found at the join deadline, after the next failure
                target = f"demo-{ROUND[turn % len(ROUND)][0]}"
                if turn % len(ROUND) == 0 and not fresh:
                    reporter.say("a round of failures done: both jobs start afresh")
                    self.restart_jobs(reporter)
                    fresh = True
                elif fresh and not reporter.trains(target):
                    # and the round's first failure waits for the job's first step: a job still
                    # importing torch and forming its groups (slow on a busy machine) has no
                    # training to recover yet
                    if not waiting:
                        reporter.say(f"{target} has not taken a step yet: the failure waits for it")
                        waiting = True
                    next_fault = time.monotonic() + 1
                    continue
                else:
                    self.inject(reporter, turn)
                    turn, fresh = turn + 1, False
                waiting = False
                next_fault = time.monotonic() + args.every
            time.sleep(0.5)
        return 0

    def stop(self) -> None:
        print("stopping: agents, simulated nodes, detector, worker, then the server and its "
              "Redis ...", flush=True)  # fmt: skip
        self.stop_jobs()
        self.processes.stop_all(last=["server"])
        print("stopped; nothing left running", flush=True)


def _raise_stopped(signum: int, frame: Any) -> None:
    raise Stopped


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.scale < 0 or args.scale > 4096:
        parser().error("--scale: 0 to 4096 nodes")
    demo = Demo(args)
    signal.signal(signal.SIGTERM, _raise_stopped)
    signal.signal(signal.SIGINT, _raise_stopped)
    code = 0
    try:
        code = demo.run()
    except Stopped:
        pass
    except (RuntimeError, TimeoutError) as error:
        print(f"demo: {error}", file=sys.stderr, flush=True)
        code = 1
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        demo.stop()
    return code


if __name__ == "__main__":
    sys.exit(main())
