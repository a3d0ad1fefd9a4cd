"""What is public: /metrics behind a bearer token where one is set, the schema and its docs behind
a login where the deployment says so, Swagger UI and Redoc from the app's own static files, and
a throttle on wrong passwords whose count every server process shares (Redis)."""

from __future__ import annotations

import re
import uuid

import pytest
import redis
from django.conf import settings
from django.contrib.auth.models import User
from django.test import Client, override_settings

from .test_api import client_as, user

pytestmark = pytest.mark.django_db


def test_metrics_are_public_by_default_and_need_the_token_where_one_is_set() -> None:
    assert Client().get("/metrics").status_code == 200
    with override_settings(PITSTOP_METRICS_TOKEN="m-token-1"):
        anonymous = Client().get("/metrics")
        assert anonymous.status_code == 401 and anonymous["WWW-Authenticate"].startswith("Bearer")
        wrong = Client().get("/metrics", HTTP_AUTHORIZATION="Bearer m-token-2")
        assert wrong.status_code == 401
        right = Client().get("/metrics", HTTP_AUTHORIZATION="Bearer m-token-1")
        assert right.status_code == 200 and b"pitstop_heartbeats" in right.content


@pytest.mark.parametrize(
    "url", ["/api/schema/", "/api/v1/schema/", "/api/v1/docs/", "/api/v1/redoc/"]
)
def test_the_schema_and_its_docs_need_a_role_where_the_deployment_says_so(url: str) -> None:
    assert Client().get(url).status_code == 200
    with override_settings(PITSTOP_SCHEMA_LOGIN=True):
        refused = Client().get(url)
        assert refused.status_code == 403
        assert client_as(None).get(url).status_code == 403
        assert client_as("viewer").get(url).status_code == 200


@pytest.mark.parametrize("url", ["/api/v1/docs/", "/api/v1/redoc/"])
def test_swagger_ui_and_redoc_load_no_file_from_another_host(url: str) -> None:
    page = Client().get(url).content.decode()
    sources = re.findall(r'(?:src|href)="([^"]+)"', page)
    assert sources and all(s.startswith("/static/drf_spectacular_sidecar/") for s in sources)
    # a CDN named as a host: the page's random CSRF token once held the letters "cdn"
    assert not re.search(r"cdn[.\w-]*\.(?:com|net|org|io)|jsdelivr|unpkg", page, re.I)
    assert "https://" not in page
    for source in sources:
        served = Client().get(source)
        assert served.status_code == 200, source
        assert len(b"".join(served.streaming_content)) > 500, source  # type: ignore[attr-defined]


def _login(address: str, username: str, password: str) -> tuple[int, str]:
    response = Client(REMOTE_ADDR=address).post(
        "/accounts/login/", {"username": username, "password": password}
    )
    return response.status_code, response.content.decode()


@override_settings(PITSTOP_LOGIN_ATTEMPTS=3, PITSTOP_LOGIN_WINDOW_S=120)
def test_wrong_passwords_are_throttled_per_user_and_address() -> None:
    address = f"10.{uuid.uuid4().int % 250}.{uuid.uuid4().int % 250}.7"
    person = User.objects.create_user(f"t-{uuid.uuid4().hex[:8]}", password="right-pw-1")
    other = user("viewer")
    other.set_password("other-pw-1")
    other.save()
    for _ in range(3):
        assert _login(address, person.username, "wrong")[0] == 200
    code, page = _login(address, person.username, "right-pw-1")
    assert code == 429 and "Too many wrong passwords" in page and "2 minutes" in page
    assert _login(address, other.username, "other-pw-1")[0] == 302  # another user: not throttled
    assert _login("10.255.255.9", person.username, "right-pw-1")[0] == 302  # another address
    shared = redis.Redis.from_url(settings.REDIS_URL)
    try:  # the count is in Redis, where every server process reads it
        assert shared.keys(f"{settings.PITSTOP_REDIS_PREFIX}:cache:*login-fail:addr:{address}")
    finally:
        shared.close()


@override_settings(PITSTOP_LOGIN_ATTEMPTS=2, PITSTOP_LOGIN_WINDOW_S=120)
def test_the_admin_login_is_throttled_too() -> None:
    address = f"10.{uuid.uuid4().int % 250}.{uuid.uuid4().int % 250}.8"
    admin = User.objects.create_superuser(f"a-{uuid.uuid4().hex[:8]}", password="admin-pw-1")
    client = Client(REMOTE_ADDR=address)
    for _ in range(2):
        client.post("/admin/login/", {"username": admin.username, "password": "wrong"})
    response = client.post("/admin/login/", {"username": admin.username, "password": "admin-pw-1"})
    assert response.status_code == 200 and "Too many wrong passwords" in response.content.decode()
