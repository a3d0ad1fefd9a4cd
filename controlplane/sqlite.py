"""The embedded SQLite database in write-ahead-log mode: set once per file, when a connection
finds it is not (the mode is kept in the file; setting it on every connection takes a lock)."""

from __future__ import annotations

from typing import Any

from django.db.backends.signals import connection_created


def use_wal(sender: Any, connection: Any, **kwargs: Any) -> None:
    if connection.vendor != "sqlite" or connection.is_in_memory_db():
        return
    with connection.cursor() as cursor:
        cursor.execute("PRAGMA journal_mode")
        if cursor.fetchone()[0].lower() != "wal":
            cursor.execute("PRAGMA journal_mode=WAL")


def connect() -> None:
    connection_created.connect(use_wal, dispatch_uid="pitstop-sqlite-wal")
