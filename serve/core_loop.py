"""CoreLoop: the one place where threads meet the engine core: their commands queue here, one thread at a time drives.

The engine core (``engine_core.py``: the scheduler, the model step, the KV cache, the statistics) is single-threaded:
only the thread that holds the drive touches it. Any other thread reaches it through this loop: ``call(fn)`` queues
``fn`` as a command and returns its result once it ran, ``post(command)`` queues one without waiting. The driving
thread runs the queued commands before each step and before it gives the drive up, so commands run between steps,
in the order they were queued, and none is left behind. There is no thread of its own: a thread that queues a command
while no thread drives takes the drive and runs it itself (``Engine.generate`` without a server runs on the caller's
thread), and the caller of a step (``Engine.step``, a ``stream`` waiting for its deltas) takes the drive for that step.
A thread may also hold the drive for as long as it likes (``take_drive``: ``Engine.driving``): the server's
``EngineLoop`` thread drives so for the engine's life, so every command, its own bookkeeping included, runs there.

Each step's deltas go out through here too: to the inbox of the stream that watches their request, or to the
``unclaimed`` list that ``Engine.step()`` returns. All of this state (commands, the driver, the inboxes, the count of
steps) is guarded by one condition, which every waiting thread waits on.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from typing import TypeVar

from .outputs import Delta

T = TypeVar("T")

#: A queued command: it runs on the driving thread and must not raise (``call`` wraps its function so).
Command = Callable[[], None]


class CoreLoop:
    """Commands in, deltas out, and the drive: at most one thread at a time drives the engine core."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._commands: deque[Command] = deque()
        self._driver: int | None = None  # the thread driving the core, or None
        #: Steps run so far (a ``step()`` caller that waited for another thread's step returns its deltas).
        self.steps = 0
        self._inboxes: dict[str, deque[Delta] | None] = {}  # a watched request's deltas (None: its stream closed)
        self._unclaimed: list[Delta] = []

    # ---------------------------------------------------------------------------------------------- commands
    @property
    def driving(self) -> bool:
        """Whether the calling thread drives the core (it may touch the core directly)."""
        return self._driver == threading.get_ident()

    def call(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the driving thread between steps and return its result (or raise its exception); on the
        driving thread itself, at once. With no thread driving, this one drives while it runs the queued commands."""
        if self.driving:
            return fn()
        if self.try_drive():  # nobody drives: the commands queued before it, then it, here
            try:
                self.run_commands()
                return fn()
            finally:
                self.release()
        future: Future[T] = Future()

        def command() -> None:
            try:
                future.set_result(fn())
            except BaseException as err:  # handed to the caller, on its thread
                future.set_exception(err)

        self.post(command)
        return future.result()

    def post(self, command: Command) -> None:
        """Queue ``command`` (it must not raise) and return: the driving thread runs it before its next step, or
        before it gives the drive up; with no thread driving, this thread runs it now (and any queued before it)."""
        with self._cond:
            self._commands.append(command)
            if self._driver is not None:
                self._cond.notify_all()  # a driver waiting for work wakes
                return
            self._driver = threading.get_ident()
        self.release()

    def run_commands(self) -> None:
        """(The driver) run the queued commands, keeping the drive."""
        while True:
            with self._cond:
                if not self._commands:
                    return
                command = self._commands.popleft()
            command()

    def wait_for_command(self) -> None:
        """(The driver) wait until a command is queued (e.g. a grammar compiled on another thread joins)."""
        with self._cond:
            while not self._commands:
                self._cond.wait()

    # ---------------------------------------------------------------------------------------------- the drive
    def drive_unless(self, done: Callable[[], bool]) -> bool:
        """Wait until ``done()`` (checked under the loop's condition: return False) or until no thread drives (take
        the drive: return True; the caller gives it up with ``release``)."""
        with self._cond:
            if self._driver == threading.get_ident():
                raise RuntimeError("this thread drives the engine already (a command may not wait for a step)")
            while not done() and self._driver is not None:
                self._cond.wait()
            if done():
                return False
            self._driver = threading.get_ident()
            return True

    def take_drive(self) -> None:
        """Wait until no thread drives, then drive (the caller gives it up with ``release``)."""
        self.drive_unless(lambda: False)

    def try_drive(self) -> bool:
        """Take the drive if no thread drives (True; the caller gives it up with ``release``), else False."""
        with self._cond:
            if self._driver is not None:
                return False
            self._driver = threading.get_ident()
            return True

    def release(self) -> None:
        """(The driver) run the queued commands, then give the drive up: no command is left behind."""
        try:
            while True:
                with self._cond:
                    if not self._commands:
                        self._driver = None
                        self._cond.notify_all()
                        return
                    command = self._commands.popleft()
                command()
        except BaseException:  # a command broke its promise not to raise: the drive is still given up
            self.release()
            raise

    # ---------------------------------------------------------------------------------------------- deltas
    def watch(self, request_id: str) -> None:
        """(The driver) route the request's deltas to its inbox (``take``), not to ``step()``'s caller."""
        with self._cond:
            self._inboxes[request_id] = deque()

    def deliver(self, deltas: Iterable[Delta], is_done: Callable[[str], bool]) -> None:
        """(The driver) hand a step's deltas out and count the step; a closed stream's ended request is forgotten
        (``is_done``: the core's answer)."""
        with self._cond:
            for delta in deltas:
                inbox = self._inboxes.get(delta.request_id, self._unclaimed)
                if inbox is not None:
                    inbox.append(delta)
            for rid in [rid for rid, inbox in self._inboxes.items() if inbox is None and is_done(rid)]:
                del self._inboxes[rid]
            self.steps += 1
            self._cond.notify_all()

    def inbox_ready(self, request_id: str) -> bool:
        """(Under the condition, for ``drive_unless``) whether the watched request has deltas waiting."""
        return bool(self._inboxes.get(request_id))

    def take(self, request_id: str) -> list[Delta]:
        """The watched request's waiting deltas (emptied)."""
        with self._cond:
            inbox = self._inboxes.get(request_id)
            if not inbox:
                return []
            items = list(inbox)
            inbox.clear()
            return items

    def close(self, request_id: str) -> None:
        """The request's stream closed: its deltas still to come are dropped."""
        with self._cond:
            if request_id in self._inboxes:
                self._inboxes[request_id] = None

    def forget(self, request_id: str) -> None:
        """(The driver, once the request ended) drop its inbox."""
        with self._cond:
            self._inboxes.pop(request_id, None)

    def take_unclaimed(self) -> list[Delta]:
        """The deltas of unwatched requests since the last call."""
        with self._cond:
            deltas, self._unclaimed = self._unclaimed, []
            return deltas

    def step_ran_since(self, seen: int) -> Callable[[], bool]:
        """A ``drive_unless`` condition: a step ran since the count was ``seen``."""
        return lambda: self.steps != seen
