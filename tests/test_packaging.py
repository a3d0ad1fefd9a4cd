"""Pitstop installs: both distributions build as wheels, install with their pinned dependencies
into fresh virtualenvs, and run from there, outside the checkout.

- ``pitstop`` (pyproject.toml): everything, with requirements.txt's pins; ``pitstop-run``,
  ``pitstop-agent`` and ``pitstop-manage``.
- ``pitstop-agent`` (agent/pyproject.toml): the worker agent and the recovery core only, with
  requirements-agent.txt's pins: no Django, Celery or Channels, and no ``controlplane/__init__.py``
  (``controlplane`` is a namespace package holding ``controlplane.recovery``).

The wheels are built from a copy of the checkout (setuptools writes build/ and *.egg-info beside
the sources it builds). To spare minutes and gigabytes (torch) per virtualenv, the dependencies
are not downloaded and installed again: each virtualenv sees this environment's copies of exactly
the distributions its wheel requires, transitively, at the versions its metadata pins (linked
into one folder, put on its path by a .pth file); pip checks them against the wheel's metadata
as installed ones, and a dependency the metadata left out is missing there. With
PITSTOP_PACKAGING_FRESH=1, pip installs every dependency itself from the indexes instead.
"""

from __future__ import annotations

import email
import email.message
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import tomllib
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.processes import REPO_ROOT, clean_environment
from tests.worker_agent.helpers import ScriptedServer

ENV_DUMP = REPO_ROOT / "tests" / "worker_agent" / "scripts" / "env_dump.py"
# What the full wheel ships, and the agent wheel's part of it.
FULL_PACKAGES = ("controlplane", "webui", "worker_agent")
AGENT_FOLDERS = ("worker_agent", "controlplane/recovery")
FRAMEWORKS = ("django", "celery", "channels")
# Left out of the copy the wheels are built from: what is not the checkout's.
NOT_SOURCES = shutil.ignore_patterns(
    ".git", ".venv", "var", "build", "dist", "*.egg-info", "__pycache__", "*.py[cod]",
    ".mypy_cache", ".ruff_cache", ".pytest_cache", ".hypothesis", ".import_linter_cache",
)  # fmt: skip


# --- the dependency lists ---------------------------------------------------------------------


def requirement_lines(name: str) -> tuple[list[str], list[Requirement]]:
    """A requirements file's option lines and its requirements."""
    options, requirements = [], []
    for raw in (REPO_ROOT / name).read_text().splitlines():
        line = raw.split(" #")[0].strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("-"):
            options.append(line)
        else:
            requirements.append(Requirement(line))
    return options, requirements


def pins(requirements: list[Requirement]) -> dict[str, str]:
    found: dict[str, str] = {}
    for requirement in requirements:
        (specifier,) = requirement.specifier
        assert specifier.operator == "==", f"{requirement} is not pinned"
        found[canonicalize_name(requirement.name)] = specifier.version
    return found


def test_the_full_distribution_takes_its_dependencies_from_requirements_txt() -> None:
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
    assert project["project"]["dynamic"] == ["dependencies"]
    dynamic = project["tool"]["setuptools"]["dynamic"]["dependencies"]
    assert dynamic == {"file": ["requirements.txt"]}
    # setuptools reads the file as requirements alone: an option line would break the build
    options, requirements = requirement_lines("requirements.txt")
    assert not options
    assert pins(requirements)


def test_the_agent_distribution_has_the_agent_requirements_pins() -> None:
    agent = tomllib.loads((REPO_ROOT / "agent" / "pyproject.toml").read_text())
    declared = pins([Requirement(line) for line in agent["project"]["dependencies"]])
    _, requirements = requirement_lines("requirements-agent.txt")
    assert declared == pins(requirements)
    _, everything = requirement_lines("requirements.txt")
    full = pins(everything)
    assert {name: full.get(name) for name in declared} == declared
    assert (
        agent["project"]["version"]
        == tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["version"]
    )


# --- the wheels, built and installed ----------------------------------------------------------


@dataclass(frozen=True)
class Wheels:
    full: Path
    agent: Path


@dataclass(frozen=True)
class Venvs:
    full: Path
    agent: Path


def run(
    command: list[str | Path], *, cwd: Path, env: dict[str, str] | None = None, timeout: float = 300
) -> str:
    """Run ``command`` in ``cwd`` (outside the checkout); its output, once it succeeded."""
    completed = subprocess.run(
        [str(part) for part in command],
        cwd=cwd,
        env=environment() if env is None else env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert completed.returncode == 0, f"{command}:\n{completed.stdout}\n{completed.stderr}"
    return completed.stdout


def environment(**overrides: str) -> dict[str, str]:
    """The tests' clean environment, with neither the checkout nor the project's venv on a path."""
    env = clean_environment(**overrides)
    for name in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME"):
        env.pop(name, None)
    venv_bin = str(Path(sys.prefix) / "bin")
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep) if p != venv_bin)
    return env


