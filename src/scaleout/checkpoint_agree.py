"""How the ranks of a :mod:`scaleout.checkpoint` save or load agree with each other.

Every exchange is a tensor all-gather on the default process group (never a pickle), a
scaleout collective: watched (a peer that fails meanwhile is named) and bounded by the
Environment's timeout:

- :func:`agree_on_version`: every rank names the same version of the checkpoint (a shared
  file system can show ranks different versions for a while);
- :func:`agreed`: a step that may fail on some ranks only (a rank's file is missing or
  unreadable, one rank's ``extra`` cannot be saved) raises the same error on every rank, so
  that no rank resumes (or writes) while another starts from scratch;
- :func:`first_exchange`: the first exchange of a save or load, whose timeout means that
  some rank did not call it (``if rank == 0: checkpoint.save(...)``, a DDP habit).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as tdist

from scaleout.core.collectives import Communicator, allgather
from scaleout.core.consistency import exchange_device, tensor_text, text_tensor
from scaleout.core.env import attach
from scaleout.core.errors import PeerFailedError

__all__ = ["IncompleteCheckpointError", "agree_on_version", "agreed", "first_exchange"]

T = TypeVar("T")

_MESSAGE_BYTES = 2048  # an error's text travels as bytes in a fixed-size tensor


class IncompleteCheckpointError(ValueError):
    """The checkpoint exists but a rank's file is missing or unreadable (not "no checkpoint":
    a ``FileNotFoundError`` says that). Raised on every rank; nothing was restored."""


_CODES: dict[int, type[Exception]] = {1: IncompleteCheckpointError, 2: ValueError, 3: TypeError,
                                      4: RuntimeError}


def _world() -> int:
    if tdist.is_available() and tdist.is_initialized():
        return tdist.get_world_size()
    return 1


def _all_gather(mine: torch.Tensor) -> list[torch.Tensor]:
    """Every rank's ``mine``: a scaleout all-gather on the job's group, so a peer that dies or
    freezes meanwhile is named (``PeerFailedError``), a peer in another collective is a
    mismatch, and the wait is bounded by the Environment's timeout (before: a raw
    ``tdist.all_gather``, whose errors named no rank, e.g. gloo's ``Connection reset by
    peer``, and which waited out torch's own timeout on a frozen peer)."""
    env = attach(check_consistency=None)
    comm = Communicator(group=tdist.group.WORLD, ranks=tuple(range(env.world_size)),
                        name="checkpoint", global_rank=env.rank, timeout=env.timeout,
                        check_consistency=env.check_consistency)
    return list(allgather(comm, mine.reshape(1, -1)).wait())


def first_exchange(operation: str, fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` (the operation's first collective); a timeout or a broken connection
    there says that every rank must call ``checkpoint.<operation>`` (a peer known to have
    failed is named as such instead)."""
    try:
        return fn(*args)
    except PeerFailedError:
        raise
    except RuntimeError as err:  # (torch's DistBackendError is one)
        raise RuntimeError(
            f"checkpoint.{operation}: the other ranks did not join its first exchange within the "
            f"process group's timeout: every rank of the job must call checkpoint.{operation} "
            f"(not only rank 0, as in DDP's `if rank == 0: torch.save(...)`) ({err})") from err


def agree_on_version(path: Path, current: Path | None, saved_world: int,
                     outcome: str = "nothing was loaded") -> None:
    """Raise unless every rank of the job is loading the same version of ``path`` (or every
    rank finds none): ranks that resumed from different versions would train on as if nothing
    were wrong."""
    if _world() < 2:
        return
    version = int(current.name) if current is not None else -1
    mine = torch.tensor([version, saved_world], dtype=torch.int64, device=exchange_device())
    seen = [tuple(int(v) for v in t.tolist()) for t in _all_gather(mine)]
    if len(set(seen)) > 1:
        found = ", ".join(f"rank {r}: " + (f"version {v} of {n} ranks" if v >= 0 else "none")
                          for r, (v, n) in enumerate(seen))
        raise ValueError(f"checkpoint {path}: the ranks see different versions ({found}); "
                         f"{outcome} (a shared file system that has not caught up?)")


def _code(error: BaseException | None) -> int:
    if error is None:
        return 0
    for code, kind in _CODES.items():  # the most specific first (IncompleteCheckpointError)
        if isinstance(error, kind):
            return code
    return 4


def agreed(fn: Callable[[], T]) -> T:
    """``fn()`` on every rank; if it raised on any rank, every rank raises: the lowest failing
    rank's error (the same type and text; that rank re-raises its own)."""
    try:
        result, error = fn(), None
    except Exception as err:  # noqa: BLE001 - every rank learns of it below
        result, error = None, err
    if _world() < 2:
        if error is not None:
            raise error
        return result  # type: ignore[return-value]
    mine = torch.cat([torch.tensor([_code(error)], dtype=torch.uint8),
                      text_tensor(str(error) if error is not None else "", _MESSAGE_BYTES)])
    every = [t.cpu() for t in _all_gather(mine.to(exchange_device()))]
    failed = [r for r, t in enumerate(every) if int(t[0]) != 0]
    if not failed:
        return result  # type: ignore[return-value]
    first = every[failed[0]]
    if error is not None and failed[0] == tdist.get_rank():
        raise error
    message = tensor_text(first[1:])
    kind = _CODES[int(first[0])]
    if kind is not IncompleteCheckpointError:
        message = f"on rank {failed[0]}: {message}"
    raise kind(message) from error
