"""Scenario files: the JSON contract of the CLI and simulator, read into a ``Scenario``.

The format is the codec's (``controlplane.recovery.codec``); this module only reads files.
"""

from __future__ import annotations

import json
from pathlib import Path

from controlplane.recovery.codec import Scenario, scenario_from_dict
from controlplane.recovery.errors import InvalidScenario

__all__ = ["Scenario", "load_scenario"]


def load_scenario(path: str | Path) -> Scenario:
    """Read and validate a scenario file: its state and its policies' options."""
    try:
        data = json.loads(Path(path).read_text())
    except OSError as exc:
        raise InvalidScenario(f"cannot read {path}: {exc.strerror}", field="scenario") from None
    except json.JSONDecodeError as exc:
        raise InvalidScenario(
            f"not valid JSON at line {exc.lineno} column {exc.colno}: {exc.msg}",
            field="scenario",
        ) from None
    return scenario_from_dict(data)
