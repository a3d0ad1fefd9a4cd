"""The ./dev entry point explains itself and refuses unknown commands."""

import subprocess

from tests.processes import REPO_ROOT


def _dev(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(REPO_ROOT / "dev"), *args],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
        stdin=subprocess.DEVNULL,
    )


def test_help_lists_the_commands() -> None:
    for args in ((), ("--help",)):
        completed = _dev(*args)
        assert completed.returncode == 0
        assert "Usage: ./dev COMMAND" in completed.stdout
        assert all(f"  {name}" in completed.stdout for name in ("demo", "test", "manage"))


def test_unknown_command_fails_with_usage() -> None:
    completed = _dev("deploy-to-mars")
    assert completed.returncode == 2
    assert "unknown command 'deploy-to-mars'" in completed.stderr
