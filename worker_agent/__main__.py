"""``python -m worker_agent COMMAND``: ``simulate`` plays nodes that speak the real protocol
without trainers (worker_agent/sim.py); the agent beside real trainers comes with ``run``."""

from __future__ import annotations

import sys

from worker_agent import sim

USAGE = "usage: python -m worker_agent simulate [--help | ARGS...]"


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        print(sim.__doc__)
        return 0 if argv else 2
    if argv[0] != "simulate":
        print(f"worker_agent: unknown command {argv[0]!r}\n{USAGE}", file=sys.stderr)
        return 2
    return sim.main(argv[1:])


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
