"""A byte-level corpus that needs no download, and samples addressed by (seed, step, index).

The text is the source of a few standard-library modules, which ship with every Python and do
not change while a job runs (the repository's own docs may be edited under a running job, and
ranks that read different text would train on different samples). A sample is ``seq + 1``
consecutive bytes at an offset drawn from a generator seeded with (seed, step, global sample
index), so any plan that covers the global batch trains on exactly the same samples, whatever
pipeline or rank reads them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

STDLIB_MODULES = ("textwrap.py", "dataclasses.py", "argparse.py", "json/decoder.py", "heapq.py")


def corpus_files() -> list[Path]:
    """The corpus's files in a fixed order."""
    stdlib = Path(os.__file__).parent
    return [stdlib / name for name in STDLIB_MODULES if (stdlib / name).is_file()]


@dataclass(frozen=True, slots=True)
class Corpus:
    """The corpus as one byte array; samples are read from it."""

    data: np.ndarray

    @classmethod
    def default(cls) -> Corpus:
        blob = b"\n".join(f.read_bytes() for f in corpus_files())
        return cls(np.frombuffer(blob, dtype=np.uint8).copy())

    def sample(self, seed: int, step: int, index: int, seq: int) -> np.ndarray:
        """``seq + 1`` bytes for global sample ``index`` of ``step``: inputs and shifted targets."""
        if len(self.data) <= seq + 1:
            raise ValueError(f"the corpus ({len(self.data)} bytes) is shorter than a sample")
        rng = np.random.default_rng([seed, step, index])
        offset = int(rng.integers(0, len(self.data) - seq - 1))
        return self.data[offset : offset + seq + 1]

    def batch(
        self, seed: int, step: int, first: int, count: int, seq: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and targets (count, seq) as int64 for global samples [first, first + count)."""
        rows = np.stack([self.sample(seed, step, i, seq) for i in range(first, first + count)])
        tokens = torch.from_numpy(rows.astype(np.int64))
        return tokens[:, :-1], tokens[:, 1:]
