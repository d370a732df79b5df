"""One contract for everything that completes later: :class:`Request`.

Collectives, compressed exchanges, scheduled bucket jobs and the futures of DDP-style comm
hooks are all requests: ``wait(timeout)`` blocks until the result is there (or raises a
:class:`~scaleout.core.errors.CommunicationTimeout` naming rank, group and operation),
``test()`` tells without blocking, ``when_done(callback)`` reports completion to a progress
thread. Every wait in scaleout is bounded by one mechanism, a :class:`Deadline`.
"""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from datetime import timedelta
from typing import Any

from scaleout.core import stalls
from scaleout.core.errors import CommunicationError, CommunicationTimeout, PeerFailedError
from scaleout.core.checks import check_seconds
from scaleout.core.peer_waits import lagging, raise_if_failed, wait_event, wait_work

__all__ = [
    "Deadline", "Request", "WorkRequest", "FutureRequest", "ThenRequest", "completed_request",
    "countdown", "wait_all", "test_any",
]


class Deadline:
    """A point in time every wait of one operation counts down to.

    Args:
        seconds: from now; a finite number > 0.
    """

    __slots__ = ("seconds", "_at")

    def __init__(self, seconds: float) -> None:
        self.seconds = check_seconds(seconds, "timeout")
        self._at = time.monotonic() + self.seconds

    def remaining(self) -> float:
        """Seconds left (at least a millisecond, so a last poll is always possible)."""
        return max(self._at - time.monotonic(), 1e-3)

    def expired(self) -> bool:
        return time.monotonic() >= self._at

    @property
    def began(self) -> float:
        """When the countdown started (``time.monotonic()``)."""
        return self._at - self.seconds


class Request(ABC):
    """Something that completes later; the result is computed once.

    Attributes:
        operation: what it is, for errors (``"allreduce"``, ``"gradient comm of fc1"``).
        nbytes: bytes this rank handed to the communication library (traffic accounting).
    """

    def __init__(self, *, rank: int, group: str, operation: str, timeout: float,
                 nbytes: int = 0) -> None:
        self.rank = rank
        self.group = group
        self.operation = operation
        self.timeout = timeout
        self.nbytes = nbytes
        self._done = False
        self._result: Any = None

    def wait(self, timeout: float | None = None) -> Any:
        """Block until the operation completes and return its result.

        Args:
            timeout: seconds to wait at most; ``None`` uses the environment's timeout.

        Returns:
            The result (for in-place collectives, the tensor passed in; ``None`` where an
            operation has no result on this rank, like ``gather`` on a non-root).

        Raises:
            CommunicationTimeout: not complete within ``timeout``; names rank, group, operation.
            CommunicationError: the underlying operation failed (a peer died, say).
        """
        if self._done:
            return self._result
        return self.wait_until(Deadline(self.timeout if timeout is None else timeout))

    def wait_until(self, deadline: Deadline) -> Any:
        """:meth:`wait` against a deadline shared with other waits (several rounds, say)."""
        if not self._done:
            self._result = self._wait(deadline)
            self._done = True
        return self._result

    @property
    def done(self) -> bool:
        return self._done

    @abstractmethod
    def _wait(self, deadline: Deadline) -> Any:
        """Block until complete (raising :meth:`timed_out` at the deadline); the result."""

    @abstractmethod
    def test(self) -> bool:
        """True when complete (then ``wait()`` returns at once); never blocks."""

    @abstractmethod
    def when_done(self, callback: Callable[[Request], None]) -> None:
        """Call ``callback(self)`` once the operation (or its current round) has completed.

        The callback may run on a communication thread: keep it short and thread-safe; it
        should hand the request to another thread, which then calls ``test()``/``wait()``.
        """

    def then(self, finish: Callable[[Any], Any], operation: str | None = None) -> ThenRequest:
        """A request whose result is ``finish(result of this one)``."""
        return ThenRequest(self, finish, operation=operation)

    def error(self, message: str, cls: type[CommunicationError] = CommunicationError
              ) -> CommunicationError:
        """An error naming this request's rank, group and operation."""
        return cls(f"rank {self.rank}: {self.operation} on group {self.group} {message}",
                   rank=self.rank, group=self.group, operation=self.operation)

    def timed_out(self, deadline: Deadline) -> CommunicationTimeout:
        why = (stalls.why_timed_out(deadline.began, deadline.seconds) or lagging(self.group)
               or "a peer rank may have died, diverged, or called a different operation")
        err = self.error(f"did not complete within {deadline.seconds:g} s ({why})",
                         CommunicationTimeout)
        err.why = why  # type: ignore[attr-defined]
        return err  # type: ignore[return-value]

    def __repr__(self) -> str:
        state = "done" if self._done else "pending"
        return f"<{type(self).__name__} {self.operation} group={self.group} rank={self.rank} {state}>"


