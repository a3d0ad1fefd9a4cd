"""GET /healthz reports the database and Redis, and names the part that fails."""

import pytest
from django.test import Client
from pytest_django import Settings

from tests.processes import free_port


@pytest.mark.django_db
def test_healthz_is_ok_when_database_and_redis_answer(client: Client) -> None:
    response = client.get("/healthz")
    assert response.status_code == 200
    assert response.json() == {"status": "ok", "database": "ok", "redis": "ok"}


@pytest.mark.django_db
def test_healthz_names_redis_when_it_does_not_answer(client: Client, settings: Settings) -> None:
    settings.REDIS_URL = f"redis://127.0.0.1:{free_port()}/0"
    response = client.get("/healthz")
    assert response.status_code == 503
    assert response.json() == {"status": "error", "database": "ok", "redis": "error"}


def test_healthz_names_the_database_when_it_cannot_be_reached(client: Client) -> None:
    # Without the django_db mark pytest-django refuses every query, as a dead server would.
    response = client.get("/healthz")
    assert response.status_code == 503
    assert response.json() == {"status": "error", "database": "error", "redis": "ok"}


def test_healthz_only_answers_get(client: Client) -> None:
    assert client.post("/healthz").status_code == 405
