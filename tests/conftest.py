"""Session-wide test setup."""

import logging

import pytest

from controlplane import embedded_redis


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    # Stop the session's embedded Redis quietly: pytest writes out what it captured after its
    # closing summary, and the summary should stay the last line.
    logging.disable(logging.INFO)
    try:
        embedded_redis.stop_owned()
    finally:
        logging.disable(logging.NOTSET)
