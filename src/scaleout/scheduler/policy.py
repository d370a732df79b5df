"""Scheduling policies: given the lanes' state, which lane sends its next chunk now.

The order of chunks *within* a lane is fixed by the plan (the same on every rank, so the
collectives match); a policy only decides *when* each lane may send its next chunk. That
keeps every rank's sequence of collectives identical however differently timed the ranks are.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

from scaleout.scheduler.config import SchedulerConfig

__all__ = ["LaneState", "Policy", "FifoPolicy", "PriorityPolicy", "make_policy"]


@dataclass(frozen=True)
class LaneState:
    """What a policy sees of one lane.

    Attributes:
        queued: chunks ready to send, in order.
        next_bytes: bytes of the next queued chunk (0 if none).
        inflight: chunks sent and not yet complete.
        inflight_bytes: their bytes.
        blocked: a multi-round exchange owns the lane until it completes (its rounds and
            other chunks must not interleave differently on different ranks).
    """

    queued: int
    next_bytes: int
    inflight: int
    inflight_bytes: int
    blocked: bool = False

    @property
    def can_send(self) -> bool:
        return self.queued > 0 and not self.blocked


class Policy(ABC):
    """Decides which lane sends next."""

    @abstractmethod
    def choose(self, lanes: Sequence[LaneState]) -> int | None:
        """The lane whose next chunk should be sent now, or ``None`` to wait."""


class FifoPolicy(Policy):
    """Everything in one lane, sent the moment it is ready (DDP's behaviour)."""

    def choose(self, lanes: Sequence[LaneState]) -> int | None:
        return 0 if lanes[0].can_send else None


class PriorityPolicy(Policy):
    """Strict lane priority with chunk-level pre-emption and a credit for bulk lanes.

    Lane 0 (parameters the next forward needs first) sends at once. A lower lane sends
    its next chunk only while no higher lane has anything queued or in flight, and only
    while its own bytes in flight stay within ``credit_bytes`` — so urgent data waits behind
    at most one credit's worth of bulk data. With several channels per lane, each channel
    may carry one chunk whatever the credit (urgent data has channels of its own).
    """

    def __init__(self, credit_bytes: int, channels: int = 1) -> None:
        self.credit_bytes = credit_bytes
        self.channels = channels

    def choose(self, lanes: Sequence[LaneState]) -> int | None:
        for index, lane in enumerate(lanes):
            if index == 0:
                if lane.can_send:
                    return 0
            elif lane.can_send and (lane.inflight < self.channels
                                    or lane.inflight_bytes + lane.next_bytes <= self.credit_bytes):
                return index
            if lane.queued or lane.inflight:
                return None  # lower lanes wait for this one
        return None


def make_policy(config: SchedulerConfig, channels: int = 1) -> Policy:
    """The policy object for ``config.policy``, over lanes of ``channels`` communicators."""
    if config.policy == "fifo":
        return FifoPolicy()
    return PriorityPolicy(config.credit_bytes, channels)
