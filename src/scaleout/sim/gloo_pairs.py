"""Gloo's point-to-point protocol over TCP, as a fluid model: why some collectives serialise.

Gloo (``gloo/transport/tcp/pair.cc``) sends an unbound buffer only once the peer has posted
the matching receive: ``recv`` writes a *recv-ready* notification to the peer, and a ``send``
with no recv-ready in hand waits until one arrives. The notification travels in the same
per-pair FIFO as the data (the pair's ``tx_`` queue, then the socket): a rank that posts
``send`` before ``recv`` on a pair whose peer is already waiting starts sending at once, and
its own recv-ready leaves only after that data. So on a pair that carries data both ways the
two directions run one after the other, unless both recv-readies left before any data:

* ``gloo/alltoall.cc`` posts, for ``i = 1..p-1``, ``send(rank+i)`` then ``recv(rank-i)``;
* ``gloo/allgather.cc`` (a ring) posts ``send(right)`` then ``recv(left)`` for two half
  chunks, then one pair per step after waiting for the one before last; at ``p = 2``
  left and right are the same peer;
* ``gloo/allreduce.cc`` posts ``recv`` before ``send``: both directions run at once.

Once ranks are out of step, the pattern keeps them so: the early rank's recv-ready reaches
the late one right behind the early rank's last data, so it is there before the late rank
posts its next send (measured on the 1 Gbit/s testbed, 2 ranks, 16 MB each way as one
message: 270-279 ms send-first, 135-147 ms recv-first, 108-142 ms one way;
docs/simulator.md, "Validation").

The model: each directed pair is a FIFO of data and notifications; data at the head of a
FIFO is on the wire, sharing its sender's egress and its receiver's ingress equally with the
other flows there (each ``bandwidth``); a notification costs only ``latency``, as does the
last byte of a message; a send completes when its last byte is on the wire, a receive when
it has arrived. Arrivals at an instant are handled before a rank acts on them (gloo's device
thread reads the socket while the rank's thread is woken).

Example:
    >>> t = call_time("alltoall", 2, 16e6, bandwidth=1e8, latency=1e-4)
    >>> round(t, 2)  # 8 MB each way, one direction after the other (0.08 s at once)
    0.16
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

__all__ = ["KINDS", "Post", "PROGRAMS", "alltoall_program", "allgather_program",
           "exchange_program", "run", "call_time"]

_EPS = 1e-12  # seconds
_BYTE_EPS = 1e-6  # bytes left that count as sent
KINDS = ("send", "recv", "wait_send", "wait_recv", "end")


@dataclass(frozen=True)
class Post:
    """One step of a rank's program.

    Attributes:
        kind: ``"send"``, ``"recv"`` (post one), ``"wait_send"``, ``"wait_recv"`` (wait for
            the next completion, in gloo's ``waitSend`` / ``waitRecv`` sense), ``"end"`` (a
            call ends: the rank's time is recorded).
        peer: the other rank (send / recv).
        nbytes: bytes of the message (send / recv).
        slot: the call's tag: messages match per (pair, slot), in order.
    """

    kind: str
    peer: int = -1
    nbytes: float = 0.0
    slot: int = 0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"step kind must be one of {KINDS}, got {self.kind!r}")
        if self.kind in ("send", "recv") and (self.peer < 0 or self.nbytes < 0):
            raise ValueError(f"a {self.kind} needs a peer >= 0 and bytes >= 0, got "
                             f"{self.peer}, {self.nbytes}")


def alltoall_program(rank: int, ranks: int, nbytes: float, slot: int = 0) -> list[Post]:
    """``gloo/alltoall.cc`` for ``nbytes`` in per rank: ``p-1`` sends then receives of
    ``nbytes/p``, ``send(rank+i)`` before ``recv(rank-i)``, then wait for all."""
    chunk = nbytes / ranks
    out: list[Post] = []
    for i in range(1, ranks):
        out.append(Post("send", (rank + i) % ranks, chunk, slot))
        out.append(Post("recv", (rank - i) % ranks, chunk, slot))
    out += [Post("wait_send"), Post("wait_recv")] * (ranks - 1)
    return out + [Post("end")]


def allgather_program(rank: int, ranks: int, nbytes: float, slot: int = 0) -> list[Post]:
    """``gloo/allgather.cc`` for an output of ``nbytes``: each rank's ``nbytes/p`` goes round
    the ring in two halves; two (send right, recv left) pairs are in flight, each later pair
    posted after waiting for the one before last."""
    right, left = (rank + 1) % ranks, (rank - 1) % ranks
    piece = nbytes / ranks
    halves = (piece / 2, piece - piece / 2)
    out: list[Post] = []
    for i in range((ranks - 1) * 2):
        if i >= 2:
            out += [Post("wait_send"), Post("wait_recv")]
        size = halves[i & 1]
        out += [Post("send", right, size, slot), Post("recv", left, size, slot)]
    out += [Post("wait_send"), Post("wait_recv")] * 2
    return out + [Post("end")]


def exchange_program(rank: int, ranks: int, nbytes: float, slot: int = 0) -> list[Post]:
    """scaleout's receive-first exchange (``scaleout.core.pairwise.exchange_blocks``) of
    ``nbytes/p`` with every peer: a receive from each peer (``rank-i``) posted first, then a
    send to each (``rank+i``), then wait for all. Every recv-ready leaves before any data, so
    both directions of a pair run at once. scaleout's all-to-all and reduce-scatter send
    block ``j`` of ``nbytes`` to rank ``j``; its 2-rank all-gather sends its own block of
    an ``nbytes`` output: the same messages."""
    chunk = nbytes / ranks
    out = [Post("recv", (rank - i) % ranks, chunk, slot) for i in range(1, ranks)]
    out += [Post("send", (rank + i) % ranks, chunk, slot) for i in range(1, ranks)]
    out += [Post("wait_recv"), Post("wait_send")] * (ranks - 1)
    return out + [Post("end")]


PROGRAMS: dict[str, Callable[[int, int, float, int], list[Post]]] = {
    "alltoall": alltoall_program,
    "allgather": allgather_program,
    "exchange": exchange_program,
}


class _Rank:
    def __init__(self, program: list[Post], start: float) -> None:
        self.program, self.pc, self.start = program, 0, start
        self.sends_done = self.recvs_done = self.send_waits = self.recv_waits = 0
        self.ends: list[float] = []


def run(programs: Sequence[list[Post]], *, bandwidth: float, latency: float,
        starts: Sequence[float] | None = None) -> list[list[float]]:
    """Run one program per rank; return, per rank, the time each ``"end"`` was reached.

    Args:
        programs: each rank's steps.
        bandwidth: bytes/s of every rank's egress and of its ingress.
        latency: seconds from a message's last byte (or a notification) leaving to arriving.
        starts: when each rank starts (default all at 0).

    Raises:
        ValueError: a non-positive bandwidth, a negative latency, ``starts`` not one per rank,
            a peer that is not a rank, or programs that deadlock.
    """
    if bandwidth <= 0 or latency < 0:
        raise ValueError(f"need bandwidth > 0 and latency >= 0, got {bandwidth}, {latency}")
    p = len(programs)
    starts = [0.0] * p if starts is None else list(starts)
    if len(starts) != p:
        raise ValueError(f"need one start per rank ({p}), got {len(starts)}")
    if any(post.peer >= p or post.peer == r for r, prog in enumerate(programs) for post in prog
           if post.kind in ("send", "recv")):
        raise ValueError(f"every send and recv needs a peer among the other {p - 1} ranks")
    ranks = [_Rank(list(prog), starts[r]) for r, prog in enumerate(programs)]
    fifo: dict[tuple[int, int], deque[list]] = {}  # (src, dst) -> [["data"|"note", bytes, slot]]
    pending: dict[tuple[int, int, int], deque[float]] = {}  # (src, dst, slot): sends' bytes
    ready: dict[tuple[int, int, int], int] = {}  # (src, dst, slot): recv-readies src holds
    flying: list[tuple[float, str, int, int, int]] = []  # (arrival, what, src, dst, slot)
    now = 0.0

    def enqueue(src: int, dst: int, item: list) -> None:
        fifo.setdefault((src, dst), deque()).append(item)

    def send_data(src: int, dst: int, nbytes: float, slot: int) -> None:
        key = (src, dst, slot)
        if ready.get(key, 0) > 0:
            ready[key] -= 1
            enqueue(src, dst, ["data", nbytes, slot])
        else:
            pending.setdefault(key, deque()).append(nbytes)

    def step_rank(r: int) -> bool:
        rank, moved = ranks[r], False
        while rank.pc < len(rank.program) and now >= rank.start - _EPS:
            post = rank.program[rank.pc]
            if post.kind == "send":
                send_data(r, post.peer, post.nbytes, post.slot)
            elif post.kind == "recv":
                enqueue(r, post.peer, ["note", 0.0, post.slot])
            elif post.kind == "wait_send":
                if rank.sends_done <= rank.send_waits:
                    break
                rank.send_waits += 1
            elif post.kind == "wait_recv":
                if rank.recvs_done <= rank.recv_waits:
                    break
                rank.recv_waits += 1
            else:  # "end"
                rank.ends.append(now)
            rank.pc += 1
            moved = True
        return moved

    while True:
        changed = True
        while changed:  # arrivals first, then heads of FIFOs, then ranks, until quiet
            changed = False
            for arrival in [f for f in flying if f[0] <= now + _EPS]:
                flying.remove(arrival)
                _, what, src, dst, slot = arrival
                if what == "data":
                    ranks[dst].recvs_done += 1
                else:  # dst learns that src will receive: dst may send to src
                    key = (dst, src, slot)
                    if pending.get(key):
                        enqueue(dst, src, ["data", pending[key].popleft(), slot])
                    else:
                        ready[key] = ready.get(key, 0) + 1
                changed = True
            for (src, dst), queue in fifo.items():
                while queue and (queue[0][0] == "note" or queue[0][1] <= _BYTE_EPS):
                    what, _, slot = queue.popleft()
                    if what == "data":
                        ranks[src].sends_done += 1
                    flying.append((now + latency, what, src, dst, slot))
                    changed = True
            for r in range(p):
                changed |= step_rank(r)
        if all(rank.pc == len(rank.program) for rank in ranks):
            return [rank.ends for rank in ranks]
        active = [(s, d) for (s, d), q in fifo.items() if q]
        egress = [sum(1 for s, _ in active if s == r) for r in range(p)]
        ingress = [sum(1 for _, d in active if d == r) for r in range(p)]
        rates = {(s, d): bandwidth / max(egress[s], ingress[d]) for s, d in active}
        times = [fifo[key][0][1] / rate for key, rate in rates.items()]
        times += [f[0] - now for f in flying]
        times += [rank.start - now for rank in ranks if rank.start > now + _EPS]
        if not times:
            raise ValueError("the programs deadlock: a wait no message can satisfy")
        dt = max(min(times), 0.0)
        for key, rate in rates.items():
            fifo[key][0][1] -= rate * dt
        now += dt


def call_time(op: str, ranks: int, nbytes: float, *, bandwidth: float, latency: float,
              iterations: int | None = None, budget: float = 0.05) -> float:
    """Seconds per call of ``op`` as ``bench collectives`` times it: after a barrier, the
    calls back to back, the slowest rank's time divided by their number.

    The ranks leave the barrier out of step: rank 0 first, the others one ``latency`` later.
    Any skew of at least one notification's latency gives the same steady time per call,
    whichever rank is late (tested); at 3 ranks the first call's time depends on which is
    (all-to-all: 1.5x or 2x the textbook time), and the bench's blocks of 2 calls (16 and
    64 MB) include it. Ranks within less than one latency of each other exchange both ways
    at once. On
    this 2-core machine a rank woken from the barrier takes longer than that to run (2-3
    ranks and other work share the cores), which is the assumption. ``iterations``
    defaults to the bench's own choice: ``budget`` over one call's time, at least 2.

    Raises:
        ValueError: an op not in :data:`PROGRAMS`, or fewer than 2 ranks.
    """
    if op not in PROGRAMS:
        raise ValueError(f"op must be one of {', '.join(PROGRAMS)}, got {op!r}")
    if ranks < 2:
        raise ValueError(f"need at least 2 ranks, got {ranks}")
    starts = [0.0] + [latency] * (ranks - 1)

    def timed(calls: int) -> float:
        programs = [[post for call in range(calls) for post in PROGRAMS[op](r, ranks, nbytes, call)]
                    for r in range(ranks)]
        ends = run(programs, bandwidth=bandwidth, latency=latency, starts=starts)
        return max(e[-1] - s for e, s in zip(ends, starts)) / calls

    if iterations is None:
        iterations = int(min(max(budget / max(timed(1), 1e-6), 2), 1000))
    return timed(max(iterations, 1))

