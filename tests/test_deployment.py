"""docker-compose.yml describes the production-like stack with commands that really exist; its
agents are the real agent around the reference trainer, in an image of their own whose
requirements (requirements-agent.txt: CPU torch) cover everything that image can import."""

import ast
import importlib
import importlib.metadata
import importlib.util
import json
import re
import shutil
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml
from celery.app.utils import find_app
from packaging.requirements import Requirement

from tests.processes import REPO_ROOT, clean_environment

PITSTOP_SERVICES = ("migrate", "web", "worker", "detector")
AGENT_SERVICES = ("agent-0", "agent-1")
CPU_INDEX = "https://download.pytorch.org/whl/cpu"
FIRST_PARTY = ("worker_agent", "controlplane")
# Lazy imports of shipped modules that the agent never runs: ``controlplane.celery_app`` (the
# package's ``__getattr__``) is the control plane's Celery app.
NOT_RUN = {("controlplane", "controlplane.celery")}


@pytest.fixture(scope="module")
def services() -> dict[str, dict[str, Any]]:
    compose = yaml.safe_load((REPO_ROOT / "docker-compose.yml").read_text())
    found: dict[str, dict[str, Any]] = compose["services"]
    return found


def test_stack_has_every_service(services: dict[str, dict[str, Any]]) -> None:
    expected = {"postgres", "redis", "migrate", "web", "worker", "detector"}
    assert expected | {*AGENT_SERVICES, "simulated"} <= set(services)


def test_web_serves_the_asgi_application(services: dict[str, dict[str, Any]]) -> None:
    command = services["web"]["command"]
    assert command[0] == "daphne"
    module_name, attribute = command[-1].split(":")
    module = importlib.import_module(module_name)
    assert callable(getattr(module, attribute))


def test_the_celery_worker_runs_the_project_app(services: dict[str, dict[str, Any]]) -> None:
    command = services["worker"]["command"]
    assert command[:4] == ["celery", "-A", "controlplane", "worker"]
    assert find_app(command[2]).main == "controlplane"


def test_celery_beat_runs_only_where_there_is_a_periodic_task(
    services: dict[str, dict[str, Any]],
) -> None:
    """The detector does the periodic work (deadlines, re-queues, re-sends); a ``beat`` with
    an empty schedule would run and do nothing."""
    app = find_app("controlplane")
    beats = [name for name, s in services.items() if "beat" in s.get("command", [])[:4]]
    assert bool(beats) == bool(app.conf.beat_schedule), (beats, app.conf.beat_schedule)


def test_migrate_runs_before_web(services: dict[str, dict[str, Any]]) -> None:
    assert services["migrate"]["command"][:3] == ["python", "manage.py", "migrate"]
    assert (REPO_ROOT / "manage.py").is_file()
    migrate = services["web"]["depends_on"]["migrate"]
    assert migrate["condition"] == "service_completed_successfully"


@pytest.mark.parametrize("service", PITSTOP_SERVICES)
def test_pitstop_services_use_the_compose_database_and_redis(
    services: dict[str, dict[str, Any]], service: str
) -> None:
    environment = services[service]["environment"]
    database, redis = urlsplit(environment["DATABASE_URL"]), urlsplit(environment["REDIS_URL"])
    assert (database.scheme, database.hostname) == ("postgres", "postgres")
    postgres = services["postgres"]["environment"]
    assert database.path.lstrip("/") == postgres["POSTGRES_DB"]
    assert (database.username, database.password) == (
        postgres["POSTGRES_USER"],
        postgres["POSTGRES_PASSWORD"],
    )
    assert (redis.scheme, redis.hostname) == ("redis", "redis")
    assert set(services[service]["depends_on"]) >= {"postgres", "redis"}
    # Configured in full, so no process provides an embedded default (controlplane.defaults).
    assert environment["SECRET_KEY"]


# --- the Dockerfile's stages ----------------------------------------------------------------


def stages() -> dict[str, list[tuple[str, str]]]:
    """Each stage of the Dockerfile by name, its instructions (keyword, arguments) with its
    parent stages' first, in order; ``""`` is the last stage (what a plain build makes)."""
    found: dict[str, list[tuple[str, str]]] = {}
    current: list[tuple[str, str]] = []
    text = (REPO_ROOT / "Dockerfile").read_text().replace("\\\n", " ")
    for line in text.splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        keyword, _, arguments = line.strip().partition(" ")
        if keyword.upper() == "FROM":
            image, _, name = arguments.partition(" AS ")
            current = list(found.get(image.strip(), []))
            found[name.strip()] = current
        current.append((keyword.upper(), arguments.strip()))
    found[""] = current
    return found


