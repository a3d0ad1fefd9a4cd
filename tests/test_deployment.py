"""docker-compose.yml describes the production-like stack with commands that really exist."""

import importlib
import importlib.util
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml
from celery.app.utils import find_app

from tests.processes import REPO_ROOT

PITSTOP_SERVICES = ("migrate", "web", "worker", "detector", "beat")


@pytest.fixture(scope="module")
def services() -> dict[str, dict[str, Any]]:
    compose = yaml.safe_load((REPO_ROOT / "docker-compose.yml").read_text())
    found: dict[str, dict[str, Any]] = compose["services"]
    return found


def test_stack_has_every_service(services: dict[str, dict[str, Any]]) -> None:
    expected = {"postgres", "redis", "migrate", "web", "worker", "detector", "beat", "agent"}
    assert expected <= set(services)


def test_web_serves_the_asgi_application(services: dict[str, dict[str, Any]]) -> None:
    command = services["web"]["command"]
    assert command[0] == "daphne"
    module_name, attribute = command[-1].split(":")
    module = importlib.import_module(module_name)
    assert callable(getattr(module, attribute))


@pytest.mark.parametrize(("service", "subcommand"), [("worker", "worker"), ("beat", "beat")])
def test_celery_services_run_the_project_app(
    services: dict[str, dict[str, Any]], service: str, subcommand: str
) -> None:
    command = services[service]["command"]
    assert command[:4] == ["celery", "-A", "controlplane", subcommand]
    assert find_app(command[2]).main == "controlplane"


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


def test_agent_runs_the_simulated_node_module(services: dict[str, dict[str, Any]]) -> None:
    command = services["agent"]["command"]
    assert command[:3] == ["python", "-m", "worker_agent.sim"]
    assert "DATABASE_URL" not in services["agent"]["environment"]
    if importlib.util.find_spec("worker_agent.sim") is None:
        pytest.skip("worker_agent.sim is not written yet; the compose file already names it")


def test_image_installs_the_runtime_requirements() -> None:
    dockerfile = (REPO_ROOT / "Dockerfile").read_text()
    assert dockerfile.startswith("# ") and "FROM python:3.11-slim" in dockerfile
    assert "pip install -r requirements.txt" in dockerfile
    assert all(Path(REPO_ROOT, name).is_file() for name in ("requirements.txt", ".dockerignore"))
