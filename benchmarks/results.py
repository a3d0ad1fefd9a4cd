"""Where every benchmark writes its JSON results, stamped with the machine that produced them."""

from __future__ import annotations

import json
import platform
from pathlib import Path
from typing import Any


def write_results(path: Path, payload: dict[str, Any]) -> Path:
    """Write ``payload`` (plus machine and Python version) as indented JSON and say where."""
    path.parent.mkdir(parents=True, exist_ok=True)
    stamped = {"machine": platform.machine(), "python": platform.python_version(), **payload}
    path.write_text(json.dumps(stamped, indent=2, default=str) + "\n")
    print(f"wrote {path}")
    return path