class WorkRequest(Request):
    """A collective started through torch.distributed: its work handles and a finish step.

    Args:
        works: the torch.distributed work handles making up the operation.
        finish: called once after every work completed; returns the result.
    """

    def __init__(self, works: Sequence[Any], finish: Callable[[], Any], **describe: Any) -> None:
        super().__init__(**describe)
        self._works = list(works)
        self._finish = finish
        self._signalled = False  # every work reported completion through when_done

    def _wait(self, deadline: Deadline) -> Any:
        for work in self._works:
            try:  # in slices: a peer's failure seen by the watchdog ends the wait at once
                wait_work(work, deadline.remaining(), self.rank, self.group, self.operation)
            except PeerFailedError:
                raise
            except RuntimeError as err:
                if "timed out" in str(err).lower() or deadline.expired():
                    raise self.timed_out(deadline) from err
                raise self.error(f"failed: {err}") from err
        self._works.clear()
        return self._finish()

    def test(self) -> bool:
        if self._done:
            return True
        try:
            # (some gloo works never report is_completed(); their waiter thread signals)
            finished = self._signalled or all(work.is_completed() for work in self._works)
        except RuntimeError as err:
            raise self.error(f"failed: {err}") from err
        if finished:
            self.wait()
        else:
            raise_if_failed(self.rank, self.group, self.operation)
        return finished

    def when_done(self, callback: Callable[[Request], None]) -> None:
        if not self._works:
            callback(self)
            return

        def finished() -> None:
            self._signalled = True
            callback(self)

        one_done = countdown(len(self._works), finished)
        for work in self._works:
            try:
                future = work.get_future()
            except RuntimeError:  # some gloo works (reduce_scatter) have no future
                threading.Thread(target=_wait_then, args=(work, self.timeout, one_done),
                                 daemon=True, name="scaleout-waiter").start()
            else:
                future.add_done_callback(one_done)


class FutureRequest(Request):
    """A ``torch.futures.Future`` (what DDP comm hooks return) as a request."""

    def __init__(self, future: Any, **describe: Any) -> None:
        super().__init__(**describe)
        self._future = future
        self._event = threading.Event()
        future.add_done_callback(lambda _f: self._event.set())

    def _wait(self, deadline: Deadline) -> Any:
        if not wait_event(self._event, deadline.remaining(), self.rank, self.group,
                          self.operation):
            raise self.timed_out(deadline)
        try:
            return self._future.value()
        except RuntimeError as err:
            raise self.error(f"failed: {err}") from err

    def test(self) -> bool:
        if self._event.is_set():
            self.wait()
            return True
        return False

    def when_done(self, callback: Callable[[Request], None]) -> None:
        self._future.add_done_callback(lambda _f: callback(self))


class ThenRequest(Request):
    """``finish`` applied to another request's result (see :meth:`Request.then`)."""

    def __init__(self, inner: Request, finish: Callable[[Any], Any], *,
                 operation: str | None = None) -> None:
        super().__init__(rank=inner.rank, group=inner.group,
                         operation=operation or inner.operation, timeout=inner.timeout,
                         nbytes=inner.nbytes)
        self.inner = inner
        self._finish = finish

    def _wait(self, deadline: Deadline) -> Any:
        result = self.inner.wait_until(deadline)
        self.nbytes = self.inner.nbytes  # known once an exchange has run all its rounds
        return self._finish(result)

    def test(self) -> bool:
        if self._done:
            return True
        if self.inner.test():
            self.wait()
            return True
        return False

    def when_done(self, callback: Callable[[Request], None]) -> None:
        self.inner.when_done(lambda _r: callback(self))


class _Completed(Request):
    def _wait(self, deadline: Deadline) -> Any:  # pragma: no cover - done at construction
        return self._result

    def test(self) -> bool:
        return True

    def when_done(self, callback: Callable[[Request], None]) -> None:
        callback(self)


def completed_request(result: Any, *, rank: int, group: str, operation: str) -> Request:
    """A request that is already complete (for operations with nothing to send)."""
    request = _Completed(rank=rank, group=group, operation=operation, timeout=1.0)
    request._result, request._done = result, True
    return request


def wait_all(requests: Iterable[Request], timeout: float | None = None) -> list[Any]:
    """Wait for every request against one deadline; their results, in order.

    ``timeout=None`` gives each request its own default timeout.
    """
    requests = list(requests)
    if timeout is None:
        return [request.wait() for request in requests]
    deadline = Deadline(timeout)
    return [request.wait_until(deadline) for request in requests]


def test_any(requests: Iterable[Request]) -> int | None:
    """The index of the first completed request, or ``None``; never blocks."""
    for index, request in enumerate(requests):
        if request.test():
            return index
    return None


def countdown(count: int, then: Callable[[], None]) -> Callable[[Any], None]:
    """A thread-safe callback that calls ``then()`` on its ``count``-th call.

    For "all of these completed" on completions that arrive on several threads.
    """
    remaining = [count]
    lock = threading.Lock()

    def one_done(_item: Any) -> None:
        with lock:
            remaining[0] -= 1
            last = remaining[0] == 0
        if last:
            then()

    return one_done


def _wait_then(work: Any, timeout: float, callback: Callable[[Any], None]) -> None:
    try:
        work.wait(timeout=timedelta(seconds=timeout))
    except RuntimeError:
        pass  # the failure is raised again by Request.wait()
    callback(None)
