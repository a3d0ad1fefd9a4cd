"""Django's command line for the Pitstop control plane: ``python manage.py COMMAND`` in a
checkout, ``pitstop-manage COMMAND`` where Pitstop is installed (``pip install .``)."""

import os
import sys

from controlplane import defaults

# Commands that serve, and so need the embedded Redis when REDIS_URL is unset; the others
# (migrate, shell, ...) get only the data directory and the kept SECRET_KEY.
SERVING_COMMANDS = frozenset({"runserver", "detect_failures"})


def main() -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")
    command = sys.argv[1] if len(sys.argv) > 1 else "help"
    defaults.provide(redis=command in SERVING_COMMANDS)
    from django.core.management import execute_from_command_line

    execute_from_command_line(sys.argv)
