"""A torchrun script whose rank 1 raises after a moment; ``@record`` writes the exception to the
process's error file, as torchrun's documentation asks scripts to."""

import os
import time

from torch.distributed.elastic.multiprocessing.errors import record


@record
def main() -> None:
    time.sleep(0.5)
    if os.environ["RANK"] == "1":
        raise RuntimeError("the shard of rank 1 is gone")


if __name__ == "__main__":
    main()
