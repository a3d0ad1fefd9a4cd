"""Per-user limits on the API calls whose cost the caller controls (``controlplane.api.throttles``):
one call too many in the window is a coded 429 with Retry-After, for that user only; the schema
documents it; and the cap on agent sockets waiting for hello follows the descriptor limit."""

from __future__ import annotations

import resource
from collections.abc import Iterator
from typing import Any

import pytest
from django.core.cache import cache
from django.core.exceptions import ImproperlyConfigured
from django.test import Client, override_settings
from hypothesis import given
from hypothesis import strategies as st

from controlplane import settings as settings_module
from controlplane.streaming.agent import WAITING_CAP, default_waiting_cap, waiting_cap
from tests.controlplane.test_api import post, proposed, user

RATE = 3


@pytest.fixture
def viewers() -> Iterator[list[Any]]:
    """Two viewers with no what-if counted yet (ids come back after a rollback; counts outlive
    it in Redis), and none left behind."""
    people = [user("viewer"), user("viewer")]
    keys = [f"throttle_whatif_{person.pk}" for person in people]
    cache.delete_many(keys)
    yield people
    cache.delete_many(keys)


@pytest.mark.django_db
@override_settings(PITSTOP_API_RATE_WHATIF=f"{RATE}/min")
def test_one_what_if_too_many_is_429_with_retry_after_for_that_user_only(
    viewers: list[Any],
) -> None:
    decision = proposed()
    url = f"/api/v1/jobs/{decision.job_id}/what-if/"
    busy, other = Client(), Client()
    busy.force_login(viewers[0])
    other.force_login(viewers[1])
    for _ in range(RATE):
        assert post(busy, url, {"devices": [0]}).status_code == 200
    refused = post(busy, url, {"devices": [0]})
    assert refused.status_code == 429
    assert 1 <= int(refused["Retry-After"]) <= 60
    assert refused.json()["code"] == "throttled" and refused.json()["field"] is None
    assert busy.get(f"/api/v1/jobs/{decision.job_id}/").status_code == 200  # reads: not counted
    assert post(other, url, {"devices": [0]}).status_code == 200  # another user is served
    assert cache.get(f"throttle_whatif_{viewers[0].pk}")  # counted in the shared cache (Redis)


THROTTLED = {
    ("/api/v1/jobs/", "post"),
    ("/api/v1/jobs/launch/", "post"),
    ("/api/v1/jobs/{id}/tokens/", "post"),
    ("/api/v1/jobs/{id}/what-if/", "post"),
    ("/api/v1/jobs/{id}/drills/", "post"),
    ("/api/v1/simulations/", "post"),
}


@pytest.mark.django_db
def test_the_schema_documents_429_with_retry_after_where_calls_are_limited() -> None:
    client = Client()
    client.force_login(user("viewer"))
    paths = client.get("/api/v1/schema/", HTTP_ACCEPT="application/json").json()["paths"]
    limited = {
        (path, method)
        for path, methods in paths.items()
        for method, operation in methods.items()
        if isinstance(operation, dict) and "429" in operation.get("responses", {})
    }
    assert limited == THROTTLED
    for path, method in THROTTLED:
        answer = paths[path][method]["responses"]["429"]
        assert "Retry-After" in answer["headers"]
        assert answer["content"]["application/json"]["schema"]["$ref"].endswith("/Error")


@given(st.integers(min_value=-1, max_value=2**40), st.integers(min_value=0, max_value=2**20))
def test_the_default_waiting_cap_leaves_three_quarters_of_the_descriptors(
    limit: int, more: int
) -> None:
    cap = default_waiting_cap(limit)
    assert 1 <= cap <= WAITING_CAP
    if limit >= 4:
        assert 4 * cap <= limit  # three quarters left for agents, /healthz, the database, Redis
    if limit < 0 or limit >= 4 * WAITING_CAP:  # RLIM_INFINITY, or plenty: the usual 256
        assert cap == WAITING_CAP
    elif limit >= 4:
        assert 4 * (cap + 1) > limit  # as many as a quarter allows
    if limit >= 0:
        assert default_waiting_cap(limit + more) >= cap  # a larger limit never lowers it


def test_the_cap_follows_this_process_limit_unless_the_setting_is_given() -> None:
    assert default_waiting_cap(256) == 64  # the 256 descriptors: 64 silent sockets
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    with override_settings(PITSTOP_MAX_WAITING_SOCKETS=None):
        assert waiting_cap() == default_waiting_cap(soft)
    with override_settings(PITSTOP_MAX_WAITING_SOCKETS=7):
        assert waiting_cap() == 7


@given(
    count=st.integers(min_value=1, max_value=10**9 - 1),
    period=st.sampled_from(["s", "sec", "second", "m", "min", "minute", "h", "hour", "d", "day"]),
)
def test_every_rate_drf_reads_is_taken_as_written(count: int, period: str) -> None:
    rate = f"{count}/{period}"
    assert settings_module.api_rate("PITSTOP_API_RATE_WHATIF", rate) == rate


UNREADABLE_RATES = ["lots", "0/min", "60", "60/", "/min", "-1/min", "60/week", "6 0/m"]


@pytest.mark.parametrize("rate", UNREADABLE_RATES)
def test_a_rate_drf_cannot_read_stops_the_start_naming_its_variable(rate: str) -> None:
    with pytest.raises(ImproperlyConfigured, match="PITSTOP_API_RATE_DRILLS"):
        settings_module.api_rate("PITSTOP_API_RATE_DRILLS", rate)
