"""Pytest plugin: the test session provides the embedded defaults, as a serving process does.

pytest-django reads Django's settings while pytest loads the initial conftests, before any
conftest code runs; this plugin, named with `-p` in pyproject.toml, goes first. The session
therefore has the kept SECRET_KEY and a Redis (the embedded one unless REDIS_URL is set), and
stops the server it started when it ends.
"""

import logging

import pytest

from controlplane import defaults, embedded_redis


@pytest.hookimpl(tryfirst=True)
def pytest_load_initial_conftests() -> None:
    defaults.provide(redis=True)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    # Stop the session's embedded Redis quietly: pytest writes out what it captured after its
    # closing summary, and the summary should stay the last line.
    logging.disable(logging.INFO)
    try:
        embedded_redis.stop_owned()
    finally:
        logging.disable(logging.NOTSET)
