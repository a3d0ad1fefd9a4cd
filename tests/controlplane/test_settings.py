"""Settings come from the environment, with embedded defaults under the data directory."""

import stat
from pathlib import Path

import pytest
import redis
from django.conf import settings
from django.db import connection

from controlplane import redis_probe
from tests.processes import clean_environment, settings_in_subprocess

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


def test_secret_key_is_generated_once_and_kept_private(tmp_path: Path) -> None:
    env = clean_environment(PITSTOP_DATA_DIR=str(tmp_path), REDIS_URL=UNUSED_REDIS)
    first = settings_in_subprocess(env)["SECRET_KEY"]
    second = settings_in_subprocess(env)["SECRET_KEY"]
    key_file = tmp_path / "secret_key"
    assert len(first) >= 50
    assert first == second == key_file.read_text().strip()
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600


def test_secret_key_from_environment_wins_over_the_kept_one(tmp_path: Path) -> None:
    env = clean_environment(PITSTOP_DATA_DIR=str(tmp_path), REDIS_URL=UNUSED_REDIS)
    settings_in_subprocess(env)  # keeps a generated key
    values = settings_in_subprocess({**env, "SECRET_KEY": "configured-key"})
    assert values["SECRET_KEY"] == "configured-key"


def test_default_redis_is_embedded_and_stops_with_the_process(tmp_path: Path) -> None:
    values = settings_in_subprocess(clean_environment(PITSTOP_DATA_DIR=str(tmp_path)))
    url = values["REDIS_URL"]
    assert url.startswith("redis://:") and "@127.0.0.1:" in url
    assert not (tmp_path / "redis" / "server.json").exists()
    with pytest.raises(redis.ConnectionError):
        redis_probe.ping(url, timeout_s=1)


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
