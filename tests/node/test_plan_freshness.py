"""How old a peer's record may be before the plans (swarm/node/plan.py) take its peer for dead:
three missed renewals, at the pace our own records are renewed (progress.freshness), which the
progress book measures from its own stores."""

from __future__ import annotations

import asyncio

import pytest

from swarm.node import progress
from swarm.node.progress import OwnProgress, ProgressBook, freshness, publish_delay
from tests.dht.refusing import refusing_dht

pytestmark = pytest.mark.timeout(30)

FRESHNESS_CASES = [
    # (situation, publish interval, the oldest our own record grew lately, seconds a record is fresh)
    ("quiet, renewed on time: three missed renewals and 2 s", 0.5, 0.5, 3.5),
    ("nothing stored twice yet: the interval", 3.0, 0.0, 11.0),
    ("renewed a little late: no stretch below the interval", 3.0, 2.0, 11.0),
    ("ours went 1.5 s between renewals (0.5 s interval): so may a live peer's", 0.5, 1.5, 6.5),
    ("ours went 30 s between renewals: at most twice the quiet window", 3.0, 30.0, 22.0),
]  # fmt: skip


@pytest.mark.parametrize(("what", "interval", "gap", "fresh"), FRESHNESS_CASES, ids=[c[0] for c in FRESHNESS_CASES])
def test_records_are_fresh_for_three_renewals_at_the_pace_ours_are_renewed(
    what: str, interval: float, gap: float, fresh: float
) -> None:
    assert freshness(interval, gap) == pytest.approx(fresh)


OWN = OwnProgress(maddrs=[], client=True, step=4, inner=1, H=8, sec_per_step=0.25, train_loss=None,
                  eval_loss=None, tokens_per_s=None, group_size=1)  # fmt: skip


async def test_the_book_stretches_freshness_by_its_own_late_renewals_over_a_window(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A renewal that comes late, or is stored nowhere, leaves our record older: the book
    measures how old (renewal_gap), peers' records are fresh for longer meanwhile, and back to
    the quiet window once that renewal is RENEWAL_WINDOW behind us."""
    monkeypatch.setattr(progress, "RENEWAL_WINDOW", 2.0)
    monkeypatch.setattr("swarm.dht.store_retry.STORE_BACKOFF", 0.01)
    async with refusing_dht(refuse=0) as dht:
        book = ProgressBook(dht.client, "run", publish_interval=0.05)
        quiet = 3 * 0.05 + 2.0
        assert await book.publish(OWN) and book.fresh_for == pytest.approx(quiet)
        await asyncio.sleep(0.5)
        dht.refuse = 10**6  # this renewal is stored nowhere: our record grows older still
        assert not await book.publish(OWN)
        await asyncio.sleep(0.5)
        dht.refuse = 0
        assert await book.publish(OWN)
        late = book.renewal_gap
        assert late >= 1.0 and book.fresh_for == freshness(0.05, late) and book.fresh_for > quiet

        async def renew_on_time(seconds: float) -> None:
            loop = asyncio.get_running_loop()
            until = loop.time() + seconds
            while loop.time() < until:
                assert await book.publish(OWN)
                await asyncio.sleep(0.1)

        await renew_on_time(1.0)
        assert book.renewal_gap == late  # within the window, the late renewal still counts
        await renew_on_time(1.2)  # renewed on time for longer than the window: it drops out
        assert await book.publish(OWN)
        assert book.renewal_gap < late and book.fresh_for < freshness(0.05, late)


PUBLISH_CASES = [
    # (situation, the last publication began, now, interval, seconds until the next)
    ("it took no time: a whole interval", 10.0, 10.0, 3.0, 3.0),
    ("it took 1 s of a 3 s interval: 2 s more, not 3", 10.0, 11.0, 3.0, 2.0),
    ("it took longer than the interval: a quarter of it, not at once", 10.0, 14.0, 3.0, 0.75),
    ("at a 0.5 s interval, a 1.28 s store: 0.125 s", 0.0, 1.28, 0.5, 0.125),
]  # fmt: skip


@pytest.mark.parametrize(("what", "began", "now", "interval", "delay"), PUBLISH_CASES,
                         ids=[c[0] for c in PUBLISH_CASES])  # fmt: skip
def test_records_are_published_an_interval_from_the_last_start(
    what: str, began: float, now: float, interval: float, delay: float
) -> None:
    assert publish_delay(began, now, interval) == pytest.approx(delay), what
