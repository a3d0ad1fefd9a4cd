"""Stopping a decision whose failure changed while it was being made.

A caller of ``decision.decide`` may give it ``stale``, a question (has the failure changed?)
that ``decide`` asks between policies and that a long policy asks at its own ``checkpoint``s:
the first yes raises ``Superseded``, and the caller decides again for the failure as it is now.
A burst of losses recorded one after another otherwise has its first loss planned to the end by
every policy, for an answer thrown away. Nothing here changes an answer: with no question, or
no yes, a decision is made exactly as without.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar

from controlplane.recovery.errors import Superseded

_asked: ContextVar[Callable[[], bool] | None] = ContextVar("stale", default=None)


@contextmanager
def watching(stale: Callable[[], bool] | None) -> Iterator[None]:
    """``checkpoint`` asks ``stale`` inside this block (None: it asks nothing)."""
    token = _asked.set(stale)
    try:
        yield
    finally:
        _asked.reset(token)


def checkpoint(where: str) -> None:
    """Raise ``Superseded`` if the decision being made is for a failure that changed; a policy
    calls it before each long piece of its work (``where`` names it, for the message)."""
    stale = _asked.get()
    if stale is not None and stale():
        raise Superseded(f"the failure changed {where}")
