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
import dataclasses
import os
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from scaleout.compression import CompressionConfig
from scaleout.core.consistency import verify_plan
from scaleout.core.distribution import Distribution
from scaleout.core.env import attach
from scaleout.core.grid import GroupType
from scaleout.pytorch.buffers import BufferAverage, floating_buffers
from scaleout.pytorch.dp_bare_module import hook_bare_module
from scaleout.pytorch.compression_options import model_compression
from scaleout.pytorch.dp_backward import BackwardSide
from scaleout.pytorch.dp_checkpoint import CheckpointSurface, fit_compression_state
from scaleout.pytorch.dp_conversions import Conversions
from scaleout.pytorch.dp_forward import ForwardHooks
from scaleout.pytorch.dp_lifetime import Holdings, weak_method, weakly
from scaleout.pytorch.exchange_stats import bind_recorders
from scaleout.pytorch.lookup_ids import LookupRows
from scaleout.pytorch.lookup_reads import (exact_builtin, find_lookup_reads, ran_embeddings,
                                            rows_wanted)
from scaleout.pytorch.modules import (Layer, agreed_order, broadcast_tensors, find_layers,
                                      refuse_meta, refuse_thawed, register_layers,
                                      set_bucket_parameters)
from scaleout.pytorch.placement import is_local, placement_of, registration
from scaleout.pytorch.reads import find_early_reads
from scaleout.pytorch.replicas import ReplicaCheck, replica_interval
from scaleout.pytorch.residual_carry import Replanning
from scaleout.pytorch.tied import EarlyShares, splittable
from scaleout.pytorch.tuning import tuner_for
from scaleout.pytorch.updates import LazyUpdates
from scaleout.scheduler import SchedulerConfig
from scaleout.session import Phase, Session, Statistics
from scaleout.session.bucket import CommHook
from scaleout.session.timing import stopwatch_for
from scaleout.session.trace import TraceRecorder, claim_trace_path, prepare_trace_folder

__all__ = ["DataParallel"]

