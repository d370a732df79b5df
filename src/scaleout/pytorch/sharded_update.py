"""The sharded (distributed) update: each rank steps its owned slice of every weight.

With ``DataParallel(distributed_update=True)`` each averaged gradient is reduce-scattered, so
a rank receives only its owned slice of it (:func:`~scaleout.session.parameter_set.owned_range`).
:class:`ShardedUpdate` keeps flat copies of this rank's owned slices of the weights (the
shards) and a copy of the user's optimizer over them, which therefore holds about 1/N of the
optimizer state. ``step()`` steps the shards with their slices of the averaged gradients and
all-gathers the new values; each layer writes them into its weights when the next forward
reaches it (:meth:`~scaleout.pytorch.updates.LazyUpdates.complete`).

The copy steps flat 1-D slices, which gives the numbers the whole tensors would only for an
optimizer whose update is elementwise: :data:`ELEMENTWISE` lists torch's (each value moves by
its own gradient and state, with per-tensor scalars such as the step count); others are
refused (Adafactor's factored second moment and Muon's orthogonalisation need the matrix,
LAMB- and LARS-style trust ratios the whole tensor's norm).

A shard's ``.grad`` plays the part of the weight's ``.grad``: the averaged slices accumulate in
it until ``zero_grad()``, so a second ``step()`` applies it again, and a synchronisation between
backward and step (which receives the slices early) changes nothing. In overlap mode, where
``step()`` consumes ``.grad``, the next backward's slices replace what a step consumed, as
without the sharded update. The weight's own ``.grad`` holds this rank's local gradient
until the slices are received: set to ``None`` there, the parameter is left out of the step
(its shard's ``.grad`` dropped, as torch drops the accumulated ``.grad``); changed in place or
replaced (clipped by hand), it is refused (:mod:`scaleout.pytorch.grad_edits`): clip with
``max_grad_norm`` instead, which scales the slices by the global norm (one scalar all-reduce
over the data group; :func:`~scaleout.pytorch.clipping.clip_owned_slices`).

Each ``step()`` starts from the weights as they are: once the last gathered values have
landed, it copies this rank's slice of every weight into its shard (``torch._foreach_copy_``,
about 1/N of the weights' bytes: 2 to 3 ms for ResNet-18's 47 MB at N = 2 on this host's CPU),
so a change made between steps reaches the update as a single process's optimizer would see
it, however it was made: clipped or loaded into the bare module under ``torch.no_grad()``,
through ``p.data`` (the WGAN paper's ``p.data.clamp_()``: ``.data`` has a version counter of
its own, so no ``_version`` can tell), or ``p.data`` replaced. The copy is exact: the shards
have the weights' dtype and the all-gather is exact (a lossy codec is refused with the
sharded update), so a weight nobody changed reads back the values its shard held. In overlap
mode that holds after the gathered values landed (``model.synchronize()``); a weight changed
in place between ``step()`` and the landing is refused (``LazyUpdates`` compares versions).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from scaleout.core.grid import GroupType
from scaleout.pytorch.clipping import clip_owned_slices
from scaleout.pytorch.modules import Layer
from scaleout.session.parameter_set import owned_range

if TYPE_CHECKING:
    from scaleout.pytorch.data_parallel import DataParallel

__all__ = ["ELEMENTWISE", "ShardedUpdate", "check_elementwise", "group_options"]

#: torch's optimizers whose update is elementwise: stepping flat slices gives their numbers
ELEMENTWISE: tuple[type[torch.optim.Optimizer], ...] = (
    torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adamax,
    torch.optim.NAdam, torch.optim.RAdam, torch.optim.RMSprop, torch.optim.Adagrad,
    torch.optim.Adadelta, torch.optim.ASGD, torch.optim.Rprop)


#: the key of a sharded optimizer state's label: whose slices it holds (``labelled``)
LABEL = "sharded_update"


def check_elementwise(optimizer: torch.optim.Optimizer) -> None:
    """Raises ``ValueError`` unless ``optimizer`` is one of :data:`ELEMENTWISE` (exactly: a
    subclass may step otherwise)."""
    if type(optimizer) not in ELEMENTWISE:
        names = ", ".join(kind.__name__ for kind in ELEMENTWISE)
        raise ValueError(
            f"DataParallel(distributed_update=True) steps each rank's flat slice of every "
            f"parameter, which gives the whole tensor's update only for an elementwise "
            f"optimizer: torch.optim's {names}; got {type(optimizer).__name__} (its update may "
            f"depend on the parameter's shape or whole-tensor norms). Use one of those, or "
            f"distributed_update=False")


def group_options(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """Each group's options (tensors copied: a scheduler may change them in place, e.g. a
    tensor ``lr``)."""
    return [{k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in g.items()
             if k != "params"} for g in optimizer.param_groups]


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and \
            a.shape == b.shape and bool(torch.equal(a, b))
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - incomparable values: changed unless the same object
        return a is b


class ShardedUpdate:
    """This rank's shards of ``model``'s weights and a copy of ``optimizer`` over them.

    Args:
        optimizer: the user's optimizer (one of :data:`ELEMENTWISE`); its groups' options
            reach the copy at each step (a scheduler attached to it).
        model: the DataParallel model, built with ``distributed_update=True``.
        max_grad_norm: clip the averaged gradient to this global norm before each step
            (:func:`~scaleout.pytorch.clipping.clip_owned_slices`); ``None``: no clipping.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, model: DataParallel,
                 max_grad_norm: float | None = None) -> None:
        check_elementwise(optimizer)
        self.model = model
        self.max_grad_norm = max_grad_norm
        self.user = optimizer
        self.shards: dict[int, nn.Parameter] = {}
        groups = []
        for group in optimizer.param_groups:
            options = {k: v for k, v in group.items() if k != "params"}
            groups.append({**options, "params": [self._shard_of(p) for p in group["params"]]})
        self.optimizer = type(optimizer)(groups)  # every group carries all its options
        self._user_options = group_options(optimizer)  # what the user's groups said
        self._spent: set[int] = set()  # shards whose .grad an overlap-mode step consumed
        # the user's optimizer never steps: its state stays empty (saved, it lost Adam's
        # moments and steps without a word: 0.2 off after a resume before stop 51)
        _WRAPPED.add(optimizer)
        optimizer.register_state_dict_pre_hook(refuse_wrapped)
        optimizer.register_load_state_dict_pre_hook(refuse_wrapped)

    def _shard_of(self, param: nn.Parameter) -> nn.Parameter:
        shard = nn.Parameter(self.owned_values(param).clone())
        self.shards[id(param)] = shard
        return shard

    def owned_values(self, param: nn.Parameter) -> torch.Tensor:
        """This rank's owned slice of ``param`` (the same geometry as its ParameterSet)."""
        start, count = owned_range(param.numel(), self.model.comm.size, self.model.comm.rank)
        return param.detach().reshape(-1)[start: min(start + count, param.numel())]

    def held(self) -> list[nn.Parameter]:
        """The weights the user's optimizer holds (each has a shard)."""
        return [p for group in self.user.param_groups for p in group["params"]]

    @torch.no_grad()
    def read(self, params: Sequence[nn.Parameter]) -> None:
        """Copy ``params``' current values into their shards (one fused copy on a GPU)."""
        if params:
            torch._foreach_copy_([self.shards[id(p)] for p in params],
                                 [self.owned_values(p) for p in params])

    def receive(self, layers: Sequence[Layer]) -> list[nn.Parameter]:
        """Wait for ``layers``' averaged gradients and add their owned slices to the shards'
        ``.grad`` (nothing for a parameter no rank used); the weights' local ``.grad`` is
        consumed. A weight whose ``.grad`` was set to ``None`` since it left is left out:
        its shard's ``.grad`` is dropped (an edit of it is refused: ``LazyUpdates.take_edits``).
        Returns the weights of the optimizer's that had one."""
        updates = self.model.updates
        dropped = updates.take_edits([p for layer in layers for p in layer.params
                                      if id(p) in self.shards])
        used = updates.used_globally()
        consumed = []
        for layer in layers:
            for param, ps in zip(layer.params, layer.sets):
                owned = ps.wait_gradient_comm()
                shard = self.shards.get(id(param))  # (none: a parameter it does not train)
                if shard is not None:
                    if param.grad is not None:
                        consumed.append(param)
                    if id(shard) in self._spent or id(param) in dropped:  # (replaced; dropped)
                        self._spent.discard(id(shard))
                        shard.grad = None
                    if used.get(id(param), True) and id(param) not in dropped:
                        shard.grad = owned.clone() if shard.grad is None else shard.grad.add_(owned)
                param.grad = None
        return consumed

    def zero_grad(self, set_to_none: bool) -> None:
        """The shards' ``.grad`` cleared or zeroed (then fresh: nothing consumed any more);
        zeroed, a weight left with a (zero) ``.grad`` has a zero shard gradient too (its
        backward's slices dropped in flight: ``LazyUpdates.discard``), stepped as torch
        steps a zero gradient."""
        self.optimizer.zero_grad(set_to_none)
        self._spent = set()
        if not set_to_none:
            for param in self.held():
                shard = self.shards[id(param)]
                if param.grad is not None and shard.grad is None:
                    shard.grad = torch.zeros_like(shard)

    def step(self, pending: Sequence[Layer], consume: bool) -> list[nn.Parameter]:
        """Step the shards and start gathering every layer's new values: first the last
        step's values (``step()`` again before the next forward), then every weight as it is
        now into its shard (changed since, in any way: see the module's docstring), and
        ``pending`` layers' gradients. ``consume``: the step consumes the gradients (overlap
        mode: the next backward's replace them). Returns the weights whose ``.grad`` it
        consumed (:meth:`receive`)."""
        self.follow_user_groups()
        updates = self.model.updates
        for layer in updates.forward_order:
            updates.complete(layer)
        self.read(self.held())
        consumed = self.receive(pending)
        if self.max_grad_norm is not None:
            clip_owned_slices([(p, self.shards[id(p)]) for p in self.held()],
                              self.max_grad_norm, self.model.comm,
                              self.model.distribution.communicator(GroupType.MODEL))
        self.optimizer.step()
        self._spent = {id(shard) for shard in self.shards.values()} if consume else set()
        for layer in updates.forward_order:
            for param, ps in zip(layer.params, layer.sets):
                shard = self.shards.get(id(param))
                # every rank sends its slice; one this optimizer does not train stays as it is
                ps.start_increment_comm(self.owned_values(param) if shard is None
                                        else shard.detach())
            layer.increments_pending = True
            updates.stepped(layer.params)  # (changed before its values land: refused)
        return consumed

    def labelled(self, state: dict[str, Any]) -> dict[str, Any]:
        """The copy's ``state_dict()``, labelled with whose slices its state holds."""
        return {**state, LABEL: {"rank": self.model.comm.rank,
                                 "world_size": self.model.comm.size}}

    def unlabelled(self, state: dict[str, Any]) -> dict[str, Any]:
        """``state`` without its label, once the label says it holds this rank's slices (a
        state without one, as :mod:`~scaleout.pytorch.resharding` makes it, is taken as is).

        Raises:
            ValueError: ``state`` holds another rank's slices, or slices cut for another world
                size (since stop 52: DDP's ``if rank == 0: torch.save(opt.state_dict(), f)``
                then a load on every rank gave rank 1 rank 0's momentum, silently where the
                slices have the same shapes, else "output with shape [1] doesn't match the
                broadcast shape [2]" in its next step).
        """
        if not isinstance(state, dict) or LABEL not in state:
            return state
        label = state[LABEL]
        mine = {"rank": self.model.comm.rank, "world_size": self.model.comm.size}
        if label != mine:
            raise ValueError(
                f"rank {self.model.distribution.env.rank}: this optimizer state holds the "
                f"slices of data-group rank {label.get('rank')} of {label.get('world_size')} "
                f"(DataParallel(distributed_update=True): each rank's state_dict() holds its own "
                f"slices only), and this is rank {mine['rank']} of {mine['world_size']}: save "
                f"it on every rank and load each rank's own (scaleout.checkpoint.save / load "
                f"do, at any world size), not one rank's file on all")
        return {key: value for key, value in state.items() if key != LABEL}

    def follow_user_groups(self) -> None:
        """Options that the user's groups changed since the last step (a scheduler attached
        to the wrapped optimizer) are copied into the copy's; then the user's groups show the
        options in effect (changes made through the DistributedOptimizer included). Each
        ``step()`` starts with it, and so does saving the copy's state (before stop 51 a
        checkpoint held the options of the step before: a scheduler's last change was lost
        at the resume)."""
        for user, inner, seen in zip(self.user.param_groups, self.optimizer.param_groups,
                                     self._user_options):
            for key, value in user.items():
                if key != "params" and (key not in seen or not _same(value, seen[key])):
                    inner[key] = value
        self.show_options()

    def show_options(self) -> None:
        """The user's groups show the copy's options, and the next step compares the user's
        groups with them; called alone after the copy's state was loaded, whose options win
        over the user's, as a plain optimizer's ``load_state_dict`` replaces its groups'."""
        for user, inner in zip(self.user.param_groups, self.optimizer.param_groups):
            user.update({k: v for k, v in inner.items() if k != "params"})
        self._user_options = group_options(self.user)


_WRAPPED: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()  # the users' optimizers


def refuse_wrapped(optimizer: torch.optim.Optimizer | None, *_: Any) -> None:
    """Raise a ValueError if ``optimizer`` is one a sharded update wraps, which holds no state
    (its ``state_dict`` / ``load_state_dict`` hook, and ``checkpoint.load``'s check)."""
    if optimizer is None or optimizer not in _WRAPPED:
        return
    raise ValueError(
        f"this {type(optimizer).__name__} is wrapped by a DistributedOptimizer of a "
        f"DataParallel(distributed_update=True): it never steps and holds no state (the "
        f"DistributedOptimizer's copy of it steps this rank's slices and holds their state); "
        f"save and load the DistributedOptimizer's state_dict() (checkpoint.save(path, model, "
        f"<the DistributedOptimizer>))")