@pytest.fixture(scope="module")
def wheels(tmp_path_factory: pytest.TempPathFactory) -> Wheels:
    root = tmp_path_factory.mktemp("packaging")
    source, out = root / "checkout", root / "wheels"
    shutil.copytree(REPO_ROOT, source, ignore=NOT_SOURCES, symlinks=True)
    pip_wheel: list[str | Path] = [
        sys.executable,
        "-m",
        "pip",
        "wheel",
        "--no-deps",
        "-q",
        "-w",
        out,
    ]
    run([*pip_wheel, source, source / "agent"], cwd=root, timeout=600)
    (full,) = out.glob("pitstop-0.1.0-*.whl")
    (agent,) = out.glob("pitstop_agent-0.1.0-*.whl")
    return Wheels(full=full, agent=agent)


# Each virtualenv has its own pip and setuptools (torch wants a newer setuptools: pip installs it).
NOT_SHARED = {"pip", "setuptools", "wheel"}
# PITSTOP_PACKAGING_FRESH=1: no shared distributions, pip installs every dependency (minutes more).
FRESH = os.environ.get("PITSTOP_PACKAGING_FRESH") == "1"


def _metadata(wheel: Path) -> email.message.Message:
    with zipfile.ZipFile(wheel) as archive:
        (name,) = (n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        return email.message_from_bytes(archive.read(name))


def _closure(requirements: list[Requirement]) -> list[importlib.metadata.Distribution]:
    """The distributions installed here that ``requirements`` need, transitively, with their
    extras; each must meet its requirement's pin."""
    seen: dict[str, importlib.metadata.Distribution] = {}
    walked: set[tuple[str, frozenset[str]]] = set()
    todo = list(requirements)
    while todo:
        requirement = todo.pop()
        key = canonicalize_name(requirement.name)
        if key in NOT_SHARED or (key, frozenset(requirement.extras)) in walked:
            continue
        walked.add((key, frozenset(requirement.extras)))
        if key not in seen:
            seen[key] = importlib.metadata.distribution(key)
            version = seen[key].version
            assert requirement.specifier.contains(version.split("+")[0], prereleases=True), (
                f"{key} {version} is installed here, the wheel asks for {requirement}"
            )
        for line in seen[key].requires or []:
            needed = Requirement(line)
            extras = {"", *requirement.extras}
            if needed.marker is None or any(needed.marker.evaluate({"extra": e}) for e in extras):
                todo.append(needed)
    return list(seen.values())


def _shared(wheel: Path, view: Path) -> None:
    """Link into ``view`` this environment's copies of what ``wheel`` requires, transitively:
    its own dependencies, at the versions its metadata pins, and nothing else."""
    requirements = [Requirement(r) for r in _metadata(wheel).get_all("Requires-Dist") or []]
    view.mkdir()
    for distribution in _closure(requirements):
        site = Path(str(distribution.locate_file("")))
        tops = {Path(str(f)).parts[0] for f in distribution.files or []}
        for top in sorted(tops - {"..", "__pycache__"}):
            if (site / top).exists() and not (view / top).exists():
                (view / top).symlink_to(site / top)


def _site_packages(venv: Path) -> Path:
    (site,) = (venv / "lib").glob("python3*/site-packages")
    return site


@pytest.fixture(scope="module")
def venvs(wheels: Wheels, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Venvs]:
    root = tmp_path_factory.mktemp("venvs")
    made = Venvs(full=root / "full", agent=root / "agent")
    pairs = ((made.full, wheels.full), (made.agent, wheels.agent))
    for venv, wheel in pairs:
        run([sys.executable, "-m", "venv", venv], cwd=root)
        if not FRESH:
            _shared(wheel, root / f"{venv.name}-shared")
            (_site_packages(venv) / "shared.pth").write_text(f"{root / f'{venv.name}-shared'}\n")
    # both at once: most of the time is pip waiting on indexes and the disk
    installs = [
        subprocess.Popen(
            [venv / "bin" / "python", "-m", "pip", "install", "-q", wheel],
            cwd=root,
            env=environment(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for venv, wheel in pairs
    ]
    try:
        for install in installs:
            output, _ = install.communicate(timeout=900)
            assert install.returncode == 0, output
        yield made
    finally:
        for install in installs:
            if install.poll() is None:
                install.kill()
                install.wait()


def _names(wheel: Path) -> set[str]:
    with zipfile.ZipFile(wheel) as archive:
        return {name for name in archive.namelist() if ".dist-info/" not in name}


def _sources(*folders: str) -> set[str]:
    return {
        path.relative_to(REPO_ROOT).as_posix()
        for folder in folders
        for path in (REPO_ROOT / folder).rglob("*")
        if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc"
    }


@pytest.mark.e2e
def test_the_wheels_hold_their_packages_whole_and_nothing_else(wheels: Wheels) -> None:
    # everything of the three packages: modules, migrations, templates, static files, the hook
    full = _names(wheels.full)
    assert full == _sources(*FULL_PACKAGES)
    assert {"webui/templates/webui/base.html", "webui/static/webui/style.css"} <= full
    agent = _names(wheels.agent)
    assert agent == _sources(*AGENT_FOLDERS)
    assert "controlplane/__init__.py" not in agent
    assert "controlplane/recovery/__init__.py" in agent


@pytest.mark.e2e
@pytest.mark.parametrize("which", ["full", "agent"])
def test_pitstop_run_is_installed(venvs: Venvs, which: str, tmp_path: Path) -> None:
    venv: Path = getattr(venvs, which)
    usage = run([venv / "bin" / "pitstop-run", "--help"], cwd=tmp_path)
    assert "--nproc-per-node" in usage and "--server" in usage
    assert "launch" in run([venv / "bin" / "pitstop-agent", "--help"], cwd=tmp_path)
    where = run(
        [venv / "bin" / "python", "-c", "import worker_agent; print(worker_agent.__file__)"],
        cwd=tmp_path,
    )
    assert Path(where.strip()).is_relative_to(_site_packages(venv))


@pytest.mark.e2e
def test_the_agent_install_has_no_web_or_task_framework(venvs: Venvs, tmp_path: Path) -> None:
    frameworks = repr(FRAMEWORKS)
    run(
        [venvs.agent / "bin" / "python", "-c",
         "import worker_agent.launch, worker_agent.agent, controlplane.recovery.codec, sys\n"
         f"loaded = sorted(m for m in sys.modules if m.split('.')[0] in {frameworks})\n"
         "assert not loaded, loaded\n"
         "import controlplane\n"
         "assert getattr(controlplane, '__file__', None) is None, controlplane.__file__"],
        cwd=tmp_path,
    )  # fmt: skip
    for framework in FRAMEWORKS:
        shown = subprocess.run(
            [venvs.agent / "bin" / "python", "-m", "pip", "show", "-q", framework],
            cwd=tmp_path, env=environment(), capture_output=True, timeout=120, check=False,
        )  # fmt: skip
        assert shown.returncode != 0, f"{framework} is installed"
    assert not (venvs.agent / "bin" / "pitstop-manage").exists()


@pytest.mark.e2e
def test_the_full_install_runs_django(venvs: Venvs, tmp_path: Path) -> None:
    env = environment(PITSTOP_DATA_DIR=str(tmp_path / "data"))
    env.pop("DJANGO_SETTINGS_MODULE")  # pitstop-manage names its settings itself
    checked = run([venvs.full / "bin" / "pitstop-manage", "check"], cwd=tmp_path, env=env)
    assert "no issues" in checked
    where = run([venvs.full / "bin" / "python", "-c", "import webui; print(webui.__file__)"],
                cwd=tmp_path)  # fmt: skip
    assert Path(where.strip()).is_relative_to(_site_packages(venvs.full))


@pytest.mark.e2e
def test_a_job_runs_under_the_agent_install(venvs: Venvs, tmp_path: Path) -> None:
    out = tmp_path / "out"
    server = ScriptedServer()
    try:
        launched = subprocess.run(
            [venvs.agent / "bin" / "pitstop-run", "--standalone", "--nproc-per-node", "2",
             "--server", server.url, "--job", "j", "--token", "t", ENV_DUMP, out],
            cwd=tmp_path, env=environment(), capture_output=True, text=True, timeout=180,
            check=False,
        )  # fmt: skip
    finally:
        server.close()
    assert launched.returncode == 0, launched.stderr
    dumped = {int(p.stem): json.loads(p.read_text()) for p in out.glob("*.json")}
    assert sorted(dumped) == [0, 1]
    for rank, env in dumped.items():
        assert (env["RANK"], env["WORLD_SIZE"]) == (str(rank), "2")
        # nothing of the checkout was on the processes' path (the launcher's own entries are
        # the virtualenv's)
        assert str(REPO_ROOT) not in env.get("PYTHONPATH", "")
    hellos = [(h["node"], h["devices"]) for h in server.of_type("hello")]
    assert hellos == [("node-0", [0, 1])]
