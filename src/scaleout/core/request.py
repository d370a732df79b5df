"""Non-blocking requests: what every collective returns."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

from scaleout.core.errors import CommunicationError, CommunicationTimeout, PeerFailedError
from scaleout.core.watchdog import wait_work

__all__ = ["Request", "completed_request", "countdown"]


class Request:
    """A collective in flight.

    ``wait()`` blocks until it completes (or its timeout passes) and returns the result;
    ``test()`` tells without blocking whether it has completed. The result is computed once.

    Args:
        works: the torch.distributed work handles making up the operation.
        finish: called once after every work completed; returns the result.
        describe: (rank, group name, operation name) for error messages.
        timeout: default seconds a ``wait()`` may block.
    """

    __slots__ = ("_works", "_finish", "_rank", "_group", "_operation", "_timeout", "_done",
                 "_result", "_signalled")

    def __init__(
        self,
        works: Sequence[Any],
        finish: Callable[[], Any],
        *,
        rank: int,
        group: str,
        operation: str,
        timeout: float,
    ) -> None:
        self._works = list(works)
        self._finish = finish
        self._rank = rank
        self._group = group
        self._operation = operation
        self._timeout = timeout
        self._done = False
        self._signalled = False  # every work reported completion through when_done
        self._result: Any = None

    @property
    def operation(self) -> str:
        return self._operation

    def _error(self, message: str, cls: type[CommunicationError] = CommunicationError):
        return cls(
            f"rank {self._rank}: {self._operation} on group {self._group} {message}",
            rank=self._rank, group=self._group, operation=self._operation,
        )

    def wait(self, timeout: float | None = None) -> Any:
        """Block until the operation completes and return its result.

        Args:
            timeout: seconds to wait at most; ``None`` uses the environment's timeout.

        Returns:
            The result tensor (for in-place operations, the tensor passed in; ``None`` where
            an operation has no result on this rank, like ``gather`` on a non-root).

        Raises:
            CommunicationTimeout: not complete within ``timeout``; names rank, group, operation.
            CommunicationError: the underlying operation failed (a peer died, say).
        """
        if self._done:
            return self._result
        limit = self._timeout if timeout is None else float(timeout)
        if limit <= 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout}")
        deadline = time.monotonic() + limit
        for work in self._works:
            remaining = max(deadline - time.monotonic(), 1e-3)
            try:
                wait_work(work, remaining, self._rank, self._group, self._operation)
            except PeerFailedError:
                raise
            except RuntimeError as err:
                if "timed out" in str(err).lower() or time.monotonic() >= deadline:
                    raise self._error(
                        f"did not complete within {limit:g} s (a peer rank may have died, "
                        "diverged, or called a different operation)", CommunicationTimeout,
                    ) from err
                raise self._error(f"failed: {err}") from err
        self._works.clear()
        self._result = self._finish()
        self._done = True
        return self._result

    def when_done(self, callback: Callable[[Request], None]) -> None:
        """Call ``callback(self)`` once every underlying work has completed (or failed).

        The callback may run on a communication thread: keep it short and thread-safe; it
        should hand the request to another thread, which then calls ``wait()``.
        """
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
                threading.Thread(target=_wait_then, args=(work, self._timeout, one_done),
                                 daemon=True, name="scaleout-waiter").start()
            else:
                future.add_done_callback(one_done)

    def test(self) -> bool:
        """True when the operation has completed (then ``wait()`` returns at once)."""
        if self._done:
            return True
        try:
            # (some gloo works never report is_completed(); their waiter thread signals)
            finished = self._signalled or all(work.is_completed() for work in self._works)
        except RuntimeError as err:
            raise self._error(f"failed: {err}") from err
        if finished:
            self.wait()
        return finished

    def __repr__(self) -> str:
        state = "done" if self._done else "pending"
        return f"<Request {self._operation} group={self._group} rank={self._rank} {state}>"


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


def completed_request(result: Any, *, rank: int, group: str, operation: str) -> Request:
    """A request that is already complete (for operations with nothing to send)."""
    return Request([], lambda: result, rank=rank, group=group, operation=operation, timeout=1.0)
