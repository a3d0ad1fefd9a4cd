"""A torchrun script that only writes its environment to ``<OUT>/<RANK>.json`` and exits 0:
what torchrun, or a launcher in its place, gives each process."""

import json
import os
import sys
from pathlib import Path

out = Path(sys.argv[1])
out.mkdir(parents=True, exist_ok=True)
(out / f"{os.environ['RANK']}.json").write_text(json.dumps(dict(os.environ)))