def shipped(stage: list[tuple[str, str]]) -> list[str]:
    """The paths a stage copies from the build context (``COPY SRC DEST``, relative DEST under
    ``WORKDIR /app``, as this Dockerfile writes them)."""
    paths = []
    for keyword, arguments in stage:
        if keyword == "COPY":
            *sources, destination = arguments.split()
            assert all(not s.startswith("--") for s in sources), arguments
            for source in sources:
                kept = source.rstrip("/") or "."
                parent = kept.rpartition("/")[0] or "."
                assert destination.rstrip("/") in (kept, parent), f"COPY {arguments}: moved"
                paths.append(source)
    return paths


def installs(stage: list[tuple[str, str]]) -> list[str]:
    return [re.sub(r"\s+", " ", a) for k, a in stage if k == "RUN" and "pip install" in a]


def test_the_control_plane_image_is_the_default_and_installs_the_runtime_requirements(
    services: dict[str, dict[str, Any]],
) -> None:
    dockerfile = (REPO_ROOT / "Dockerfile").read_text()
    assert dockerfile.startswith("# ") and "FROM python:3.11-slim" in dockerfile
    built = stages()
    assert built[""] == built["controlplane"], "a plain build makes the control plane's image"
    assert installs(built["controlplane"]) == ["pip install -r requirements.txt"]
    assert shipped(built["controlplane"])[-1] == "."
    for service in PITSTOP_SERVICES:
        assert services[service]["build"] == {"context": ".", "target": "controlplane"}
    assert all(Path(REPO_ROOT, name).is_file() for name in ("requirements.txt", ".dockerignore"))


def test_the_agent_image_installs_only_the_agent_requirements(
    services: dict[str, dict[str, Any]],
) -> None:
    agent = stages()["agent"]
    assert agent[0][0] == "FROM" and agent[0][1].startswith("python:3.11-slim ")
    assert installs(agent) == ["pip install -r requirements-agent.txt"]
    assert "." not in shipped(agent) and "requirements.txt" not in shipped(agent)
    assert agent[-1][0] == "CMD" and ("USER", "pitstop") in agent, "not root"
    for name in (*AGENT_SERVICES, "simulated"):
        service = services[name]
        assert service["build"] == {"context": ".", "target": "agent"}, name
        assert service["image"] != services["web"]["image"], name
        # only the control plane's websocket: no database, Redis or Django secret
        assert not {"DATABASE_URL", "REDIS_URL", "SECRET_KEY"} & set(service["environment"])
        assert "web" in service["depends_on"], name


# --- requirements-agent.txt ------------------------------------------------------------------


def requirement_lines(name: str) -> tuple[list[str], dict[str, str]]:
    """A requirements file's options and its pins (normalised name → version)."""
    options, pins = [], {}
    for raw in (REPO_ROOT / name).read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line or line.startswith("-r "):
            continue
        if line.startswith("-"):
            options.append(line)
            continue
        requirement = Requirement(line)
        specifier = list(requirement.specifier)
        assert len(specifier) == 1 and specifier[0].operator == "==", f"{name}: {line} unpinned"
        pins[normalise(requirement.name)] = specifier[0].version
    return options, pins


def normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def test_agent_requirements_pin_cpu_torch_from_its_index() -> None:
    options, pins = requirement_lines("requirements-agent.txt")
    assert pins["torch"] == "2.13.0"
    indexes = [o.split(None, 1) for o in options]
    assert ["--index-url", CPU_INDEX] in indexes or ["--extra-index-url", CPU_INDEX] in indexes
    assert all(kind in ("--index-url", "--extra-index-url") for kind, _ in indexes), options
    # the same versions as everything else is tested with
    _, everything = requirement_lines("requirements.txt")
    assert {name: everything.get(name) for name in pins} == pins


# --- the agents' commands --------------------------------------------------------------------


