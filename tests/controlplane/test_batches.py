"""A server process records its sockets' losses, acknowledgements and reports in batches: one
item that cannot be recorded fails only itself, not the thousands queued beside it."""

from __future__ import annotations

import asyncio

import pytest

from controlplane.streaming.agent import Batches

pytestmark = [pytest.mark.django_db, pytest.mark.asyncio]


async def test_items_queued_together_are_one_batch_and_each_gets_its_result() -> None:
    seen: list[list[str]] = []

    def record(items: list[str]) -> list[str | Exception]:
        seen.append(list(items))
        return [item.upper() if item != "refused" else ValueError(item) for item in items]

    batches: Batches[str, str] = Batches(record)
    results = await asyncio.gather(
        *(batches.add(x) for x in ("a", "refused", "b")), return_exceptions=True
    )
    assert seen == [["a", "refused", "b"]]
    assert results[0] == "A" and results[2] == "B" and isinstance(results[1], ValueError)
    assert await batches.add("c") == "C" and seen[-1] == ["c"]  # later, a batch of its own


async def test_a_batch_that_fails_as_a_whole_is_recorded_item_by_item() -> None:
    seen: list[list[str]] = []

    def record(items: list[str]) -> list[str | Exception]:
        seen.append(list(items))
        if "bad" in items:
            raise RuntimeError("one bad row fails the transaction")
        return [item.upper() for item in items]

    batches: Batches[str, str] = Batches(record)
    results = await asyncio.gather(
        *(batches.add(x) for x in ("a", "bad", "b")), return_exceptions=True
    )
    assert seen == [["a", "bad", "b"], ["a"], ["bad"], ["b"]]
    assert results[0] == "A" and results[2] == "B"
    assert isinstance(results[1], RuntimeError)
