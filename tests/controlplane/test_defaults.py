"""The entry points provide what the environment leaves unset, and nothing it sets."""

import itertools
import os
import stat
from pathlib import Path

import pytest
import redis

from controlplane import defaults, redis_probe
from tests.processes import clean_environment, last_line, python_in_repo

CONFIGURED = {
    "DATABASE_URL": "postgres://postgres@db.example:5432/pitstop",
    "SECRET_KEY": "configured-key",
    "REDIS_URL": "redis://redis.example:6379/0",
}


@pytest.fixture
def data_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A data directory that does not exist yet, and an environment that configures nothing."""
    path = tmp_path / "data"
    monkeypatch.setenv("PITSTOP_DATA_DIR", str(path))
    for name in CONFIGURED:
        monkeypatch.delenv(name, raising=False)
    return path


@pytest.mark.parametrize(
    "configured",
    [set(names) for size in range(4) for names in itertools.combinations(CONFIGURED, size)],
    ids=lambda names: "+".join(sorted(names)) or "nothing",
)
def test_configured_variables_are_kept_and_only_the_missing_ones_written(
    data_dir: Path, monkeypatch: pytest.MonkeyPatch, configured: set[str]
) -> None:
    for name in configured:
        monkeypatch.setenv(name, CONFIGURED[name])

    defaults.provide(redis=False)  # this process must not own a server: see the subprocess test

    assert {name: os.environ[name] for name in configured} == {
        name: CONFIGURED[name] for name in configured
    }
    assert ("REDIS_URL" in os.environ) == ("REDIS_URL" in configured)
    written = sorted(path.name for path in data_dir.iterdir()) if data_dir.exists() else None
    if {"DATABASE_URL", "SECRET_KEY"} <= configured:
        assert written is None  # a configured deployment needs no data directory at all
    else:
        assert written == ([] if "SECRET_KEY" in configured else ["secret_key"])


def test_secret_key_is_generated_once_kept_private_and_reused(
    data_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    defaults.provide(redis=False)
    first = os.environ["SECRET_KEY"]
    monkeypatch.delenv("SECRET_KEY")
    defaults.provide(redis=False)

    key_file = data_dir / "secret_key"
    assert len(first) >= 50
    assert os.environ["SECRET_KEY"] == first == key_file.read_text().strip()
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600


# Serves as the ASGI server does: provides, then uses the Redis it was given.
_SERVING_PROCESS = """
import os
from controlplane import defaults, redis_probe
defaults.provide(redis=True)
redis_probe.ping(os.environ["REDIS_URL"], timeout_s=5)
print(os.environ["REDIS_URL"])
"""


def test_serving_process_gets_an_embedded_redis_that_stops_with_it(tmp_path: Path) -> None:
    output = python_in_repo(
        "-c", _SERVING_PROCESS, env=clean_environment(PITSTOP_DATA_DIR=str(tmp_path))
    )
    url = last_line(output)
    assert url.startswith("redis://:") and "@127.0.0.1:" in url
    # It answered while the process ran (the ping above); the process owned it, so it is gone.
    assert not (tmp_path / "redis" / "server.json").exists()
    with pytest.raises(redis.ConnectionError):
        redis_probe.ping(url, timeout_s=1)


def test_manage_py_keeps_a_key_and_starts_no_redis(tmp_path: Path) -> None:
    python_in_repo("manage.py", "check", env=clean_environment(PITSTOP_DATA_DIR=str(tmp_path)))
    assert sorted(path.name for path in tmp_path.iterdir()) == ["secret_key"]
