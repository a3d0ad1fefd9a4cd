"""Entry point: ``python -m controlplane.recovery``."""

import sys

from controlplane.recovery.cli import main

sys.exit(main())
