"""Scenario files: the JSON contract of the CLI and simulator, read into a ClusterState.

The format is the codec's (``controlplane.recovery.codec``); this module only reads files.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from controlplane.recovery.codec import state_from_dict
from controlplane.recovery.errors import InvalidScenario
from controlplane.recovery.model import ClusterState


def build_state(data: Any) -> ClusterState:
    """Validate a scenario object (parsed JSON) and build the state it describes."""
    return state_from_dict(data)


def load_scenario(path: str | Path) -> ClusterState:
    """Read and validate a scenario file."""
    try:
        data = json.loads(Path(path).read_text())
    except OSError as exc:
        raise InvalidScenario(f"cannot read {path}: {exc.strerror}", field="scenario") from None
    except json.JSONDecodeError as exc:
        raise InvalidScenario(
            f"not valid JSON at line {exc.lineno} column {exc.colno}: {exc.msg}",
            field="scenario",
        ) from None
    return build_state(data)
