"""CoreLoop, the engine's one meeting point of threads, on data (no model): commands from any thread run one at a
time on the driving thread, between its steps; with no thread driving, the caller drives; none is left behind."""

from __future__ import annotations

import threading
import time

import pytest
from logitproc.serve.core_loop import CoreLoop
from logitproc.serve.outputs import Delta


def test_with_no_thread_driving_a_call_runs_on_the_callers_thread() -> None:
    loop = CoreLoop()
    assert loop.call(threading.get_ident) == threading.get_ident()
    assert loop.try_drive()  # given up after the call
    loop.release()


def test_a_call_while_another_thread_drives_runs_on_that_thread_when_it_runs_its_commands() -> None:
    loop = CoreLoop()
    assert loop.try_drive()
    ran_on: list[int] = []
    caller = threading.Thread(target=lambda: ran_on.append(loop.call(threading.get_ident)))
    caller.start()
    time.sleep(0.2)
    assert not ran_on  # queued: the driver is busy (in a step)
    loop.run_commands()
    caller.join(timeout=10)
    assert ran_on == [threading.get_ident()]
    loop.release()


def test_commands_queued_while_driving_run_before_the_drive_is_given_up() -> None:
    loop = CoreLoop()
    assert loop.try_drive()
    order: list[str] = []
    posters = [threading.Thread(target=loop.post, args=(lambda i=i: order.append(f"c{i}"),)) for i in range(3)]
    for t in posters:
        t.start()
        t.join()  # post returns at once: the driver runs it
    assert order == []
    loop.release()
    assert order == ["c0", "c1", "c2"]


def test_exceptions_reach_the_caller_and_the_drive_is_given_up() -> None:
    loop = CoreLoop()
    with pytest.raises(ValueError, match="bad request"):
        loop.call(lambda: (_ for _ in ()).throw(ValueError("bad request")))
    assert loop.try_drive()
    loop.release()


def test_exactly_one_thread_at_a_time_touches_the_core() -> None:
    """Eight threads each run 200 commands and steps on a shared, deliberately non-atomic counter: no update is lost
    and no two threads are ever inside at once."""
    loop = CoreLoop()
    state = {"inside": 0, "most": 0, "count": 0}

    def touch() -> None:
        state["inside"] += 1
        state["most"] = max(state["most"], state["inside"])
        value = state["count"]
        time.sleep(0)  # let another thread run here, if it could
        state["count"] = value + 1
        state["inside"] -= 1

    def work(t: int) -> None:
        for i in range(200):
            if i % 3 == 0 and loop.drive_unless(lambda: False):  # a "step" of this thread's own
                touch()
                loop.release()
            elif i % 3 == 1:
                loop.post(touch)
            else:
                loop.call(touch)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    if loop.try_drive():
        loop.release()  # (the last posted commands, if any, ran before the drive was given up)
    assert state["most"] == 1 and state["count"] == 8 * 200


def test_deltas_go_to_their_watchers_inbox_or_to_the_unclaimed_list() -> None:
    loop = CoreLoop()
    assert loop.try_drive()
    loop.watch("streamed")
    loop.deliver([Delta("streamed", 0, "a", [1]), Delta("stepped", 0, "b", [2])], is_done=lambda rid: False)
    loop.release()
    assert loop.steps == 1
    assert [d.text for d in loop.take("streamed")] == ["a"] and loop.take("streamed") == []
    assert [d.request_id for d in loop.take_unclaimed()] == ["stepped"] and loop.take_unclaimed() == []
    loop.close("streamed")  # its later deltas are dropped; once its request ended its inbox goes
    assert loop.try_drive()
    loop.deliver([Delta("streamed", 0, "c", [3])], is_done=lambda rid: True)
    loop.release()
    assert loop.take("streamed") == [] and loop.take_unclaimed() == []


def test_a_driver_waiting_for_a_step_of_its_own_is_refused() -> None:
    loop = CoreLoop()
    assert loop.try_drive()
    with pytest.raises(RuntimeError, match="drives the engine already"):
        loop.drive_unless(lambda: False)
    loop.release()


def test_a_thread_holding_the_drive_runs_every_command_queued_meanwhile() -> None:
    """``take_drive`` (the server's loop, for the engine's life): commands from other threads queue, wake the driver
    waiting for one, and run on it; ``call`` from another thread waits for it; what is left runs as it lets go."""
    loop = CoreLoop()
    loop.take_drive()
    answers: list[int] = []
    caller = threading.Thread(target=lambda: answers.append(loop.call(threading.get_ident)))
    caller.start()
    loop.wait_for_command()  # the call's command wakes it
    loop.run_commands()
    caller.join(timeout=10)
    assert answers == [threading.get_ident()]
    left: list[int] = []
    poster = threading.Thread(target=loop.post, args=(lambda: left.append(threading.get_ident()),))
    poster.start()
    poster.join(timeout=10)
    assert left == []  # queued: still held
    loop.release()
    assert left == [threading.get_ident()]


def test_take_drive_waits_for_the_thread_driving() -> None:
    loop = CoreLoop()
    assert loop.try_drive()
    took = threading.Event()

    def take() -> None:
        loop.take_drive()
        took.set()
        loop.release()

    taker = threading.Thread(target=take)
    taker.start()
    time.sleep(0.1)
    assert not took.is_set()
    loop.release()
    taker.join(timeout=10)
    assert took.is_set()
