"""An authenticated rendezvous: only processes holding the job token can join or use the store.

Rank 0 creates the ``TCPStore`` itself, on a socket bound to ``MASTER_ADDR``'s interface
(torch's own server listens on every interface; torch 2.13 accepts a listening socket as
``master_listen_fd``, with its libuv server too). Every rank wraps it in an
:class:`AuthStore`: key names are keyed hashes under a namespace derived from the token,
values are sealed with AES-GCM (:mod:`scaleout.launch.secret`). A process without the token
therefore cannot find, read or forge the job's entries; what it writes lands outside the
namespace, where rank 0 sees it and reports it.

Joining (:func:`rendezvous`): rank 0 writes a fresh salt (values from an earlier job with the
same token are refused, and an earlier attempt's in a store that outlives it) and its world
size; each rank compares its own (another size is refused at once, on both sides), claims its
rank number (a counter: a second claimant is refused) and writes a sealed join record; rank 0
verifies every record and the claims, then admits (or rejects) the job with a sealed verdict
every rank waits for.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from datetime import timedelta

import torch.distributed as tdist

from scaleout.core.errors import ScaleoutError
from scaleout.launch.environment import LaunchInfo, machine
from scaleout.launch.secret import ForgedValue, Sealer, namespace

__all__ = ["AuthStore", "Rendezvous", "rendezvous", "bound_store", "machine"]

_SALT = 16
#: what the salt's entry holds once the job that read it was admitted (a salt is _SALT bytes)
_ADMITTED = b"admitted"
#: rank 0's store server per address, served for the process's lifetime: a job initialised
#: again in this process (``finalize()`` then ``init()``) meets in it again
_served: dict[tuple[int, str, int], tdist.TCPStore] = {}  # (pid, address, port)
#: the entry where a rank that counts another world size than rank 0 says so
_OTHER_WORLD = "other-world"


def bound_store(info: LaunchInfo, timeout: float, *, agent_store: bool = False) -> tdist.TCPStore:
    """Rank 0: a store server listening on ``master_addr`` only; other ranks: a client.

    ``agent_store``: the launcher already serves a store there (torchrun's agent does, and
    says so with ``TORCHELASTIC_USE_AGENT_STORE=True``): every rank is a client of it.
    """
    wait = timedelta(seconds=timeout)
    try:  # (every rank: a name that does not resolve fails at once, not at the timeout)
        family, kind, proto, _, address = socket.getaddrinfo(
            info.master_addr, info.master_port, type=socket.SOCK_STREAM)[0]
    except OSError as err:  # socket.gaierror
        raise ScaleoutError(
            f"rank {info.rank}: cannot resolve the rendezvous host {info.master_addr!r} "
            f"({err.strerror or err}): MASTER_ADDR must name rank 0's host") from err
    if info.rank != 0 or agent_store:
        return tdist.TCPStore(info.master_addr, info.master_port, None, False, timeout=wait)
    where = (os.getpid(), info.master_addr, info.master_port)
    kept = _served.get(where)
    if kept is not None:  # (since stop 52: this port was still its own; "already in use")
        kept.set_timeout(wait)
        return kept
    listener = socket.socket(family, kind, proto)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(address)
        listener.listen(1024)
        store = tdist.TCPStore(info.master_addr, info.master_port, None, True, timeout=wait,
                               wait_for_workers=False, master_listen_fd=listener.fileno())
    except OSError as err:
        listener.close()
        raise ScaleoutError(
            f"rank 0: cannot listen on {info.master_addr}:{info.master_port} for the rendezvous "
            f"({err.strerror}): MASTER_ADDR must be an address of rank 0's host and the port "
            "free") from err
    listener.detach()  # the store's server owns the socket now
    _served[where] = store
    return store


#: what :meth:`AuthStore.get_if_present` reads for an absent entry (a sealed value is at
#: least a 12-byte nonce and a 16-byte tag)
_ABSENT = b"\0absent"


class AuthStore(tdist.Store):
    """A store whose keys are hidden and whose values are sealed with the job token.

    ``add`` counters cannot be sealed (the server adds them): they live under hidden names
    but are not authenticated. torch.distributed and gloo use only set/get/wait/check.
    """

    def __init__(self, raw: tdist.Store, sealer: Sealer) -> None:
        super().__init__()
        self._raw = raw
        self._sealer = sealer

    @property
    def sealer(self) -> Sealer:
        return self._sealer

    def set(self, key: str, value: bytes | str) -> None:
        data = value.encode() if isinstance(value, str) else bytes(value)
        self._raw.set(self._sealer.name(key), self._sealer.seal(key, data))

    def get(self, key: str) -> bytes:
        return self._sealer.open(key, self._raw.get(self._sealer.name(key)))

    def get_if_present(self, key: str) -> bytes | None:
        """``key``'s value, or ``None`` at once when it is absent. ``get`` would wait for it
        until the store's timeout, and a client whose request timed out reads the late answer
        as the next one's: an entry deleted by an outsider between a ``check`` and a ``get``
        spent the watchdog's connection. ``compare_set`` with the same marker as expected and
        new value answers without waiting and changes nothing: the marker is shorter than
        any sealed value, so it comes back only for an absent entry (or one an outsider set
        to it, which is no more a value of the job's than a deleted one)."""
        found = bytes(self._raw.compare_set(self._sealer.name(key), _ABSENT, _ABSENT))
        return None if found == _ABSENT else self._sealer.open(key, found)

    def add(self, key: str, amount: int) -> int:
        return self._raw.add(self._sealer.name(key), amount)

    def check(self, keys: list[str]) -> bool:
        return self._raw.check([self._sealer.name(key) for key in keys])

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        names = [self._sealer.name(key) for key in keys]
        if timeout is None:
            self._raw.wait(names)
        else:
            self._raw.wait(names, timeout)

    def delete_key(self, key: str) -> bool:
        return self._raw.delete_key(self._sealer.name(key))

    def num_keys(self) -> int:
        return self._raw.num_keys()

    def set_timeout(self, timeout: timedelta) -> None:
        self._raw.set_timeout(timeout)

    @property
    def timeout(self) -> timedelta:
        return self._raw.timeout


class Rendezvous:
    """The job's authenticated store and, on rank 0, the report of outsiders' attempts."""

    def __init__(self, raw: tdist.Store, store: AuthStore, token: str, rank: int,
                 launcher_keys: frozenset[str] = frozenset()) -> None:
        self.raw = raw
        self.store = store
        self.rank = rank
        self._prefix = namespace(token) + "/"
        self._reported: set[str] = set(launcher_keys)  # the launcher's own: not outsiders

    def connection(self, timeout: float) -> AuthStore:
        """A second connection to the store whose operations give up after ``timeout`` s
        (for a watchdog, which must not block behind a frozen store host)."""
        raw = self.raw.clone()
        raw.set_timeout(timedelta(seconds=timeout))
        return AuthStore(raw, self.store.sealer)

    def peer(self, rank: int) -> dict[str, object]:
        """Rank ``rank``'s join record: its pid, host name and machine()."""
        return json.loads(self.store.get(f"join/{rank}"))

    def outsiders(self) -> list[str]:
        """Store keys written by processes without the token, not reported before (nor
        written by the launcher before the job joined its store)."""
        new = sorted(k for k in _keys(self.raw)
                     if not k.startswith(self._prefix) and k not in self._reported)
        self._reported.update(new)
        return new

    def report_outsiders(self) -> list[str]:
        """Print (stderr) and return the outsiders' new keys, if any."""
        new = self.outsiders()
        if new:
            shown = ", ".join(repr(k) for k in new[:5]) + (" ..." if len(new) > 5 else "")
            sys.stderr.write(f"scaleout: rank {self.rank}: a process without the job token "
                             f"tried to join: it wrote {len(new)} store entries ({shown}); "
                             "they were ignored\n")
            sys.stderr.flush()
        return new


def _keys(raw: tdist.Store) -> list[str]:
    """Every key of the store (none where the store cannot list them)."""
    try:
        return raw.list_keys()
    except (RuntimeError, NotImplementedError):
        return []


def _salt_key(token: str, attempt: int) -> str:
    return f"{namespace(token)}/salt/{attempt}"


def _salt(raw: tdist.Store, token: str, rank: int, attempt: int, timeout: float) -> bytes:
    """Rank 0 chooses the job's salt; the others knock (in their token's namespace, where
    rank 0 sees a wrong token's knock as an outsider's) and read it. Each attempt has its
    own: torchrun's agent keeps its store across restarts, where a rank could read the
    last attempt's salt before rank 0 replaced it, and so that attempt's entries. Each join
    has its own too: rank 0 replaces the salt by :data:`_ADMITTED` once every rank has read it
    (:func:`rendezvous`), so a rank joining the store again (``init()`` after ``finalize()``)
    waits for the next job's, whichever of its processes re-joined and which are fresh, and
    a late duplicate of an admitted job is told so at its timeout (since stop 52: a
    per-process join counter chose the entry, and a re-initialised rank 0 and restarted
    workers read different salts: a failed authentication or a hang)."""
    key = _salt_key(token, attempt)
    raw.add(f"{namespace(token)}/knock/{rank}", 1)
    if rank == 0:
        salt = os.urandom(_SALT)
        raw.set(key, salt)
        return salt
    raw.wait([key])
    value = bytes(raw.get(key))
    if value != _ADMITTED:
        return value
    # the last job on this store was admitted: this rank is a worker of the next (rank 0
    # re-initialising writes a fresh salt) or a late duplicate of that job: wait for the salt
    deadline = time.monotonic() + timeout
    while value == _ADMITTED:
        if time.monotonic() > deadline:
            raise ScaleoutError(
                f"rank {rank}: the job on this store was already admitted (every rank joined "
                f"it) and no new job started within {timeout:g} s: another process joined as "
                f"rank {rank} before this one (a duplicate), or rank 0 did not initialise again")
        time.sleep(0.05)
        value = bytes(raw.get(key))
    return value


def rendezvous(info: LaunchInfo, token: str, timeout: float, *,
               agent_store: bool = False, attempt: int = 0) -> Rendezvous:
    """Create the store, authenticate every rank and return the job's :class:`Rendezvous`.

    ``agent_store``: join the launcher's store instead of serving one (see :func:`bound_store`).
    ``attempt``: the launcher's restart count (``TORCHELASTIC_RESTART_COUNT``): a store that
    outlives an attempt (torchrun's agent's) holds that attempt's entries, ignored.

    Raises:
        ScaleoutError: the store cannot be reached or created, a rank number is claimed
            twice, a rank counts another world size than rank 0 (at once, not at the
            timeout), or an entry does not authenticate (an outsider forged it, or a rank has
            another token); on every rank, with the reason rank 0 found.
    """
    rank, world = info.rank, info.world_size
    raw = bound_store(info, timeout, agent_store=agent_store)
    # torchrun's agent wrote its own entries (``<run>/torchelastic/...``) before it started
    # the ranks: what its store holds before rank 0's first write is the launcher's.
    launcher_keys = frozenset(_keys(raw)) if agent_store and rank == 0 else frozenset()
    sealer = Sealer(token, _salt(raw, token, rank, attempt, timeout))
    store = AuthStore(raw, sealer)
    if rank == 0:
        store.set("world", str(world))
    else:
        _same_world(store, rank, world)
    claims = store.add(f"claim/{rank}", 1)
    if claims != 1:
        raise ScaleoutError(f"rank {rank}/{world}: another process already joined this job "
                            f"as rank {rank} ({claims} claims): a duplicate or an impostor")
    store.set(f"join/{rank}", json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                          "machine": machine()}))
    job = Rendezvous(raw, store, token, rank, launcher_keys)
    if rank == 0:
        refused = _verify(job, world, timeout)
        # every rank of this job read the salt (it sealed its claim): a later join waits for
        # the next job's, or is told this one was admitted
        raw.set(_salt_key(token, attempt), _ADMITTED)
        store.set("admitted", json.dumps({"refused": refused}))
    try:
        store.wait(["admitted"])
        refused = json.loads(store.get("admitted"))["refused"]
    except ForgedValue as err:
        raise ScaleoutError(f"rank {rank}/{world}: the rendezvous was not authenticated: "
                            f"{err}") from err
    if refused:
        raise ScaleoutError(f"rank {rank}/{world}: rank 0 refused the job: {refused}")
    return job


