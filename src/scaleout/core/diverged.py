"""A wait that can never end: a peer in ``finalize()`` never started the call.

Ranks that run different numbers of steps (data shards of different lengths, a loop that
counts its own shard's batches) leave the longer rank in a collective that the others, past
their last step, never start: they wait for it in ``finalize()``, it waits for them, and
both sides used to sit out the whole timeout (300 s by default) before a
``CommunicationTimeout`` said who lagged. A rank in ``finalize()`` whose process has
nothing in progress (no progress engine with work queued or in flight) starts no collective
again: its heartbeat says both (``scaleout.core.progress``). A wait that has blocked for
:data:`AFTER` seconds reads the heartbeats of its group's members, every :data:`EVERY`
seconds; a member in that state that started fewer collectives on the group than this rank,
seen so in two of its heartbeats, can never start this one. Then the wait's rank declares the
divergence as its own failure through the watchdog, so that it and every other rank raise
``PeerFailedError`` naming it, with the counts, within seconds. Without a watchdog
(``SCALEOUT_HEARTBEAT=0``) nothing is read and the timeout decides, as before.
"""

from __future__ import annotations

import json
import time
from typing import Any

from scaleout.core import progress, watchdog
from scaleout.core.failures import PeerFailure

__all__ = ["FinalizeWatch", "AFTER", "EVERY"]

AFTER = 3.0  # seconds a wait blocks before it reads its peers' heartbeats
EVERY = 1.0  # seconds between two reads


class FinalizeWatch:
    """For one wait on the group labelled ``group``: :meth:`check` between slices."""

    __slots__ = ("rank", "group", "operation", "_next", "_store", "_seen")

    def __init__(self, rank: int, group: str, operation: str) -> None:
        self.rank, self.group, self.operation = rank, group, operation
        self._next = time.monotonic() + AFTER
        self._store: Any = None
        self._seen: dict[int, tuple[int, Any]] = {}  # member -> (its count, its beat)

    def check(self) -> None:
        """Declare the divergence (see the module) once it is certain; cheap before
        :data:`AFTER` seconds and between reads."""
        now = time.monotonic()
        if now < self._next:
            return
        self._next = now + EVERY
        dog, mine = watchdog.active(), progress.count(self.group)
        if dog is None or mine is None or dog.failure() is not None:
            return
        total, members = mine
        try:
            if self._store is None:
                self._store = dog.connection()
            beats = {m: self._store.get_if_present(f"hb/{m}") for m in members if m != self.rank}
        except (RuntimeError, ValueError):  # (a store that does not answer: the timeout decides)
            return
        stuck = []
        for member, raw in beats.items():
            beat = json.loads(raw) if raw is not None else {}
            theirs = beat.get("calls", {}).get(self.group, [0])[0]
            if not beat.get("finalizing") or beat.get("busy") or theirs >= total:
                self._seen.pop(member, None)
                continue
            before = self._seen.setdefault(member, (theirs, beat.get("beat")))
            if before[0] == theirs and before[1] != beat.get("beat"):
                stuck.append((member, theirs))
        if stuck:
            dog.declare(PeerFailure(rank=self.rank, reason=self._why(total, stuck),
                                    detected_by=self.rank, silent_for=0.0))

    def _why(self, total: int, stuck: list[tuple[int, int]]) -> str:
        many = len(stuck) > 1
        who = ", ".join(f"rank {m} after {n}" for m, n in stuck)
        return (f"rank {self.rank} waits in {self.operation} on group {self.group}, its "
                f"collective {total} there, which {'ranks' if many else 'rank'} "
                f"{', '.join(str(m) for m, _ in stuck)} will never start: "
                f"{'they are' if many else 'it is'} in finalize() ({who} on this group), "
                "with nothing in progress. The ranks ran different numbers of steps or "
                "calls: each rank must run as many (uneven data shards? count the steps "
                "from the smallest one)")