def use_environment(service: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """The service's environment as its process sees it; a variable compose takes from the
    shell (``${PITSTOP_JOB:-}``) gets a placeholder, as the operator gives one."""
    for name in ("PITSTOP_SERVER", "PITSTOP_JOB", "PITSTOP_NODE", "PITSTOP_AGENT_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    for name, value in service["environment"].items():
        monkeypatch.setenv(name, f"the-{name.lower()}" if "${" in str(value) else str(value))


def scenario_of(plan: Path) -> dict[str, Any]:
    found: dict[str, Any] = json.loads(Path(REPO_ROOT, plan).read_text())
    return found


def test_agents_run_the_real_agent_around_the_reference_trainer(
    services: dict[str, dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each agent service's command as the agent's and the trainer's own argparse read it: one
    agent per node of the trainer's scenario, the nodes' devices as the job numbers them, one
    store hosted by the agent the others reach it at, the server the web service."""
    from worker_agent.agent import settings_from
    from worker_agent.trainer.__main__ import _parser as trainer_parser

    web = services["web"]["command"]
    settings = {}
    for name in AGENT_SERVICES:
        command = services[name]["command"]
        assert command[:4] == ["python", "-m", "worker_agent", "run"], name
        use_environment(services[name], monkeypatch)
        settings[name] = settings_from(command[4:])
    plans = set()
    for name, found in settings.items():
        server = urlsplit(found.server)
        assert (server.scheme, server.hostname) == ("ws", "web") and str(server.port) == (
            web[web.index("-p") + 1]
        )
        assert (found.job, found.token) == ("the-pitstop_job", "the-pitstop_agent_token")
        assert found.command[:4] == ["python", "-m", "worker_agent.trainer", "rank"], name
        trainer = trainer_parser().parse_args(found.command[3:])
        assert trainer.command == "rank"
        plans.add(trainer.plan)
    (plan,) = plans
    scenario = scenario_of(plan)
    per_node = scenario["cluster"]["devices_per_node"]
    total = scenario["cluster"]["devices"] + scenario["cluster"].get("spares", 0)
    nodes = {found.node: found.devices for found in settings.values()}
    assert nodes == {
        f"node-{i}": list(range(i * per_node, min((i + 1) * per_node, total)))
        for i in range(-(-total // per_node))
    }, "one agent per node of the job (jobs.services.create_job names and numbers them)"
    assert {found.layers for found in settings.values()} == {scenario["model"]["layers"]}
    hosts = [name for name, found in settings.items() if found.serve_store]
    assert len(hosts) == 1, "one agent hosts the job's store"
    assert {found.store for found in settings.values()} == {f"{hosts[0]}:29500"}
    for name in AGENT_SERVICES:
        if name != hosts[0]:
            assert hosts[0] in services[name]["depends_on"], name
    assert any(str(plan).startswith(path.rstrip("/")) for path in shipped(stages()["agent"]))


def test_simulated_nodes_play_the_same_job(
    services: dict[str, dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    from worker_agent import sim

    service = services["simulated"]
    command = service["command"]
    assert command[:4] == ["python", "-m", "worker_agent", "simulate"]
    assert service["profiles"] != services["agent-0"]["profiles"], "one or the other"
    use_environment(service, monkeypatch)
    p = sim.parser()
    args = p.parse_args(command[4:])
    sim.check_arguments(args, p)
    cluster = scenario_of(Path(args.scenario))["cluster"]
    assert (args.nodes, args.devices_per_node) == (
        len(AGENT_SERVICES),
        cluster["devices_per_node"],
    )


# --- what the agent image can import ---------------------------------------------------------


def entry_modules(services: dict[str, dict[str, Any]]) -> set[str]:
    """The modules the agent image's services run: every ``python -m MODULE`` of their
    commands, the agent's trainer command included."""
    found = set()
    for name in (*AGENT_SERVICES, "simulated"):
        command = services[name]["command"]
        found |= {command[i + 1] for i, word in enumerate(command) if word == "-m"}
    return {m + ".__main__" if (REPO_ROOT / m.replace(".", "/")).is_dir() else m for m in found}


def module_file(root: Path, name: str) -> Path | None:
    path = root.joinpath(*name.split("."))
    for candidate in (path / "__init__.py", path.with_suffix(".py")):
        if candidate.is_file():
            return candidate
    return None


def imports_of(name: str, path: Path) -> Iterable[tuple[str, bool]]:
    """Every module ``path`` may import, at its top or inside functions (lazily), less what only
    type checkers read (``if TYPE_CHECKING:``); True for a name ``from M import N`` makes, which
    is a module only if M has one of that name."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]

    def walk(node: ast.AST) -> Iterable[tuple[str, bool]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                for other in child.orelse:
                    yield from walk(other)
                continue
            if isinstance(child, ast.Import):
                yield from ((alias.name, False) for alias in child.names)
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    parts = package.split(".")[: len(package.split(".")) - child.level + 1]
                    module = ".".join([*parts, *([child.module] if child.module else [])])
                else:
                    module = child.module or ""
                yield module, False
                yield from ((f"{module}.{alias.name}", True) for alias in child.names)
            yield from walk(child)

    yield from walk(ast.parse(path.read_text()))


def reachable(roots: Iterable[str]) -> tuple[set[str], set[str]]:
    """First-party modules reachable from ``roots`` (in the repository) and the third-party
    modules they import."""
    seen: set[str] = set()
    third: set[str] = set()
    todo = list(roots)
    while todo:
        name = todo.pop()
        path = module_file(REPO_ROOT, name)
        if name in seen or path is None:
            continue
        seen.add(name)
        todo += [name.rsplit(".", i)[0] for i in range(1, name.count(".") + 1)]  # its packages
        for imported, maybe in imports_of(name, path):
            top = imported.partition(".")[0]
            if top in FIRST_PARTY:
                if (name, imported) not in NOT_RUN:
                    todo.append(imported)  # a name that is no module is dropped above
            elif top not in sys.stdlib_module_names and top != "__future__" and not maybe:
                third.add(imported)
    return seen, third


def distributions_closure(roots: Iterable[str]) -> set[str]:
    """The distributions pip installs for ``roots``: them and their dependencies, as the
    installed ones declare them (no extras)."""
    found: set[str] = set()
    todo = [normalise(r) for r in roots]
    while todo:
        name = todo.pop()
        if name in found:
            continue
        found.add(name)
        for line in importlib.metadata.distribution(name).requires or ():
            requirement = Requirement(line)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                todo.append(normalise(requirement.name))
    return found


def top_level_names(distributions: set[str]) -> set[str]:
    """The importable top-level names those distributions provide."""
    return {
        top
        for top, providers in importlib.metadata.packages_distributions().items()
        if any(normalise(p) in distributions for p in providers)
    }


def in_image(name: str, paths: list[str]) -> bool:
    """Whether the agent image has module ``name`` (its file is under a shipped path)."""
    path = module_file(REPO_ROOT, name)
    assert path is not None, name
    relative = path.relative_to(REPO_ROOT).as_posix()
    return any(
        relative == shipped_path or relative.startswith(shipped_path.rstrip("/") + "/")
        for shipped_path in paths
    )


def test_the_agent_requirements_cover_every_import_the_image_can_make(
    services: dict[str, dict[str, Any]],
) -> None:
    """Statically: every module reachable from the agent image's commands, lazy imports
    included, is in the image, and every third-party one is installed by
    requirements-agent.txt; nothing is pinned that nothing imports."""
    paths = shipped(stages()["agent"])
    first, third = reachable(entry_modules(services))
    assert {"worker_agent.agent", "worker_agent.sim", "worker_agent.trainer.serve"} <= first
    assert "controlplane.recovery.codec" in first
    missing = sorted(name for name in first if not in_image(name, paths))
    assert not missing, f"imported by the agent image but not copied into it: {missing}"
    _, pins = requirement_lines("requirements-agent.txt")
    provided = top_level_names(distributions_closure(pins))
    uncovered = sorted({m for m in third if m.partition(".")[0] not in provided})
    assert not uncovered, f"not installed by requirements-agent.txt: {uncovered}"
    imported = {m.partition(".")[0] for m in third}
    unused = sorted(
        name for name in pins if not top_level_names({name}) & imported
    )  # pinned for nothing the agent imports
    assert not unused, unused


# A fresh interpreter with only the agent image's files on its path imports every module the
# static walk found: a finder refuses any top-level module that is neither the standard
# library's, the image's, nor installed by requirements-agent.txt.
IMPORT_EVERYTHING = """
import importlib, json, sys
allowed, modules = json.loads(sys.argv[1]), json.loads(sys.argv[2])
sys.path.insert(0, sys.argv[3])  # the image's /app, and nothing of the repository
class Refuse:
    def find_spec(self, name, path=None, target=None):
        top = name.partition(".")[0]
        if (top in sys.stdlib_module_names or top in allowed or top.startswith("_sysconfigdata")
                or name in sys.builtin_module_names):
            return None
        raise ModuleNotFoundError(f"{name}: not in the agent image", name=name)
sys.meta_path.insert(0, Refuse())
for name in modules:
    importlib.import_module(name)
print("imported", len(modules))
"""


def test_the_agent_image_imports_all_that_with_its_files_and_requirements_only(
    services: dict[str, dict[str, Any]], tmp_path: Path
) -> None:
    image = tmp_path / "app"
    for path in shipped(stages()["agent"]):
        source = REPO_ROOT / path
        if source.is_dir():
            shutil.copytree(source, image / path, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            (image / path).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(source, image / path)
    first, third = reachable(entry_modules(services))
    _, pins = requirement_lines("requirements-agent.txt")
    allowed = sorted(top_level_names(distributions_closure(pins)) | set(FIRST_PARTY))
    modules = sorted(m for m in first if not m.endswith("__main__")) + sorted(third)
    done = subprocess.run(
        [sys.executable, "-I", "-c", IMPORT_EVERYTHING, json.dumps(allowed),
         json.dumps(modules), str(image)],
        cwd=image,
        env=clean_environment(),
        capture_output=True,
        text=True,
        timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == f"imported {len(modules)}"
