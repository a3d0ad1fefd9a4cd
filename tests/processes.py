"""Helpers for tests that run real processes: clean environments, free ports, polling."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent

# The variables settings.py reads; a child process starts from none of them unless a test says so.
PITSTOP_VARIABLES = (
    "PITSTOP_DATA_DIR",
    "DATABASE_URL",
    "REDIS_URL",
    "PITSTOP_NAMESPACE",
    "SECRET_KEY",
    "ALLOWED_HOSTS",
    "SECURE_PROXY_SSL_HEADER",
    "CSRF_TRUSTED_ORIGINS",
    "SECURE_HSTS_SECONDS",
    "DEBUG",
    "LOG_FORMAT",
    "LOG_LEVEL",
)


def clean_environment(**overrides: str) -> dict[str, str]:
    """This process's environment without Pitstop's variables, plus `overrides`."""
    env = {key: value for key, value in os.environ.items() if key not in PITSTOP_VARIABLES}
    env["DJANGO_SETTINGS_MODULE"] = "controlplane.settings"
    env.update(overrides)
    return env


# The settings module itself, not django.conf.settings: that refuses to hand out an empty
# SECRET_KEY, and the tests want to see what the module computes from the environment.
_SETTINGS_PROBE = """
import json
from controlplane import settings
database = settings.DATABASES["default"]
print(json.dumps({
    "ENGINE": database["ENGINE"],
    "NAME": str(database["NAME"]),
    "HOST": database.get("HOST", ""),
    "PORT": str(database.get("PORT", "")),
    "DEBUG": settings.DEBUG,
    "SECRET_KEY": settings.SECRET_KEY,
    "ALLOWED_HOSTS": settings.ALLOWED_HOSTS,
    "REDIS_URL": settings.REDIS_URL,
}))
"""


def python_in_repo(*args: str, env: Mapping[str, str]) -> str:
    """Run a fresh interpreter in the repository with ``env``; its output, once it succeeded."""
    completed = subprocess.run(
        [sys.executable, *args],
        env=dict(env),
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert completed.returncode == 0, completed.stderr
    return completed.stdout


def last_line(output: str) -> str:
    """The last line a probe printed (structlog may log to stdout before it)."""
    return output.strip().splitlines()[-1]


def settings_in_subprocess(env: Mapping[str, str]) -> dict[str, Any]:
    """Import controlplane.settings in a fresh interpreter with `env`; return chosen values."""
    values: dict[str, Any] = json.loads(last_line(python_in_repo("-c", _SETTINGS_PROBE, env=env)))
    return values


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def wait_until(condition: Callable[[], bool], *, timeout_s: float, what: str) -> None:
    """Poll `condition` until it holds; fail the test naming `what` after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.05)


def process_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def stop_leftover_redis(state_path: Path) -> None:
    """After a failure, leave no embedded Redis (described by `state_path`) running behind."""
    if state_path.exists():
        pid = json.loads(state_path.read_text())["pid"]
        if process_exists(pid):
            os.kill(pid, signal.SIGTERM)
