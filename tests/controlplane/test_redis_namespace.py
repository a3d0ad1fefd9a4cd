"""Every Redis key and channel of a deployment begins with its prefix, ``NAMESPACE:DB``: the
namespace setting and the database number of REDIS_URL (tests/e2e/test_shared_redis.py runs
deployments side by side on one server)."""

from __future__ import annotations

import re
import subprocess
import sys
import uuid

import pytest
from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from hypothesis import given
from hypothesis import strategies as st

from controlplane import settings as settings_module
from controlplane.celery import app as celery_app
from controlplane.jobs import liveness, snapshot
from controlplane.streaming import hub
from tests.processes import REPO_ROOT, clean_environment

NAMESPACE = re.compile(r"[A-Za-z0-9_-]{1,64}")
NAMESPACES = st.from_regex(NAMESPACE, fullmatch=True)
URLS = st.sampled_from(
    ["redis://h:6379/{db}", "redis://:pw@h/{db}", "rediss://h:6380/{db}", "redis://h?db={db}",
     "unix:///run/redis.sock?db={db}"]
)  # fmt: skip


@given(NAMESPACES, URLS, st.integers(0, 15))
def test_the_prefix_is_the_namespace_and_the_database_number(
    namespace: str, url: str, db: int
) -> None:
    assert settings_module.redis_prefix(namespace, url.format(db=db)) == f"{namespace}:{db}"


def test_a_url_without_a_database_number_is_database_0() -> None:
    assert settings_module.redis_prefix("pitstop", "redis://h:6379") == "pitstop:0"


@given(st.text(max_size=80).filter(lambda s: not NAMESPACE.fullmatch(s)))
def test_a_namespace_that_could_glob_or_collide_is_refused_by_name(namespace: str) -> None:
    with pytest.raises(ImproperlyConfigured, match="PITSTOP_NAMESPACE"):
        settings_module.redis_prefix(namespace, "redis://h:6379/0")


def test_a_process_with_a_bad_namespace_stops_at_its_settings_naming_it() -> None:
    env = clean_environment(REDIS_URL="redis://127.0.0.1:1/2", PITSTOP_NAMESPACE="a:*")
    done = subprocess.run(
        [sys.executable, "-c", "import controlplane.settings"],
        env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode != 0
    assert "ImproperlyConfigured: PITSTOP_NAMESPACE='a:*'" in done.stderr


def test_the_settings_read_the_namespace_and_the_database_from_the_environment() -> None:
    env = clean_environment(REDIS_URL="redis://127.0.0.1:1/7", PITSTOP_NAMESPACE="blue")
    done = subprocess.run(
        [sys.executable, "-c",
         "from controlplane import settings; print(settings.PITSTOP_REDIS_PREFIX)"],
        env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    assert done.stdout.strip().splitlines()[-1] == "blue:7"


def test_every_key_and_channel_begins_with_the_deployments_prefix() -> None:
    prefix = settings.PITSTOP_REDIS_PREFIX + ":"
    names = [
        liveness.seen_key(3), liveness.frames_key(3), liveness.JOBS_KEY, liveness.BEATS_KEY,
        liveness.LAG_KEY, snapshot.snapshot_key(3), hub.channel(3, "node-0"), hub.PATTERN,
    ]  # fmt: skip
    assert [name for name in names if not name.startswith(prefix)] == []


def test_celery_queues_its_tasks_under_the_deployments_prefix() -> None:
    """A task sent with no worker to take it waits in Redis: under the prefix, where another
    deployment's workers on the same database never look."""
    queue = f"probe-{uuid.uuid4().hex}"
    redis = liveness.sync_client()
    prefixed = f"{settings.PITSTOP_REDIS_PREFIX}:celery:{queue}"
    try:
        celery_app.send_task("controlplane.probe", queue=queue)
        assert redis.llen(prefixed) == 1
        assert redis.exists(queue) == 0
    finally:
        keys = [key for key in redis.scan_iter(match=f"*{queue}*", count=1000)]
        if keys:
            redis.delete(*keys)
