"""A rank's standard error, kept for its fault: the last lines as a terminal would show them,
whatever the pipe's chunks."""

from __future__ import annotations

import itertools

from hypothesis import given
from hypothesis import strategies as st

from worker_agent.agent import OutputTail
from worker_agent.protocol import MAX_LOG_LINES

LINE = st.text(alphabet=st.characters(exclude_categories=["Cs"]), max_size=30)


def _shown(text: str, keep: int) -> list[str]:
    """The reference: each line as a terminal leaves it (after its last carriage return), the
    blank ones dropped, the last ``keep``."""
    lines = []
    for line in text.split("\n"):
        while line.endswith("\r"):
            line = line[:-1]
        visible = line.split("\r")[-1]
        if visible.strip():
            lines.append(visible)
    return lines[-keep:]


@given(lines=st.lists(LINE, max_size=40), cuts=st.lists(st.integers(0, 2000), max_size=10))
def test_the_tail_is_the_same_however_the_pipe_cuts_the_bytes(
    lines: list[str], cuts: list[int]
) -> None:
    data = "\n".join(lines).encode()
    tail = OutputTail()
    edges = sorted({0, len(data), *(c for c in cuts if c < len(data))})
    for start, end in itertools.pairwise(edges):
        tail.feed(data[start:end])  # mid-character too: "é" is two bytes
    assert tail.last() == _shown("\n".join(lines), MAX_LOG_LINES)


def test_a_progress_bar_counts_as_its_last_redraw_and_the_unfinished_line_is_kept() -> None:
    tail = OutputTail(lines=3)
    tail.feed(b"step 1\n 10%|#\r 50%|#####\r100%|##########\n\n")
    tail.feed(b'Traceback (most recent call last):\n  File "train.py"')
    assert tail.last() == [
        "100%|##########",
        "Traceback (most recent call last):",
        '  File "train.py"',
    ]
    tail.feed(b", line 3\n")
    assert tail.last()[-1] == '  File "train.py", line 3'
