"""Settings come from the environment only: reading them writes no file and starts no process."""

import json
import os
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import redis
from django.conf import settings
from django.db import connection

from controlplane import redis_probe
from tests.processes import clean_environment, last_line, python_in_repo, settings_in_subprocess

UNUSED_REDIS = "redis://127.0.0.1:1/0"  # never contacted: settings only read the URL


def test_sqlite_file_in_data_dir_is_the_default_database(tmp_path: Path) -> None:
    values = settings_in_subprocess(
        clean_environment(PITSTOP_DATA_DIR=str(tmp_path), REDIS_URL=UNUSED_REDIS)
    )
    assert values["ENGINE"] == "django.db.backends.sqlite3"
    assert Path(values["NAME"]) == tmp_path / "pitstop.sqlite3"


def test_postgresql_is_used_when_database_url_names_it(tmp_path: Path) -> None:
    values = settings_in_subprocess(
        clean_environment(
            PITSTOP_DATA_DIR=str(tmp_path),
            REDIS_URL=UNUSED_REDIS,
            DATABASE_URL="postgres://postgres@db.example:5433/pitstop",
        )
    )
    assert values["ENGINE"] == "django.db.backends.postgresql"
    assert (values["NAME"], values["HOST"], values["PORT"]) == ("pitstop", "db.example", "5433")


def test_debug_is_off_unless_asked(tmp_path: Path) -> None:
    base = {"PITSTOP_DATA_DIR": str(tmp_path), "REDIS_URL": UNUSED_REDIS}
    assert settings_in_subprocess(clean_environment(**base))["DEBUG"] is False
    assert settings_in_subprocess(clean_environment(**base, DEBUG="true"))["DEBUG"] is True


def test_allowed_hosts_default_to_loopback_names(tmp_path: Path) -> None:
    values = settings_in_subprocess(
        clean_environment(PITSTOP_DATA_DIR=str(tmp_path), REDIS_URL=UNUSED_REDIS)
    )
    assert values["ALLOWED_HOSTS"] == ["localhost", "127.0.0.1", "[::1]"]


def test_secret_key_is_empty_unless_configured(tmp_path: Path) -> None:
    # The kept key is provided by the entry points (test_defaults.py), not by the settings.
    env = clean_environment(PITSTOP_DATA_DIR=str(tmp_path), REDIS_URL=UNUSED_REDIS)
    assert settings_in_subprocess(env)["SECRET_KEY"] == ""
    assert settings_in_subprocess({**env, "SECRET_KEY": "configured"})["SECRET_KEY"] == "configured"


def test_unset_redis_url_names_the_missing_server_instead_of_starting_one(tmp_path: Path) -> None:
    values = settings_in_subprocess(clean_environment(PITSTOP_DATA_DIR=str(tmp_path)))
    assert urlsplit(values["REDIS_URL"]).hostname == "embedded-redis-not-started.invalid"
    with pytest.raises(redis.ConnectionError, match="embedded-redis-not-started"):
        redis_probe.ping(values["REDIS_URL"], timeout_s=1)


# Runs `statement`, then reports this process's children and every process on the machine whose
# command line names the data directory (an embedded redis-server's does), while still running.
_SIDE_EFFECT_PROBE = """
import json, os
from pathlib import Path

{statement}

def processes():
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            command = (entry / "cmdline").read_bytes().replace(b"\\0", b" ").decode()
        except (OSError, ValueError):
            continue  # ended meanwhile
        yield int(entry.name), int(stat.rsplit(")", 1)[1].split()[1]), command

data_dir = os.environ["PITSTOP_DATA_DIR"]
print(json.dumps({{
    "children": [pid for pid, ppid, _ in processes() if ppid == os.getpid()],
    "naming_data_dir": [
        command for pid, _, command in processes() if data_dir in command and pid != os.getpid()
    ],
}}))
"""


@pytest.mark.parametrize(
    "statement",
    [
        "import controlplane.settings",
        "import django; django.setup()",
        # Django first, then Celery: only a Celery command (nothing loaded yet) starts Redis.
        "import django; django.setup(); from controlplane.celery import app; app.conf.broker_url",
    ],
)
def test_loading_the_settings_writes_nothing_and_starts_nothing(
    tmp_path: Path, statement: str
) -> None:
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    output = python_in_repo(
        "-c",
        _SIDE_EFFECT_PROBE.format(statement=statement),
        env=clean_environment(PITSTOP_DATA_DIR=str(data_dir)),
    )
    found = json.loads(last_line(output))
    assert found == {"children": [], "naming_data_dir": []}
    assert list(data_dir.iterdir()) == []


def test_unknown_log_format_is_refused_naming_the_variable(tmp_path: Path) -> None:
    env = clean_environment(PITSTOP_DATA_DIR=str(tmp_path), REDIS_URL=UNUSED_REDIS)
    with pytest.raises(AssertionError, match="LOG_FORMAT"):
        settings_in_subprocess({**env, "LOG_FORMAT": "xml"})


@pytest.mark.django_db
def test_configured_database_answers_a_query() -> None:
    expected_vendor = {
        "django.db.backends.sqlite3": "sqlite",
        "django.db.backends.postgresql": "postgresql",
    }[settings.DATABASES["default"]["ENGINE"]]
    assert connection.vendor == expected_vendor
    with connection.cursor() as cursor:
        cursor.execute("SELECT 1 + 1")
        assert cursor.fetchone() == (2,)
        if connection.vendor == "postgresql":
            cursor.execute("SELECT current_database()")
            row = cursor.fetchone()
            assert row is not None and row[0] == connection.settings_dict["NAME"]
            assert row[0].startswith("test_")  # pytest-django's own database


@pytest.mark.django_db(transaction=True)
@pytest.mark.asyncio
async def test_the_servers_database_calls_keep_their_threads_connections() -> None:
    # each call a server makes in a worker thread opened a PostgreSQL connection of its own (a
    # connect and a session's set-up): one server answered 2,048 hellos after 12.5 s, not 1 s
    if connection.vendor != "postgresql":
        pytest.skip("SQLite opens no server connection; the PostgreSQL pass runs this")
    from controlplane.streaming.agent import in_thread

    def backend() -> int:
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_backend_pid()")
            row = cursor.fetchone()
        assert row is not None
        return int(row[0])

    calls = 24
    seen = {await in_thread(backend)() for _ in range(calls)}
    threads = min(32, (os.cpu_count() or 1) + 4)  # the event loop's default executor
    assert len(seen) <= min(threads, calls - 1)
