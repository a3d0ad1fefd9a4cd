"""The detectors' lease (``detector.Lease``) on the real Redis: one holder at a time, whatever
the holders do in whatever order; every new holder's fencing token above all earlier ones; a
holder that stops renewing loses it to another after its time to live."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest
from django.core.management import CommandError, call_command
from hypothesis import given, settings
from hypothesis import strategies as st

from controlplane.jobs import detector, liveness

HOLDERS = 3
DEAD = -1
# what a detector does: renew or take (hold), stop cleanly (release), die (a fresh process
# takes its place, the lease left to lapse), or the lease lapses (its time to live ran out)
MOVES = st.lists(
    st.one_of(
        st.tuples(st.sampled_from(["hold", "release", "die"]), st.integers(0, HOLDERS - 1)),
        st.just(("lapse", 0)),
    ),
    max_size=30,
)


async def _play(moves: list[tuple[str, int]]) -> None:
    redis = liveness.client()
    keys = (f"test:{uuid.uuid4().hex}:lease", f"test:{uuid.uuid4().hex}:token")

    def lease(i: int) -> detector.Lease:
        return detector.Lease(redis, f"host:{i}", ttl_s=60, keys=keys)

    leases = [lease(i) for i in range(HOLDERS)]
    owner: int | None = None  # the model: who holds the lease now (DEAD: a holder that died)
    tokens: list[int] = []  # every token handed out, in order
    try:
        for move, i in moves:
            if move == "hold":
                held = await leases[i].hold()
                expected = owner is None or owner == i
                assert held == expected, (move, i, owner)
                if owner is None:
                    owner = i
                    tokens.append(leases[i].token)
                    assert tokens == sorted(set(tokens)), "tokens only ever grow"
                if held:
                    assert await redis.get(keys[0]) == f"{leases[i].token}:host:{i}"
                    assert 0 < await redis.pttl(keys[0]) <= 60_000
                else:
                    assert leases[i].token == 0
            elif move == "release":
                await leases[i].release()
                if owner == i:
                    owner = None
            elif move == "die":
                leases[i] = lease(i)  # no release: the lease stays until it lapses
                if owner == i:
                    owner = DEAD
            else:
                await redis.delete(keys[0])
                owner = None
            current = await redis.get(keys[0])
            assert sum(held.token > 0 and held.value == current for held in leases) <= 1
            assert (current is None) == (owner is None)
    finally:
        await redis.delete(*keys)
        await redis.aclose()


@settings(max_examples=60, deadline=None)
@given(MOVES)
def test_one_holder_at_a_time_and_each_new_holder_has_a_higher_token(
    moves: list[tuple[str, int]],
) -> None:
    asyncio.run(_play(moves))


@pytest.mark.asyncio
async def test_a_holder_that_stops_renewing_loses_the_lease_after_its_time_to_live() -> None:
    redis = liveness.client()
    keys = (f"test:{uuid.uuid4().hex}:lease", f"test:{uuid.uuid4().hex}:token")
    first = detector.Lease(redis, "host:1", ttl_s=0.5, keys=keys)
    second = detector.Lease(redis, "host:2", ttl_s=0.5, keys=keys)
    try:
        assert await first.hold()
        died = time.monotonic()  # the first stops renewing, as if SIGKILLed
        while not await second.hold():
            assert time.monotonic() - died < 2.0, "the lease never lapsed"
            await asyncio.sleep(0.02)
        waited = time.monotonic() - died
        assert 0.4 <= waited < 1.5, waited  # not before the time to live, soon after
        assert second.token == first.token + 1
        assert not await first.hold() and first.token == 0  # it woke up: the lease is gone
        await second.release()
        assert await first.hold()  # a clean stop hands over at once
    finally:
        await redis.delete(*keys)
        await redis.aclose()


@pytest.mark.parametrize(
    ("args", "error"),
    [
        (["--lease-ttl", "0.1"], "--lease-ttl: 0.5 to 60 seconds"),
        (["--lease-ttl", "1", "--period", "0.5"], "--period: more than 0 and at most a third"),
        (["--period", "-1"], "--period: more than 0"),
    ],
)
def test_a_lease_its_holder_could_not_renew_in_time_is_refused(args: list[str], error: str) -> None:
    with pytest.raises(CommandError, match=error):
        call_command("detect_failures", *args)
