"""Pytest plugin: the test session provides the embedded defaults, as a serving process does.

pytest-django reads Django's settings while pytest loads the initial conftests, before any
conftest code runs; this plugin, named with `-p` in pyproject.toml, goes first. The session
therefore has the kept SECRET_KEY and a Redis (the embedded one unless REDIS_URL is set), and
stops the server it started when it ends.
"""

import logging
import os
from urllib.parse import urlsplit, urlunsplit

import pytest

from controlplane import defaults, embedded_redis


@pytest.hookimpl(tryfirst=True)
def pytest_load_initial_conftests() -> None:
    _one_redis_per_worker()
    defaults.provide(redis=True)


def _one_redis_per_worker() -> None:
    """Under pytest-xdist (`-n N`), each worker gets a Redis of its own, as a session has one:
    tests empty what earlier tests left there. With REDIS_URL set, worker gwK uses the URL's
    database number plus K; without it, each worker's embedded Redis (and SQLite file) lives in a
    data directory of its own."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if not worker:
        return
    index = int(worker.removeprefix("gw"))
    if url := os.environ.get("REDIS_URL"):
        parts = urlsplit(url)
        database = int(parts.path.strip("/") or 0) + index
        os.environ["REDIS_URL"] = urlunsplit(parts._replace(path=f"/{database}"))
    else:
        os.environ["PITSTOP_DATA_DIR"] = str(defaults.data_dir() / "xdist" / worker)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    # Stop the session's embedded Redis quietly: pytest writes out what it captured after its
    # closing summary, and the summary should stay the last line.
    logging.disable(logging.INFO)
    try:
        embedded_redis.stop_owned()
    finally:
        logging.disable(logging.NOTSET)
