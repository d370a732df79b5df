"""ParameterSet: one weight tensor's gradient communication (MLSL's ParameterSet)."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

import torch

from scaleout.compression import as_config
from scaleout.core import collectives
from scaleout.core.collectives import Communicator
from scaleout.core.distribution import Distribution
from scaleout.core.grid import GroupType
from scaleout.core.request import Request
from scaleout.session.statistics import Statistics

__all__ = ["ParameterSetSpec", "ParameterSet", "owned_range"]


def owned_range(numel: int, size: int, rank: int) -> tuple[int, int]:
    """MLSL's owned slice of a sharded update: ``(offset, count)`` with count =
    ceil(numel / size) per rank (the last ranks' slices may be short or empty)."""
    count = math.ceil(numel / size)
    return min(rank * count, numel), count


@dataclass(frozen=True, kw_only=True)
class ParameterSetSpec:
    """What to register for one weight tensor.

    Attributes:
        count: global number of elements (across the model group).
        dtype: element type of the gradients.
        distributed_update: shard the update over the data group (reduce-scatter the
            gradients, update the owned slice, all-gather the increments).
        compression: a codec, codec spec string or CompressionConfig for the gradients
            (``None``: exact); parsed on construction (a bad spec raises here).
        name: for statistics and errors.
        shape: the tensor's shape, if it has one (low-rank codecs need matrices); its
            product must equal ``count``.
        device: where its gradients live (the bucket's buffer is allocated there);
            ``None``: the CPU. DataParallel passes each parameter's device.
        model_split: ``count`` is global and each rank of the model group holds
            ``count / model parts`` of it (MLSL); ``False``: every rank of the model group
            holds the whole tensor (a replicated parameter of a model-parallel network, such
            as a row-parallel bias or a LayerNorm), so ``local_count == count``.
    """

    count: int
    dtype: torch.dtype = torch.float32
    distributed_update: bool = False
    compression: Any = None
    name: str = ""
    shape: tuple[int, ...] | None = None
    device: torch.device | str | None = None
    model_split: bool = True

    def __post_init__(self) -> None:
        if self.compression is not None:
            object.__setattr__(self, "compression", as_config(self.compression, min_numel=0))
        try:
            object.__setattr__(self, "device", torch.device(self.device or "cpu"))
        except (RuntimeError, TypeError) as err:
            raise ValueError(f"ParameterSetSpec.device must name a torch device, got "
                             f"{self.device!r}") from err
        if isinstance(self.count, bool) or not isinstance(self.count, int) or self.count < 1:
            raise ValueError(f"ParameterSetSpec.count must be an int >= 1, got {self.count!r}")
        if not isinstance(self.dtype, torch.dtype) or not self.dtype.is_floating_point:
            raise TypeError(f"ParameterSetSpec.dtype must be a floating torch.dtype, got {self.dtype!r}")
        if not isinstance(self.name, str):
            raise TypeError(f"ParameterSetSpec.name must be a str, got {self.name!r}")
        for flag in ("distributed_update", "model_split"):  # ("no" would be true)
            if not isinstance(getattr(self, flag), bool):
                raise TypeError(f"ParameterSetSpec.{flag} must be a bool, got "
                                f"{getattr(self, flag)!r}")
        if self.distributed_update and self.compression is not None and self.compression.lossy:
            raise ValueError("ParameterSetSpec: compression with distributed_update=True is not "
                             "supported: the sharded update reduce-scatters the gradient and "
                             "the codecs exchange whole buckets; use one or the other")
        if self.shape is not None:
            object.__setattr__(self, "shape", _checked_shape(self.shape, self.count))


def _checked_shape(shape: object, count: int) -> tuple[int, ...]:
    """``shape`` as a tuple of positive ints whose product is ``count`` (``()``: a scalar)."""
    if not isinstance(shape, (tuple, list)) or not all(
            isinstance(dim, int) and not isinstance(dim, bool) for dim in shape):
        raise TypeError(f"ParameterSetSpec.shape must be a tuple of ints (a tensor's shape) "
                        f"or None, got {shape!r}")
    if any(dim < 1 for dim in shape):
        raise ValueError(f"ParameterSetSpec.shape must have positive dimensions, got {shape!r}")
    if math.prod(shape) != count:
        raise ValueError(f"ParameterSetSpec.shape {tuple(shape)} has {math.prod(shape)} "
                         f"elements, but count is {count}")
    return tuple(shape)


class ParameterSet:
    """Gradient (and, with distributed update, increment) communication of one weight tensor.

    Counts follow MLSL: ``global_count`` over the model group, ``local_count`` =
    global / model parts on this rank, and with distributed update ``owned_count`` =
    ceil(local / data-group size) elements owned by this rank at ``owned_offset``.

    Per iteration: ``start_gradient_comm(grad)``, then ``wait_gradient_comm()`` returns the
    gradient averaged over the data group (with distributed update, only the owned slice);
    with distributed update, ``start_increment_comm(new_owned_values)`` then
    ``wait_increment_comm()`` returns the full local tensor.
    """

    def __init__(self, spec: ParameterSetSpec, *, op_name: str, op_index: int, index: int,
                 distribution: Distribution, statistics: Statistics) -> None:
        model_parts = distribution.size(GroupType.MODEL) if spec.model_split else 1
        if spec.count % model_parts != 0:
            raise ValueError(
                f"parameter set {spec.name or index} of {op_name}: count {spec.count} "
                f"must be divisible by the model group size {model_parts}"
            )
        self.spec = spec
        self.op_name = op_name
        self.op_index = op_index
        self.index = index
        self.distribution = distribution
        self.statistics = statistics
        self.name = spec.name or f"{op_name}.{index}"
        self.global_count = spec.count
        self.local_count = spec.count // model_parts
        if spec.distributed_update:
            self.owned_offset, self.owned_count = owned_range(
                self.local_count, distribution.size(GroupType.DATA),
                distribution.rank(GroupType.DATA))
        else:
            self.owned_count, self.owned_offset = self.local_count, 0
        self.bucket: Any = None  # its GradBucket, bound by Session.commit()
        self.increment_comm: Communicator | None = None
        self.test_phase = False  # set by a TEST-phase Session.commit(): no gradients to send
        self._started = False
        self._increment: Request | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        """The gradient's shape on this rank (flat when the model group splits it)."""
        if self.spec.shape and self.local_count == self.global_count:
            return tuple(self.spec.shape)
        return (self.local_count,)

    @property
    def owned_valid(self) -> int:
        """Elements of the owned slice that exist (the last rank's slice may be short)."""
        return max(min(self.owned_count, self.local_count - self.owned_offset), 0)

    def _require_committed(self, what: str) -> Any:
        if self.bucket is None and self.test_phase:
            raise RuntimeError(f"{what} on {self.name}: gradients are not exchanged in a "
                               "TEST-phase session; register the operation with a "
                               "Phase.TRAIN session to communicate its gradients")
        if self.bucket is None:
            raise RuntimeError(f"{what} on {self.name}: call session.commit() first")
        return self.bucket

    def _check(self, tensor: object, count: int, what: str) -> torch.Tensor:
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{what} on {self.name}: expected a torch.Tensor, got "
                            f"{type(tensor).__name__}")
        if tensor.dtype != self.spec.dtype:
            raise TypeError(f"{what} on {self.name}: expected dtype {self.spec.dtype}, got {tensor.dtype}")
        if tensor.numel() != count:
            raise ValueError(f"{what} on {self.name}: expected {count} elements, got "
                             f"{tensor.numel()} (shape {tuple(tensor.shape)})")
        return tensor

    def start_gradient_comm(self, gradient: torch.Tensor) -> None:
        """Hand this iteration's local gradient (``local_count`` elements) to the scheduler.

        The tensor is copied; it may be reused as soon as this returns.

        Raises:
            TypeError/ValueError: wrong type, dtype or element count.
            RuntimeError: started twice without a wait, before ``commit()``, or in a
                TEST-phase session.
            CommunicationError: the progress engine is closed or stopped (the set is then
                not started).
        """
        bucket = self._require_committed("start_gradient_comm")
        self._check(gradient, self.local_count, "start_gradient_comm")
        if self._started:
            raise RuntimeError(f"start_gradient_comm on {self.name}: already started this "
                               "iteration; call wait_gradient_comm() first")
        bucket.fill(self, gradient)
        self._started = True  # only now: a failed start leaves nothing to wait for

    def wait_gradient_comm(self, timeout: float | None = None) -> torch.Tensor:
        """Block until the gradient is averaged over the data group; return it.

        Returns:
            ``local_count`` elements (``owned_valid`` with distributed update): a view of a
            communication buffer, valid until the next ``start_gradient_comm``.
        """
        bucket = self._require_committed("wait_gradient_comm")
        if not self._started:
            raise RuntimeError(f"wait_gradient_comm on {self.name}: start_gradient_comm was "
                               "not called this iteration")
        began = time.perf_counter()
        bucket.wait(timeout)
        self._exposed(began)
        self._started = False
        return bucket.result(self)

    def _exposed(self, began: float) -> None:
        now = time.perf_counter()
        self.statistics.add(self.op_name, exposed_s=now - began)
        if self.statistics.trace is not None:
            self.statistics.trace.span("wait", self.op_name, began, now)

    def test_gradient_comm(self) -> bool:
        """True once the gradient communication completed (``wait`` then returns at once)."""
        bucket = self._require_committed("test_gradient_comm")
        return self._started and bucket.job.test()

    @property
    def gradient_pending(self) -> bool:
        return self._started

    def start_increment_comm(self, owned: torch.Tensor) -> None:
        """All-gather this rank's updated owned slice (``owned_valid`` elements).

        Raises:
            TypeError/ValueError: wrong type, dtype or element count.
            RuntimeError: the set has no distributed update, the session is not committed,
                or an increment was started and not yet waited for (before stop 51 the
                second start replaced the first, whose all-gather was never waited for).
        """
        if not self.spec.distributed_update:
            raise RuntimeError(f"start_increment_comm on {self.name}: the set was not "
                               "registered with distributed_update=True")
        self._require_committed("start_increment_comm")
        owned = self._check(owned, self.owned_valid, "start_increment_comm")
        if self._increment is not None:
            raise RuntimeError(f"start_increment_comm on {self.name}: already started; call "
                               "wait_increment_comm() first")
        padded = owned.new_zeros(self.owned_count)
        padded[: owned.numel()] = owned.reshape(-1)
        self._increment = collectives.allgather(self.increment_comm, padded)

    def wait_increment_comm(self, timeout: float | None = None) -> torch.Tensor:
        """The full local tensor (``local_count`` elements) after every rank's update."""
        if self._increment is None:
            raise RuntimeError(f"wait_increment_comm on {self.name}: no increment started")
        began = time.perf_counter()
        gathered = self._increment.wait(timeout)
        self._exposed(began)
        self._increment = None
        return gathered[: self.local_count]

    def __repr__(self) -> str:
        return (f"<ParameterSet {self.name} global={self.global_count} local={self.local_count}"
                f" owned={self.owned_count}@{self.owned_offset}>")
