"""The REST API under schemathesis: every operation of ``/api/v1/schema/``, as an admin, an
operator and a viewer, through schemathesis' phases (the schema's examples, its coverage of
boundaries and invalid values, random fuzzing), counting server errors (5xx) and schema
violations (an undocumented status code, content type or header, a body that does not match
its schema).

A fresh control plane (the ASGI server on loopback, a temporary SQLite database, Redis) serves a
job with a proposed recovery, its failure and timeline, and a user with an API token for each
role. Bounded: loopback only, ``--max-examples`` per operation and phase, ``--max-time`` per
role. Needs Redis (``REDIS_URL``, default redis://127.0.0.1:6379/13, which it flushes).

    python -m benchmarks.api_fuzz [--max-examples 100] [--max-time 600] [--seed 1]

``tests/controlplane/test_api_fuzz.py`` runs the same ``fuzz`` in a small form in CI.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from benchmarks.results import write_results

ROOT = Path(__file__).resolve().parents[1]
ROLES = ("admin", "operator", "viewer")
# Server errors, and the response against what the schema documents for the operation.
SERVER_ERROR = "not_a_server_error"
CONFORMANCE = (
    "status_code_conformance",
    "content_type_conformance",
    "response_headers_conformance",
    "response_schema_conformance",
)
PHASES = ("examples", "coverage", "fuzzing")


@dataclass
class Outcome:
    """One role's run: requests sent, server errors and schema violations, each distinct
    failure as ``METHOD path: check: title``."""

    role: str
    requests: int = 0
    server_errors: int = 0
    violations: int = 0
    errors: int = 0  # schemathesis could not test an operation (a bad schema, a network error)
    failures: list[str] = field(default_factory=list)
    elapsed_s: float = 0.0


def fuzz(
    base_url: str,
    token: str,
    *,
    role: str,
    max_examples: int,
    seed: int = 1,
    max_time_s: float = 600.0,
    phases: tuple[str, ...] = PHASES,
) -> Outcome:
    """Run schemathesis over the whole schema at ``base_url`` with ``token``'s role."""
    import schemathesis
    from schemathesis.config import SchemathesisConfig
    from schemathesis.engine import Status, events

    headers = {"Authorization": f"Token {token}"}
    config = SchemathesisConfig.from_dict(
        {
            "seed": seed,
            "max-time": max_time_s,
            "workers": 1,
            "headers": headers,
            "generation": {"max-examples": max_examples, "database": "none"},
            "checks": {
                "enabled": False,
                SERVER_ERROR: {"enabled": True},
                **{name: {"enabled": True} for name in CONFORMANCE},
            },
            "phases": {
                name: {"enabled": name in phases}
                for name in ("examples", "coverage", "fuzzing", "stateful")
            },
        }
    )
    schema = schemathesis.openapi.from_url(
        f"{base_url}/api/v1/schema/", config=config, headers=headers, timeout=120
    )
    schema.config.update(base_url=base_url)
    outcome, seen, started = Outcome(role=role), set[str](), time.monotonic()
    for event in schemathesis.engine.from_schema(schema).execute():
        if isinstance(event, events.NonFatalError | events.FatalError):
            outcome.errors += 1
            outcome.failures.append(f"error: {getattr(event, 'label', '')}: {event}")
        if not isinstance(event, events.ScenarioFinished):
            continue
        recorder = event.recorder
        outcome.requests += len(recorder.interactions)
        for case_id, checks in recorder.checks.items():
            response = recorder.find_response(case_id=case_id)
            status = response.status_code if response is not None else None
            for check in checks:
                if check.status != Status.FAILURE:
                    continue
                failure = check.failure_info.failure if check.failure_info else None
                title = getattr(failure, "title", "") if failure is not None else ""
                detail = str(getattr(failure, "message", "")).splitlines()[:1]
                key = f"{recorder.label} {status}: {check.name}: {title}: {' '.join(detail)[:80]}"
                if check.name == SERVER_ERROR:
                    outcome.server_errors += 1
                else:
                    outcome.violations += 1
                if key not in seen:
                    seen.add(key)
                    outcome.failures.append(key)
    outcome.elapsed_s = round(time.monotonic() - started, 1)
    return outcome


# --- the benchmark's own control plane ------------------------------------------------------