def _same_world(store: AuthStore, rank: int, world: int) -> None:
    """A rank other than 0: refuse to join when rank 0 counts another world size, leaving
    rank 0 a note (this rank may be one it does not wait for: past its world)."""
    try:
        world_0 = int(store.get("world"))
    except ForgedValue as err:
        raise ScaleoutError(f"rank {rank}/{world}: the rendezvous was not authenticated: "
                            f"{err}") from err
    if world_0 != world:
        store.set(_OTHER_WORLD, _other_world(rank, world, world_0))
        raise ScaleoutError(f"rank {rank}/{world}: {_other_world(rank, world, world_0)}")


def _joined(store: AuthStore, key: str, timeout: float) -> str | None:
    """Rank 0: wait for ``key`` (at most ``timeout`` s, then the store's timeout error); or
    return sooner the note of a rank that counts another world size (:func:`_same_world`)."""
    deadline = time.monotonic() + timeout
    while not store.check([key]):
        note = store.get_if_present(_OTHER_WORLD)
        if note is not None:
            return note.decode()
        if time.monotonic() > deadline:
            store.wait([key], timedelta(seconds=0.001))  # (raises the store's timeout error)
        time.sleep(0.05)
    return None


def _other_world(rank: int, world: int, world_0: int) -> str:
    """Why a rank that counts ``world`` ranks cannot join rank 0's job of ``world_0``."""
    return (f"rank {rank} joined with a world size of {world}, rank 0 with {world_0}: every "
            "rank must be given the same (scaleout run: the same -n and --nnodes on every "
            "node; else WORLD_SIZE)")


def _verify(job: Rendezvous, world: int, timeout: float) -> str:
    """Rank 0: why the job must be refused ("" to admit it), and report outsiders."""
    for peer in range(world):
        other = _joined(job.store, f"join/{peer}", timeout)
        if other is not None:  # (a rank of another world size: refused at once)
            return other
        try:
            json.loads(job.store.get(f"join/{peer}"))
        except ForgedValue as err:
            return f"rank {peer}'s join record: {err}"
    for peer in range(world):
        claims = job.store.add(f"claim/{peer}", 0)
        if claims != 1:
            return f"rank {peer} was claimed by {claims} processes (a duplicate or an impostor)"
    job.report_outsiders()
    return ""
