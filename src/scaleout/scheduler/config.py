"""Scheduling options: which policy, bucket and chunk sizes, credits."""

from __future__ import annotations

from dataclasses import dataclass, replace

__all__ = ["SchedulerConfig", "POLICIES"]

POLICIES = ("fifo", "priority")
MB = 1 << 20


@dataclass(frozen=True, kw_only=True)
class SchedulerConfig:
    """How gradient communication is fused, split and ordered.

    Attributes:
        policy: ``"fifo"`` issues buckets in backward order as soon as they are ready (what
            DDP does); ``"priority"`` puts the parameters needed first by the next forward in
            an urgent lane that pre-empts the bulk lane at chunk boundaries. ``None`` (the
            default) is ``"priority"`` where that has something to pre-empt, else ``"fifo"``:
            ``"fifo"`` for CUDA tensors over gloo, where a bucket is not cut into chunks
            (each would be a round trip through host memory) and holding bulk buckets back
            only costs time (ResNet-18 on one H100, 2 ranks: 0.95x DDP with priority,
            1.00-1.13x with fifo; RESULTS.md, issue 11); for CPU tensors of ranks all on one
            machine (a loopback rendezvous, or a launcher that puts every rank on this node:
            the launch's ``one_machine``), whose traffic is memory copies with no link to
            share (2 ranks, against DDP: DLRM 0.76-0.83x with priority, 0.87-0.90x with
            fifo; the transformer 0.93-0.95x, 1.01-1.03x; ResNet-18 0.95-0.97x, 0.96-0.98x;
            RESULTS.md, stop 37; GPUs of one machine still share its links); and for a plan
            whose bulk lane has no bucket of several chunks
            (:func:`~scaleout.scheduler.plan_and_policy`: two lanes would then only run two
            exchanges at once on the host; DLRM on the CPU, 2 ranks: 1.3x faster at 1 and 10
            Gbit/s with fifo; RESULTS.md, stop 34).
            :meth:`resolved` and :func:`~scaleout.scheduler.plan_and_policy` make the choice.
        bucket_bytes: small parameter sets are fused into buckets up to this size.
        first_bucket_bytes: size of the first bucket (ready earliest in backward), so that
            communication starts early (DDP uses 1 MB).
        partition_bytes: bulk buckets are sent in chunks of this size (priority policy).
        credit_bytes: at most this many bulk bytes in flight (priority policy); a newly
            ready urgent bucket waits behind at most this much.
        urgent_bytes: parameters in forward order up to this many bytes form the urgent
            lane (priority policy).
        channels: communicators per lane; a lane's buckets take them in turn, so up to this
            many buckets of a lane are on the wire at once (each channel may have one in
            flight whatever the credit). ``None`` (the default) is 2 for CUDA tensors over
            gloo, where one gloo stream (device-to-host copy, ring, copy back) leaves the link
            idle much of the time (two streams moved 45 MB in 12-14 ms instead of 21-26 ms
            on one H100 host: RESULTS.md, issue 11), else 1.

    The defaults keep at most ~32 ms of bulk data queued ahead of urgent data on a 1 Gbit/s
    link (4 MB credit) and ~3 ms on 10 Gbit/s, while chunks stay large enough (2 MB) for
    gloo to run near line rate.
    """

    policy: str | None = None
    bucket_bytes: int = 8 * MB
    first_bucket_bytes: int = 1 * MB
    partition_bytes: int = 2 * MB
    credit_bytes: int = 4 * MB
    urgent_bytes: int = 1 * MB
    channels: int | None = None

    def __post_init__(self) -> None:
        if self.policy is not None and self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        for name in ("bucket_bytes", "first_bucket_bytes", "partition_bytes", "credit_bytes",
                     "urgent_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an int >= 0, got {value!r}")
        if self.channels is not None and (isinstance(self.channels, bool)
                                          or not isinstance(self.channels, int) or self.channels < 1):
            raise ValueError(f"channels must be an int >= 1 or None, got {self.channels!r}")
        if self.partition_bytes == 0:
            raise ValueError("partition_bytes must be > 0")
        if self.credit_bytes < self.partition_bytes:
            raise ValueError(
                f"credit_bytes ({self.credit_bytes}) must be >= partition_bytes "
                f"({self.partition_bytes}), or no chunk could ever be sent"
            )

    @property
    def lanes(self) -> int:
        return 1 if self.policy == "fifo" else 2

    def resolved(self, *, cuda_over_gloo: bool, one_machine: bool = False) -> SchedulerConfig:
        """This configuration with ``channels`` chosen where left open, and ``policy`` for
        buffers that are CUDA tensors sent over gloo or CPU tensors of ranks all on one
        machine (``"fifo"``; otherwise an open policy stays open for
        :func:`~scaleout.scheduler.plan_and_policy`, which sees the plan)."""
        policy = self.policy or ("fifo" if cuda_over_gloo or one_machine else None)
        channels = self.channels or (2 if cuda_over_gloo else 1)
        return replace(self, policy=policy, channels=channels)
