"""StreamCoalescer (an engine replica's items for one request, in lists at most every interval), without Ray: items
put from another thread come out in order and complete; within the interval they ride together; the end of a
sequence or a failure goes at once with everything before it; a bad interval is refused."""

from __future__ import annotations

import asyncio
import math
import threading
import time

import pytest
from logitproc.serve.engine_loop import RequestFailed
from logitproc.serve.outputs import Delta, FinishReason
from logitproc.serve.ray_stream import StreamCoalescer


def delta(i: int, finish: bool = False) -> Delta:
    return Delta("r", 0, text=f"t{i}", token_ids=[i], finish_reason=FinishReason.LENGTH if finish else None)


async def produce(coalescer: StreamCoalescer, items: list, gap_s: float) -> None:
    """``items`` put from a thread of their own (as the engine's), ``gap_s`` apart."""
    def run() -> None:
        for item in items:
            coalescer.put(item)
            time.sleep(gap_s)

    await asyncio.to_thread(run)


async def received(coalescer: StreamCoalescer, count: int) -> list[tuple[float, list]]:
    """(when, list) of each ``get()`` until ``count`` items came."""
    lists, got = [], 0
    while got < count:
        items = await coalescer.get()
        lists.append((time.monotonic(), items))
        got += len(items)
    return lists


@pytest.mark.parametrize("interval_s", [0.0, 0.05])
def test_every_item_arrives_once_in_order(interval_s) -> None:
    items = [delta(i) for i in range(40)] + [delta(40, finish=True)]

    async def run() -> list[tuple[float, list]]:
        coalescer = StreamCoalescer(asyncio.get_running_loop(), interval_s)
        consumer = asyncio.ensure_future(received(coalescer, len(items)))
        await produce(coalescer, items, 0.002)
        return await consumer

    lists = asyncio.run(run())
    assert [item for _, got in lists for item in got] == items
    assert all(got for _, got in lists)
    if interval_s:  # 41 items over >= 80 ms: a list at most every 50 ms (the end at once), so a few lists
        assert len(lists) <= 6


def test_items_within_the_interval_ride_together_and_the_first_goes_at_once() -> None:
    async def run() -> tuple[float, list[tuple[float, list]]]:
        coalescer = StreamCoalescer(asyncio.get_running_loop(), 0.3)
        consumer = asyncio.ensure_future(received(coalescer, 5))
        started = time.monotonic()
        await produce(coalescer, [delta(i) for i in range(5)], 0.01)
        return started, await consumer

    started, lists = asyncio.run(run())
    (first_at, first), (second_at, second) = lists
    assert first == [delta(0)] and first_at - started < 0.2  # at once, not after the interval
    assert second == [delta(i) for i in range(1, 5)]
    assert second_at - first_at >= 0.3 - 0.01  # held until the interval since the first list had passed


@pytest.mark.parametrize("last", [delta(3, finish=True), RequestFailed("r", "the engine failed")])
def test_the_end_goes_at_once_with_everything_before_it(last) -> None:
    async def run() -> list[tuple[float, list]]:
        coalescer = StreamCoalescer(asyncio.get_running_loop(), 1.0)
        consumer = asyncio.ensure_future(received(coalescer, 4))
        await produce(coalescer, [delta(0), delta(1), delta(2), last], 0.01)
        return await consumer

    started = time.monotonic()
    lists = asyncio.run(run())
    assert [got for _, got in lists] == [[delta(0)], [delta(1), delta(2), last]]
    assert lists[-1][0] - started < 0.6  # not held for the 1 s interval


def test_a_cancelled_wait_leaves_the_items_for_no_one_and_puts_still_work() -> None:
    async def run() -> list:
        coalescer = StreamCoalescer(asyncio.get_running_loop(), 0.5)
        coalescer.put(delta(0))
        assert await coalescer.get() == [delta(0)]
        coalescer.put(delta(1))
        waiting = asyncio.ensure_future(coalescer.get())  # held for the interval
        await asyncio.sleep(0.01)
        waiting.cancel()  # (the replica's stream cancelled: its client left)
        with pytest.raises(asyncio.CancelledError):
            await waiting
        await asyncio.to_thread(coalescer.put, delta(2, finish=True))
        return await coalescer.get()

    assert asyncio.run(run()) == [delta(1), delta(2, finish=True)]


@pytest.mark.parametrize("interval_s", [-0.001, math.nan, math.inf])
def test_a_bad_interval_is_refused(interval_s) -> None:
    loop = asyncio.new_event_loop()
    try:
        with pytest.raises(ValueError, match="stream interval must be a finite number of seconds >= 0"):
            StreamCoalescer(loop, interval_s)
    finally:
        loop.close()


def test_put_from_many_threads_loses_nothing() -> None:
    async def run() -> list:
        coalescer = StreamCoalescer(asyncio.get_running_loop(), 0.001)
        consumer = asyncio.ensure_future(received(coalescer, 400))
        threads = [threading.Thread(target=lambda k=k: [coalescer.put(delta(k * 100 + i)) for i in range(100)])
                   for k in range(4)]
        for thread in threads:
            thread.start()
        await asyncio.to_thread(lambda: [thread.join() for thread in threads])
        return [item for _, got in await consumer for item in got]

    got = asyncio.run(run())
    assert sorted(item.token_ids[0] for item in got) == list(range(400))
    for k in range(4):  # each thread's items in its order
        mine = [item.token_ids[0] for item in got if item.token_ids[0] // 100 == k]
        assert mine == sorted(mine)