class DataParallel(BackwardSide, ForwardHooks, CheckpointSurface, Conversions, Replanning):
    """Data-parallel training of ``module`` over the data group of ``distribution``.

    Args:
        module: the model. Its parameters and buffers are broadcast from data-group rank 0
            (on a grid with a model group, replicated ones first from model-group rank 0).
            Tensor-parallel layers (``scaleout.pytorch.tensor_parallel``) keep their shards,
            each averaged over the data group only; local (sharded embedding) tables are not.
        distribution: where to train; ``None`` uses every rank of an already initialised job.
        scheduler: fusion, chunking and priority options (default: the priority policy).
        distributed_update: shard the optimizer update over the data group (the optimizer
            keeps state for 1/N of the parameters); needs a DistributedOptimizer over one of
            torch's elementwise optimizers (:mod:`scaleout.pytorch.sharded_update`).
        compression: a codec spec for every gradient (``"cast:bf16"``), or a dict from
            parameter-name glob pattern to spec; ``None`` sends exact gradients.
        broadcast_buffers: average floating buffers (BatchNorm running statistics) over the
            data group after every training forward (in float64: equal buffers stay equal).
        trace: a folder (made now, or a ``ValueError``): every rank records a timeline (each
            layer's forward and backward, each bucket's communication, exposed waits,
            updates), written as ``trace.<rank>.json`` on ``close()`` / ``write_trace()`` (a
            process's later traced models: ``trace.<rank>.<n>.json``, n = 1, 2...); default
            ``SCALEOUT_TRACE``; ``scaleout sim chrome FOLDER`` makes a Chrome trace of it.
        verify_replicas: check every N steps that the replicas are identical (debug,
            ``pytorch.replicas``; default ``SCALEOUT_VERIFY_REPLICAS``, 0 = off).
        tune: choose ``scheduler`` (and codecs) from the first iterations' measurements:
            ``True`` (exact), ``"lossy"`` (codecs per layer allowed) or a ``TuneConfig``
            (:mod:`scaleout.pytorch.tuning`); ``model.tuning`` says what and why.

    Weights read by embedding lookups alone (DLRM's tables), sent exact, travel row-sparse on
    the CPU across machines (``lookup_reads``, ``lookup_ids``); one read by a lookup and other
    operations (a tied LM head) in two shares with ``SCALEOUT_SPLIT_TIED=1`` (``tied``).

    Without a DistributedOptimizer (or with ``mode="sync"``) it behaves like DDP: after
    ``backward()`` every ``.grad`` holds the gradient averaged over the data group.

    Example (under ``scaleout run -n 2``):
        >>> env = scaleout.init()
        >>> model = DataParallel(net, env.create_distribution())
        >>> opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model)
        >>> loss_fn(model(x), y).backward(); opt.step(); opt.zero_grad()
    """

    def __init__(self, module: nn.Module, distribution: Distribution | None = None, *,
                 scheduler: SchedulerConfig | None = None, distributed_update: bool = False,
                 compression: Any = None, broadcast_buffers: bool = True,
                 trace: str | os.PathLike | None = None, verify_replicas: int | None = None,
                 tune: Any = None) -> None:
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
        refuse_meta(module, "DataParallel")
        if distribution is None:
            distribution = attach().create_distribution()
        if not isinstance(distribution, Distribution):
            raise TypeError(f"distribution must be a scaleout.Distribution, got "
                            f"{type(distribution).__name__}")
        if scheduler is not None and not isinstance(scheduler, SchedulerConfig):
            raise TypeError(f"scheduler must be a scaleout.SchedulerConfig or None, got "
                            f"{type(scheduler).__name__}")
        for flag, value in (("distributed_update", distributed_update),
                            ("broadcast_buffers", broadcast_buffers)):
            if not isinstance(value, bool):
                raise TypeError(f"{flag} must be a bool, got {value!r}")
        if trace is not None and not isinstance(trace, (str, os.PathLike)):
            raise TypeError(f"trace must be a folder (a str or path) or None, got {trace!r}")
        folder = trace if trace is not None else os.environ.get("SCALEOUT_TRACE") or None
        self._trace_dir = (prepare_trace_folder(  # (before any collective: every rank fails)
            folder, setting="trace=" if trace is not None else "SCALEOUT_TRACE")
            if folder else None)
        self._held = Holdings()  # (released by close(), or when this model is collected)
        self._release = self._held.release_when_collected(self)
        self.module = module
        self.distribution = distribution
        self.env = distribution.env
        self._scheduler = scheduler or SchedulerConfig()
        self.distributed_update = distributed_update
        self._compression = model_compression(compression, module,  # errors now
                                              distributed_update=distributed_update)
        self.comm = distribution.communicator(GroupType.DATA)
        self._tuner = tuner_for(tune, compression=compression,
                                distributed_update=distributed_update, ranks=self.comm.size)
        interval = replica_interval(verify_replicas)
        floats = floating_buffers(module)
        if self.comm.size > 1:  # before the options make groups and collectives of their own
            changed = {f.name: getattr(self._scheduler, f.name)  # (the report is cut short)
                       for f in dataclasses.fields(self._scheduler)
                       if getattr(self._scheduler, f.name) != f.default}
            verify_plan(self.comm, "DataParallel options", (
                f"verify_replicas {interval}, distributed_update {distributed_update}, "
                f"averaged buffers {broadcast_buffers and bool(floats)}, scheduler {changed}, "
                f"tune {tune!r}, compression {self._compression!r}"))
        self.replicas = ReplicaCheck(self.comm, module, interval)
        self._model_comm = distribution.communicator(GroupType.MODEL)
        self._layers = find_layers(module, self.comm.size)
        self._frozen = [p for p in module.parameters()  # (find_layers left them out)
                        if not p.requires_grad and p.numel() and not is_local(p)]
        for layer in self._layers:  # a shard on another model group: a ValueError now
            for param in layer.params:
                registration(param, self._model_comm)
        params = [p for layer in self._layers for p in layer.params]
        self._device = params[0].device if params else torch.device("cpu")
        self.updates = LazyUpdates(distributed_update=self.distributed_update)
        self._session: Session | None = None
        self._forward_order: list[Layer] = []
        self._watching = True  # forwards are watched for early reads until a training one
        self._read_early: dict[int, list[Layer]] = {}  # reader module's id -> layers it reads
        self._comm_hook: tuple[Any, CommHook] | None = None
        self._pending_compression_state: dict[str, Any] = {}
        self._trace, self._trace_file = ((TraceRecorder(self.env.rank),
                                          claim_trace_path(self._trace_dir, self.env.rank))
                                         if self._trace_dir else (None, None))
        self._first_laps = Statistics(self._trace)  # the first forward's (no session yet)
        self._timed = False  # this forward is timed: a backward may follow (grad enabled)
        self._no_sync = self._backward_queued = self._outer_queued = False
        self._exchanges = 0  # backwards whose gradients were exchanged (the tuner's clock)
        self._alone: Statistics | None = None  # set when there is nothing to exchange (_commit)
        self._used: dict[int, bool] = {}
        self._tied: list[nn.Parameter] = []  # read by a lookup and more (first forward's graph)
        self._lookup_only: list[nn.Parameter] = []  # read by lookups alone (row-sparse...
        self._rows_default = False  # ...by default when this says: lookup_reads.rows_wanted)
        self._shares: EarlyShares | None = None
        self._lookup_rows: LookupRows | None = None  # each forward's rows, for the exchange
        if self._model_comm.size > 1:
            broadcast_tensors(self._model_comm, [
                *(p for p in module.parameters() if placement_of(p) is None), *module.buffers()])
        broadcast_tensors(self.comm, [*(p for p in module.parameters() if not is_local(p)),
                                      *module.buffers()])
        self._buffer_average = None  # (its group freed with the others: self._held)
        if broadcast_buffers and floats:
            buffers = distribution.duplicate(GroupType.DATA, "buffers")
            self._held.duplicates.append((distribution, buffers))
            self._buffer_average = BufferAverage(floats, buffers)
        self._handles = self._held.handles  # (they hold this model weakly: dp_lifetime)
        self._handles += hook_bare_module(self, module)  # (its state_dict() and forward)
        self._stopwatch = stopwatch_for(self._device)  # each layer's compute (statistics)
        self._grad_hook = weak_method(self._on_grad)  # (LookupRows knows it by identity)
        for layer in self._layers:
            self._handles.append(layer.module.register_forward_pre_hook(self._pre_hook(layer)))
            self._handles.append(layer.module.register_forward_hook(self._post_hook(layer)))
            for param in layer.params:
                self._used[id(param)] = False
                self._handles.append(param.register_post_accumulate_grad_hook(self._grad_hook))

    # -- public ------------------------------------------------------------------------

    @property
    def statistics(self) -> Statistics:
        """Compute / communication / exposed time per layer (after the first forward)."""
        if self._alone is not None:
            return self._alone
        if self._session is None:
            raise RuntimeError("statistics exist after the first forward")
        return self._session.statistics

    @property
    def compression(self) -> CompressionConfig | None:  # parsed ``compression=`` (None: exact)
        return self._compression

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
        self.updates.synchronize()
        self._finish_buffers()

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self._alone is not None:
            return self.module(*args, **kwargs)
        self._before_forward(args)
        if self._watching:
            output = self._first_forward(args, kwargs)
        else:
            output = self.module(*args, **kwargs)
        self._after_forward(output)
        return output

    # torch.compile traces the module, never the communication around it: the hooks and
    # these steps are opaque to it (torch.compiler.disable), so it neither breaks graphs
    # on them with a warning nor tries to trace locks, clocks and collectives.

    @torch.compiler.disable
    def _before_forward(self, args: tuple[Any, ...]) -> None:
        self._refuse_broken_backward()
        self._finish_buffers()
        refuse_thawed(self.module, self._frozen)  # (none frozen: nothing to walk)
        self.replicas.before_forward(self.synchronize)
        # (only a forward whose backward exchanges: every rank runs as many; a rank's extra
        # evaluation forward or no_sync() micro-batch ran its tuning at another point: a hang)
        if self._tuner is not None and self._session is not None and torch.is_grad_enabled() \
                and not self._no_sync:
            self._tuner.before_forward(self)  # measures; at its iteration, tunes and rebuilds
        self._stopwatch.begin()
        # Only a forward that a backward may follow is timed: an evaluation forward under
        # no_grad() enters neither the statistics nor the trace (nor sets its batch size).
        self._timed = torch.is_grad_enabled()
        if self._trace is not None and self._timed:
            first = args[0] if args else None
            self._trace.begin_forward(first.shape[0] if isinstance(first, torch.Tensor)
                                      and first.dim() else None)

    @torch.compiler.disable  # (a compiled module runs its first forward eagerly)
    def _first_forward(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Forwards up to a training one (an evaluation first hid its reads), watched for
        parameters read before their own module runs (``scaleout.pytorch.reads``)."""
        self._watching = not (torch.is_grad_enabled() and self.module.training)
        output, early = find_early_reads(self.module, self._layers,
                                         lambda: self.module(*args, **kwargs))
        self._hook_readers(early)
        return output

    @torch.compiler.disable
    def _after_forward(self, output: Any) -> None:
        if self._session is None:
            ran = ran_embeddings(self._forward_order) if torch.is_grad_enabled() else None
            self._rows_default = rows_wanted(self._device, self.env.launch.one_machine)
            self._tied, self._lookup_only = find_lookup_reads(
                output, [p for layer in self._layers for p in layer.params], self.comm,
                self._device, rows=self._rows_default, embeddings=ran)
            self._commit()
            self._merge_first_laps()
        if self.training and torch.is_grad_enabled():
            self._watch_output(output)
        for layer in self._forward_order:  # layers this forward did not run
            self.updates.complete(layer)
        if self._lookup_rows and self.training and torch.is_grad_enabled():
            self._lookup_rows.observe(output)  # (every exchange before it has completed)
        if self.training and self._buffer_average is not None:  # (no_grad() ones too:
            self._buffer_average.start()  # swa_utils.update_bn recomputes statistics so)
        if self._session is not None:
            self._stopwatch.flush(self._session.statistics)

    def train(self, mode: bool = True) -> DataParallel:
        if mode != self.training:
            self.synchronize()
        return super().train(mode)

    def write_trace(self, **meta: Any) -> str | None:
        """Write this rank's trace (when tracing) into the trace folder; its path. ``meta``:
        ``workload``, ``batch_size``, ``device``, ``command`` for the file."""
        if self._trace is None or self._trace_file is None:
            return None
        meta.setdefault("device", str(self._device))
        return self._trace.write(self._trace_file, **meta)

    def close(self) -> None:
        """Apply a pending update (:meth:`synchronize`; before stop 52 an overlap-mode step's
        was dropped; one that fails is a warning: close() cleans up), write the trace, stop
        the progress thread, free the groups, remove the hooks. A dropped model: ``dp_lifetime``."""
        try:
            if self._release.alive:  # (not once closed)
                self.synchronize()
        except Exception as err:  # (raised where it happened, or the peer failure's)
            warnings.warn(f"DataParallel.close(): the pending update was not applied: {err}",
                          RuntimeWarning, stacklevel=2)
        finally:
            try:
                self.write_trace()
            finally:
                self._release()

    # -- set-up ------------------------------------------------------------------------

    def _commit(self) -> None:
        """Register the layers in the order the first forward ran them, then commit; or, on
        a lone rank with nothing to exchange, step aside (:meth:`_nothing_to_exchange`)."""
        if self._nothing_to_exchange():
            for handle in self._handles:
                handle.remove()
            self._handles.clear()
            self._forward_order, self._buffer_average = [], None
            self._alone = Statistics()
            return
        self._forward_order = agreed_order(self.comm, self._layers, self._forward_order,
                                           self._device)  # (it decides the buckets)
        session = Session(self.env, Phase.TRAIN, scheduler=self._scheduler, trace=self._trace)
        if self._comm_hook is not None:
            session.register_comm_hook(*self._comm_hook)
        names = {id(p): n for n, p in self.module.named_parameters()}
        how = dict(compression=self._compression,
                   other_exchange=self.distributed_update or self._comm_hook)
        split = {id(p) for p in self._tied if splittable(p, names[id(p)], **how)}
        rows = {id(p) for p in self._lookup_only
                if self._rows_default and exact_builtin(p, names[id(p)], **how)}
        usage = register_layers(session, self.distribution, self._forward_order, names,
                                distributed_update=self.distributed_update,
                                compression=self._compression, split=split, rows=rows)
        session.commit()
        set_bucket_parameters(session, self._forward_order)
        self.updates.commit(self._forward_order, usage, self._trace)
        if self._trace is not None:
            for layer in self._forward_order:
                self._trace.set_grad_bytes(layer.name, sum(p.numel() * p.element_size()
                                                           for p in layer.params))
        if self._pending_compression_state:
            session.load_compression_state_dict(  # (what it does not compress: reset)
                fit_compression_state(session, self._pending_compression_state))
            self._pending_compression_state = {}
        self._session = self._held.session = session
        bind_recorders(self.module, session.statistics)  # activation exchanges, per layer
        self._set_of = {id(p): (layer, ps) for layer in self._forward_order
                        for p, ps in zip(layer.params, layer.sets)}
        early = {layer.params[i]: self._sender(ps) for layer in self._forward_order
                 for i, ps in layer.early.items()}
        self._shares = EarlyShares(early, holding_back=weakly(self, lambda m: m._no_sync),
                                   on_share=weak_method(self._on_share))
        self._lookup_rows = LookupRows(session, self._forward_order,  # (a user's rows codec too)
                                       {id(p) for p in self._lookup_only}, self._grad_hook)

    def _nothing_to_exchange(self) -> bool:
        """A lone rank (data and model groups of one), exact gradients, nothing recorded:
        averaging over one rank is the identity, so no hook, bucket or progress thread is
        set up (per-layer hooks alone cost a launch-bound GPU model a third of its iteration:
        RESULTS.md, issue 11). ``SCALEOUT_ALONE_FAST_PATH=0`` keeps them (to measure them)."""
        return (self.comm.size == 1 and self._model_comm.size == 1 and self._compression is None
                and self._comm_hook is None and self._trace is None and not self.distributed_update
                and self._tuner is None and os.environ.get("SCALEOUT_ALONE_FAST_PATH", "1") != "0")

    def _finish_buffers(self) -> None:
        if self._buffer_average is not None:
            self._buffer_average.finish()
