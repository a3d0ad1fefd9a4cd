"""The zero-configuration defaults, provided by the processes that run Pitstop.

`controlplane/settings.py` only reads the environment: importing it writes no file and starts no
process, so mypy, `manage.py` and everything else that merely reads a setting stays free of side
effects. What a bare checkout leaves unset is provided here instead, by the entry points, before
Django reads its settings:

- every process (`manage.py`, the ASGI server, a Celery command): the data directory for the
  SQLite database, and the SECRET_KEY generated once and kept in that directory;
- the processes that serve (the ASGI server behind `./dev demo`, `manage.py runserver`, a Celery
  worker or beat, the test session): also the embedded Redis. Such a process starts the server
  for its data directory, or reuses the one another process started there; the owner stops it
  when it exits.

Each value is published as the environment variable settings.py reads, so what an operator sets
always wins, and child processes (Celery's pool, Django's autoreloader) inherit the same values.
"""

import os
from pathlib import Path

from controlplane import embedded_redis, secret_key, structured_logging

REPO_ROOT = Path(__file__).resolve().parent.parent


def data_dir() -> Path:
    """Where the embedded defaults keep their files: PITSTOP_DATA_DIR, or `var/` in the checkout."""
    return Path(os.environ.get("PITSTOP_DATA_DIR") or REPO_ROOT / "var").resolve()


def provide(*, redis: bool) -> None:
    """Fill in what the environment leaves unset; `redis` is for processes that serve."""
    if not os.environ.get("DATABASE_URL"):
        # The default SQLite database creates its file on first use, but not its folder.
        data_dir().mkdir(parents=True, exist_ok=True)
    if not os.environ.get("SECRET_KEY"):
        os.environ["SECRET_KEY"] = secret_key.load_or_create(data_dir() / "secret_key")
    if redis and not os.environ.get("REDIS_URL"):
        # Logging first, so that the server's start is logged in the configured format.
        structured_logging.configure_from_environment()
        os.environ["REDIS_URL"] = embedded_redis.start(data_dir() / "redis").url
