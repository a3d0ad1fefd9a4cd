"""``python -m worker_agent COMMAND``: ``run`` is the agent beside a node's trainers
(worker_agent/agent.py); ``launch`` runs a torchrun script under it, in torchrun's place
(worker_agent/launch.py); ``inject`` puts a fault into one of its ranks for a drill
(worker_agent/faults.py); ``simulate`` plays nodes that speak the real protocol without trainers
(worker_agent/sim.py)."""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence

USAGE = "usage: python -m worker_agent {run,launch,inject,simulate} [--help | ARGS...]"


def _commands() -> dict[str, Callable[[Sequence[str]], int]]:
    from worker_agent import agent, faults, launch, sim

    return {"run": agent.main, "launch": launch.main, "inject": faults.main, "simulate": sim.main}


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        print(__doc__)
        return 0 if argv else 2
    commands = _commands()
    if argv[0] not in commands:
        print(f"worker_agent: unknown command {argv[0]!r}\n{USAGE}", file=sys.stderr)
        return 2
    return commands[argv[0]](argv[1:])


def cli() -> int:
    """The installed ``pitstop-agent`` command: ``python -m worker_agent``'s."""
    return main(sys.argv[1:])


if __name__ == "__main__":
    raise SystemExit(cli())
