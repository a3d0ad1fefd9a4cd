"""Log lines: structured, and secrets never in them whoever logs them."""

from __future__ import annotations

import json

from tests.processes import clean_environment, python_in_repo

# Logs through structlog and through plain `logging` (as Django and Celery do), both ways.
PROBE = """
import logging
import sys
import structlog
from controlplane.structured_logging import configure
sys.stderr = sys.stdout  # the handler writes to stderr; the probe reads stdout
configure(log_format="json", level="INFO")
structlog.get_logger("probe").info("hello.refused", token="tok-SECRET-1", job="j1")
logging.getLogger("plain").info("login of %s", "someone", extra={"password": "pw-SECRET-2"})
structlog.get_logger("probe").info("bound", api_key="key-SECRET-3", Authorization="Token x")
structlog.get_logger("probe").info("keys", key="k-SECRET-4", private_key="pk-SECRET-5",
                                   apiKey="ak-SECRET-6", credentials="c-SECRET-7", keys=2)
"""


def test_secrets_are_redacted_from_every_log_line() -> None:
    output = python_in_repo("-c", PROBE, env=clean_environment())
    lines = [json.loads(line) for line in output.splitlines() if line.startswith("{")]
    events = {line["event"]: line for line in lines}
    assert set(events) >= {"hello.refused", "login of someone", "bound", "keys"}, output
    assert "SECRET" not in output
    assert events["hello.refused"]["token"] == "[redacted]"
    assert events["hello.refused"]["job"] == "j1"  # other fields are kept as they were
    assert events["bound"]["api_key"] == events["bound"]["Authorization"] == "[redacted]"
    keys = events["keys"]
    assert [keys[name] for name in ("key", "private_key", "apiKey", "credentials")] == [
        "[redacted]"
    ] * 4
    assert keys["keys"] == 2  # a count of keys is no secret
