"""The SECRET_KEY used when none is configured: generated once, then kept in the data directory."""

import contextlib
import os
import secrets
from pathlib import Path


def load_or_create(path: Path) -> str:
    """Return the key stored at `path`, creating it (readable by this user only) if missing."""
    with contextlib.suppress(FileNotFoundError):
        return path.read_text().strip()
    path.parent.mkdir(parents=True, exist_ok=True)
    key = secrets.token_urlsafe(50)
    # Write a private temporary file, then link it into place: concurrent first starts agree on
    # one key, and no process ever reads a half-written file.
    draft = path.with_name(f".{path.name}.{os.getpid()}")
    fd = os.open(draft, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as file:
        file.write(key + "\n")
    try:
        os.link(draft, path)
    except FileExistsError:
        return path.read_text().strip()
    finally:
        draft.unlink()
    return key
