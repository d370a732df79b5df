"""DataParallel: every layer with parameters becomes an Operation; gradients leave as they appear.

Autograd hooks hand each parameter's gradient to its ParameterSet the moment it is
accumulated; the session's scheduler fuses, prioritises and sends them on its progress
thread. With a :class:`~scaleout.pytorch.DistributedOptimizer` in overlap mode, each layer's
update is applied at the latest in that layer's forward pre-hook of the next iteration
(together with the following layers whose gradients have already arrived), so the next
forward starts while later layers' gradients are still on the wire.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from scaleout.core import collectives
from scaleout.core.collectives import ReduceOp
from scaleout.core.distribution import Distribution
from scaleout.core.grid import GroupType
from scaleout.core.env import attach
from scaleout.pytorch.layers import Layer, broadcast_tensors, find_layers
from scaleout.core.request import Request
from scaleout.scheduler import SchedulerConfig
from scaleout.session import ParameterSet, ParameterSetSpec, Phase, Session, Statistics

if TYPE_CHECKING:
    from scaleout.pytorch.optimizer import DistributedOptimizer

__all__ = ["DataParallel"]

#: The operation whose one parameter set carries, per parameter, whether this rank used it.
_USAGE = "<parameters used>"


class _Stopwatch:
    """Seconds between laps: each layer's compute runs from one hook to the next.

    A plain object rather than DataParallel attributes, because hooks lap it hundreds of
    times per iteration and every ``nn.Module.__setattr__`` costs microseconds.
    """

    __slots__ = ("_last",)

    def __init__(self) -> None:
        self._last = time.perf_counter()

    def restart(self) -> None:
        self._last = time.perf_counter()

    def lap(self) -> float:
        """Seconds since the previous lap or restart; starts the next lap."""
        now = time.perf_counter()
        elapsed, self._last = now - self._last, now
        return elapsed


class DataParallel(nn.Module):
    """Data-parallel training of ``module`` over the data group of ``distribution``.

    Args:
        module: the model. Its parameters and buffers are broadcast from data-group rank 0.
        distribution: where to train; ``None`` uses every rank of an already initialised job.
        scheduler: fusion, chunking and priority options (default: the priority policy).
        distributed_update: shard the optimizer update over the data group (the optimizer
            keeps state for 1/N of the parameters); needs a DistributedOptimizer.
        compression: a codec spec for every gradient (``"cast:bf16"``), or a dict from
            parameter-name glob pattern to spec; ``None`` sends exact gradients.
        broadcast_buffers: keep floating buffers (BatchNorm running statistics) consistent
            by averaging them over the data group after every training forward.

    Without a DistributedOptimizer (or with ``mode="sync"``) it behaves like DDP: when
    ``backward()`` returns, every ``.grad`` holds the gradient averaged over the data group.

    Example (under ``scaleout run -n 2``):
        >>> env = scaleout.init()
        >>> model = DataParallel(net, env.create_distribution())
        >>> opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model)
        >>> loss_fn(model(x), y).backward(); opt.step(); opt.zero_grad()
    """

    def __init__(self, module: nn.Module, distribution: Distribution | None = None, *,
                 scheduler: SchedulerConfig | None = None, distributed_update: bool = False,
                 compression: Any = None, broadcast_buffers: bool = True) -> None:
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
        if distribution is None:
            distribution = attach().create_distribution()
        if not isinstance(distribution, Distribution):
            raise TypeError(f"distribution must be a scaleout.Distribution, got "
                            f"{type(distribution).__name__}")
        self.module = module
        self.distribution = distribution
        self.env = distribution.env
        self._scheduler = scheduler or SchedulerConfig()
        self._distributed_update = bool(distributed_update)
        self._compression = compression
        self._compression_config()  # parse the specs now: a bad one fails at construction
        self._comm = distribution.communicator(GroupType.DATA)
        self._layers = find_layers(module)
        self._optimizer: DistributedOptimizer | None = None
        self._session: Session | None = None
        self._forward_order: list[Layer] = []
        self._pending_compression_state: dict[str, Any] = {}
        self._no_sync = False
        self._backward_queued = False
        self._used: dict[int, bool] = {}
        self._usage: ParameterSet | None = None
        self._globally_used: dict[int, bool] = {}
        broadcast_tensors(self._comm, [*module.parameters(), *module.buffers()])
        self._float_buffers = [b for b in module.buffers() if b.is_floating_point()]
        self._buffer_comm = (distribution.duplicate(GroupType.DATA, "buffers")
                             if broadcast_buffers and self._float_buffers else None)
        self._buffer_request: Request | None = None
        self._handles = []
        self._stopwatch = _Stopwatch()  # times each layer's compute (statistics)
        for layer in self._layers:
            self._handles.append(layer.module.register_forward_pre_hook(self._pre_hook(layer)))
            self._handles.append(layer.module.register_forward_hook(self._post_hook(layer)))
            for param in layer.params:
                self._used[id(param)] = False
                self._handles.append(param.register_post_accumulate_grad_hook(self._on_grad))

    # -- public ------------------------------------------------------------------------

    @property
    def statistics(self) -> Statistics:
        """Compute / communication / exposed time per layer (after the first forward)."""
        if self._session is None:
            raise RuntimeError("statistics exist after the first forward")
        return self._session.statistics

    @property
    def session(self) -> Session | None:
        """The committed session (None before the first forward)."""
        return self._session

    @property
    def layers(self) -> list[Layer]:
        return list(self._layers)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally (micro-batches); the next backward outside sends them."""
        previous, self._no_sync = self._no_sync, True
        try:
            yield
        finally:
            self._no_sync = previous

    def synchronize(self) -> None:
        """Finish every pending communication and update; afterwards all ranks agree."""
        if self._session is None:
            return
        for layer in self._forward_order:
            self._complete_layer(layer)
        if any(ps.gradient_pending for layer in self._forward_order for ps in layer.sets):
            self._gradients_to_grad()
        self._finish_buffers()

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self._finish_buffers()
        output = self.module(*args, **kwargs)
        if self._session is None:
            self._commit()
        for layer in self._forward_order:  # layers this forward did not run
            self._complete_layer(layer)
        if self.training and self._buffer_comm is not None:
            flat = torch.cat([b.detach().reshape(-1) for b in self._float_buffers])
            self._buffer_request = collectives.allreduce(self._buffer_comm, flat, ReduceOp.AVG)
        if self._session is not None:
            self._session.statistics.end_iteration()
        return output

    def train(self, mode: bool = True) -> DataParallel:
        if mode != self.training:
            self.synchronize()
        return super().train(mode)

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        self.synchronize()
        return super().state_dict(*args, **kwargs)

    def get_extra_state(self) -> dict[str, Any]:
        """Checkpointed with ``state_dict()``: the codecs' error-feedback state."""
        if self._session is None:
            return {"compression": dict(self._pending_compression_state)}
        return {"compression": self._session.compression_state_dict()}

    def set_extra_state(self, state: Any) -> None:
        """Restored by ``load_state_dict()`` (applied at the first forward if not yet built)."""
        if not isinstance(state, dict) or "compression" not in state:
            raise ValueError("DataParallel extra state must be a dict with a 'compression' entry")
        if self._session is None:
            self._pending_compression_state = dict(state["compression"])
        else:
            self._session.load_compression_state_dict(state["compression"])

    def close(self) -> None:
        """Stop the progress thread and remove the hooks."""
        if self._session is not None:
            self._session.close()
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    # -- set-up ------------------------------------------------------------------------

    def _attach_optimizer(self, optimizer: DistributedOptimizer) -> None:
        if self._optimizer is not None and self._optimizer is not optimizer:
            raise ValueError("this DataParallel already has a DistributedOptimizer")
        self._optimizer = optimizer

    def _compression_config(self) -> Any:
        if self._compression is None:
            return None
        from scaleout.compression import CompressionConfig

        spec = self._compression
        if isinstance(spec, CompressionConfig):
            return spec
        if isinstance(spec, dict):
            return CompressionConfig(codec="none", layers=spec)
        return CompressionConfig(codec=spec)

    def _commit(self) -> None:
        """Register the layers in the order the first forward ran them, then commit."""
        ran = {id(layer) for layer in self._forward_order}
        self._forward_order += [layer for layer in self._layers if id(layer) not in ran]
        session = Session(self.env, Phase.TRAIN, scheduler=self._scheduler)
        params = self._params_in_order = [p for layer in self._forward_order for p in layer.params]
        self._position = {id(layer): i for i, layer in enumerate(self._forward_order)}
        if params:
            # Registered first, so it shares the bucket of the first layers' gradients (the
            # last to be ready in backward): knowing who used what costs no collective of its own.
            spec = ParameterSetSpec(count=len(params), dtype=params[0].dtype, name=_USAGE)
            self._usage = session.add_operation(_USAGE, self.distribution,
                                                parameter_sets=[spec]).parameter_sets[0]
        names = {id(p): n for n, p in self.module.named_parameters()}
        compression = self._compression_config()
        for layer in self._forward_order:
            specs = [ParameterSetSpec(count=p.numel(), dtype=p.dtype, name=names.get(id(p), ""),
                                      distributed_update=self._distributed_update,
                                      compression=compression, shape=tuple(p.shape))
                     for p in layer.params]
            layer.op = session.add_operation(layer.name, self.distribution, parameter_sets=specs)
            layer.sets = layer.op.parameter_sets
        session.commit()
        if self._pending_compression_state:
            session.load_compression_state_dict(self._pending_compression_state)
            self._pending_compression_state = {}
        self._session = session
        self._set_of = {id(p): (layer, ps) for layer in self._forward_order
                        for p, ps in zip(layer.params, layer.sets)}

    # -- hooks -------------------------------------------------------------------------

    def _pre_hook(self, layer: Layer) -> Callable[..., None]:
        def hook(_module: nn.Module, _inputs: Any) -> None:
            if self._session is None:
                if layer not in self._forward_order:
                    self._forward_order.append(layer)
                return
            self._complete_layer(layer)
            self._stopwatch.restart()
        return hook

    def _post_hook(self, layer: Layer) -> Callable[..., None]:
        def hook(_module: nn.Module, _inputs: Any, _output: Any) -> None:
            elapsed = self._stopwatch.lap()  # backward compute is timed from here
            if self._session is not None:
                self._session.statistics.add(layer.name, compute_s=elapsed)
        return hook

    def _on_grad(self, param: nn.Parameter) -> None:
        self._used[id(param)] = True
        if self._no_sync:
            return
        if self._session is None:
            raise RuntimeError("backward ran through DataParallel before its first forward")
        if not self._backward_queued:
            self._backward_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)
        layer, ps = self._set_of[id(param)]
        self._session.statistics.add(layer.name, compute_s=self._stopwatch.lap())
        if ps.gradient_pending:
            raise RuntimeError(
                f"rank {self.env.rank}: gradient of {ps.name} produced twice before its update "
                "(two backward passes without a forward between them?); wrap all but the last "
                "micro-batch in model.no_sync()")
        ps.start_gradient_comm(param.grad)

    def _end_backward(self) -> None:
        self._backward_queued = False
        used = []
        for layer in self._forward_order:
            for param, ps in zip(layer.params, layer.sets):
                if not ps.gradient_pending:  # unused here: send zeros, keep the order
                    ps.start_gradient_comm(torch.zeros(ps.local_count, dtype=param.dtype))
                used.append(1.0 if self._used[id(param)] else 0.0)
                self._used[id(param)] = False
        assert self._usage is not None  # a gradient arrived, so there are parameters
        self._usage.start_gradient_comm(torch.tensor(used, dtype=self._usage.spec.dtype))
        if self._distributed_update:
            if self._optimizer is None:
                raise RuntimeError("DataParallel(distributed_update=True) needs a "
                                   "DistributedOptimizer to apply the sharded update")
        elif self._optimizer is None or self._optimizer.mode == "sync":
            self._gradients_to_grad()

    # -- completing communication -------------------------------------------------------

    def _used_globally(self) -> dict[int, bool]:
        """Whether any rank used each parameter in the last backward (unused ones get no update)."""
        if self._usage is not None and self._usage.gradient_pending:
            shares = self._usage.wait_gradient_comm().tolist()
            self._globally_used = {id(p): share > 0
                                   for p, share in zip(self._params_in_order, shares)}
        return self._globally_used

    def _gradients_to_grad(self) -> None:
        """Wait for every gradient and leave the averaged ones in ``.grad`` (DDP-style)."""
        pending = [(param, ps) for layer in self._forward_order
                   for param, ps in zip(layer.params, layer.sets) if ps.gradient_pending]
        arrived = [ps.wait_gradient_comm() for _, ps in pending]
        used = self._used_globally()  # after the gradients: waits count against their layers
        for (param, _), averaged in zip(pending, arrived):
            if not used.get(id(param), True):
                param.grad = None
            elif self._distributed_update:
                raise RuntimeError("distributed_update needs a DistributedOptimizer to "
                                   "apply the sharded update")
            elif param.grad is None:
                param.grad = averaged.view_as(param).clone()
            else:
                param.grad.copy_(averaged.view_as(param))

    def _complete_layer(self, layer: Layer) -> None:
        if not (layer.update_requested or layer.increments_pending):
            return
        if layer.update_requested:
            self._apply_updates(self._updates_ready_with(layer))
        if layer.increments_pending:
            layer.increments_pending = False
            with torch.no_grad():
                for param, ps in zip(layer.params, layer.sets):
                    param.copy_(ps.wait_increment_comm().view_as(param))

    def _updates_ready_with(self, layer: Layer) -> list[Layer]:
        """``layer`` and the requested layers right after it whose gradients already arrived.

        Updating them together costs one optimizer step (which walks every parameter) instead
        of one per layer; the values are the same, only applied earlier.
        """
        batch = [layer]
        for later in self._forward_order[self._position[id(layer)] + 1:]:
            if not later.update_requested:
                continue
            if not all(ps.test_gradient_comm() for ps in later.sets):
                break
            batch.append(later)
        return batch

    def _apply_updates(self, layers: list[Layer]) -> None:
        """Wait for ``layers``' averaged gradients and apply their update in one step."""
        assert self._optimizer is not None
        params, grads = [], []
        for layer in layers:
            layer.update_requested = False
            for param, ps in zip(layer.params, layer.sets):
                params.append(param)
                grads.append(ps.wait_gradient_comm())
        used = self._used_globally()  # after the gradients: waits count against their layers
        flags = [used.get(id(param), True) for param in params]
        self._optimizer._apply_update(params, grads, flags)

    def _finish_buffers(self) -> None:
        if self._buffer_request is None:
            return
        flat = self._buffer_request.wait()
        self._buffer_request = None
        offset = 0
        with torch.no_grad():
            for buffer in self._float_buffers:
                buffer.copy_(flat[offset: offset + buffer.numel()].view_as(buffer))
                offset += buffer.numel()