_SEED = """
import json
from django.contrib.auth.models import Group, User
from django.utils import timezone
from rest_framework.authtoken.models import Token
from controlplane.incidents import decisions
from controlplane.incidents.models import FailureSource
from controlplane.jobs.services import create_job
scenario = json.loads(open({path!r}).read())
scenario["failed"], scenario["cluster"]["spares"] = [], 2
job, _ = create_job("fuzzed", scenario, approval_mode="manual",
                    enabled_policies=["odyssey", "dynamic", "checkpoint"])
_, decision = decisions.record_failure(job, kind="crash", devices=[5],
                                       source=FailureSource.AGENT, occurred_at=timezone.now())
decisions.plan(decision.pk)
tokens = {{}}
for role in {roles!r}:
    person = User.objects.create_user(role, password="x")
    person.groups.add(Group.objects.get_or_create(name=role)[0])
    tokens[role] = Token.objects.create(user=person).key
print(json.dumps(tokens))
"""


def serve(tmp: Path, redis_url: str) -> tuple[subprocess.Popen[bytes], str, dict[str, str]]:
    """A control plane on loopback with a seeded job: the server, its URL, a token per role."""
    env = {
        **os.environ,
        "DATABASE_URL": f"sqlite:///{tmp}/fuzz.sqlite3",
        "REDIS_URL": redis_url,
        "PITSTOP_DATA_DIR": str(tmp),
        "SECRET_KEY": "api-fuzz",
        "PITSTOP_NAMESPACE": "apifuzz",  # its Redis keys apart from any other deployment's
        "DJANGO_SETTINGS_MODULE": "controlplane.settings",
    }
    manage = [sys.executable, "manage.py"]
    subprocess.run([*manage, "migrate", "-v", "0"], env=env, cwd=ROOT, check=True)
    example = ROOT / "examples" / "llama2-7b-pp4-dp2-tp1.json"
    made = subprocess.run(
        [*manage, "shell", "-c", _SEED.format(path=str(example), roles=ROLES)],
        env=env, cwd=ROOT, check=True, capture_output=True, text=True,
    )  # fmt: skip
    tokens: dict[str, str] = json.loads(made.stdout.strip().splitlines()[-1])
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = subprocess.Popen(
        [sys.executable, "-m", "daphne", "-b", "127.0.0.1", "-p", str(port),
         "controlplane.asgi:application"],
        env=env, cwd=ROOT, stdout=(tmp / "server.log").open("wb"), stderr=subprocess.STDOUT,
    )  # fmt: skip
    deadline = time.monotonic() + 60
    while True:
        if server.poll() is not None or time.monotonic() > deadline:
            server.kill()
            raise SystemExit(f"the server did not start; see {tmp / 'server.log'}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                break
        except OSError:
            time.sleep(0.2)
    return server, f"http://127.0.0.1:{port}", tokens


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-examples", type=int, default=100)
    parser.add_argument("--max-time", type=float, default=600.0, help="seconds per role")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--redis", default=os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/13"))
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/api_fuzz.json")
    args = parser.parse_args(argv)
    if args.max_examples < 1 or args.max_time <= 0:
        parser.error("--max-examples and --max-time must be positive")
    import redis

    redis.Redis.from_url(args.redis).flushdb()
    outcomes: list[Outcome] = []
    with tempfile.TemporaryDirectory(prefix="pitstop-fuzz-") as tmp:
        server, url, tokens = serve(Path(tmp), args.redis)
        try:
            for role in ROLES:
                outcomes.append(
                    fuzz(url, tokens[role], role=role, max_examples=args.max_examples,
                         seed=args.seed, max_time_s=args.max_time)
                )  # fmt: skip
        finally:
            server.terminate()
            server.wait(timeout=30)
    print(f"{'role':<10}{'requests':>10}{'5xx':>6}{'violations':>12}{'errors':>8}{'s':>8}")
    for o in outcomes:
        print(
            f"{o.role:<10}{o.requests:>10}{o.server_errors:>6}{o.violations:>12}"
            f"{o.errors:>8}{o.elapsed_s:>8}"
        )
    for o in outcomes:
        for failure in o.failures:
            print(f"  {o.role}: {failure}")
    write_results(
        args.out,
        {"benchmark": "api_fuzz", "max_examples": args.max_examples, "seed": args.seed,
         "results": [asdict(o) for o in outcomes]},
    )  # fmt: skip
    clean = all(o.server_errors == o.violations == o.errors == 0 for o in outcomes)
    return 0 if clean else 1


if __name__ == "__main__":
    raise SystemExit(main())
