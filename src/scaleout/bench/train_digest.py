"""What a ``bench train`` rank reports of the model it trained: a digest of its parameters.

Once a configuration is built (before its first step), each rank keeps a copy of its
parameters as they start. After every round's timed iterations and the closing settle (every
update applied), it digests every parameter, named as in the workload's model
(``fc1.weight``, ``embeddings.3.weight``: DDP's or DataParallel's wrapper taken off,
``hybrid``'s tables gathered whole, ``Setup.parameters``), in float64:

``[numel, sum, sum of squares, moved sum, moved sum of squares, projection 1, ..., K]``

where "moved" is the parameter minus its start and projection ``k`` the dot product of the
movement with a fixed pseudo-random vector (normal values drawn from a generator seeded by
the parameter's name and ``k``: the same in every configuration and round). Rank 0 gathers
every rank's digest (``all_gather_object`` on the default process group, outside the timed
loop) and writes them with the round's results; :mod:`scaleout.bench.train_checks` judges
them.

Why the movement and the projections: a few steps of SGD move a parameter by a thousandth
of its size, so two models that trained differently differ by about as much as they moved,
but by little against the parameters themselves; and a difference of random sign per value
(a codec's rounding, a rank's own gradient) hardly shows in sums, while a projection on a
random vector reads its norm: the mean of the squared differences of ``K`` projections
estimates ``||A - B||^2``.

Example (one process):
    >>> net = torch.nn.Linear(2, 1, bias=False)
    >>> _ = torch.nn.init.ones_(net.weight)
    >>> digest = ParameterDigest(Setup(model=net, optimizer=None, settle=None, reset=None,
    ...                                statistics=None, close=None, details={}))
    >>> _ = net.weight.data.mul_(3.0)
    >>> digest()["weight"][:5]   # numel, sum, squares, moved, moved squared
    [2, 6.0, 18.0, 4.0, 8.0]
"""

from __future__ import annotations

import zlib

import torch
from torch import nn

from scaleout.bench.train_setup import Setup

__all__ = ["CHUNK", "PROJECTIONS", "Digest", "ParameterDigest", "gather_digests"]

#: ``{name: [numel, sum, squares, moved sum, moved squares, *projections]}`` (JSON-ready).
Digest = dict[str, list[float]]

#: Values converted to float64 at a time (a large table is never copied whole).
CHUNK = 1 << 22
#: Random projections of each parameter's movement (the relative error of the distance
#: estimated from them is about ``1 / sqrt(2 K)`` per parameter, less over a model).
PROJECTIONS = 4


def _parameters(setup: Setup) -> dict[str, torch.Tensor]:
    """The parameters of the workload's model, whole, by its names."""
    if setup.parameters is not None:
        return setup.parameters()
    from torch.nn.parallel import DistributedDataParallel

    from scaleout.pytorch import DataParallel

    model: nn.Module = setup.model
    if isinstance(model, (DistributedDataParallel, DataParallel)):
        model = model.module
    return dict(model.named_parameters())


class ParameterDigest:
    """Digests of a set-up's parameters and of their movement since this was made.

    Args:
        setup: the configuration as built, before its first step (its parameters are
            copied; every rank makes one at once: ``Setup.parameters`` may communicate).
    """

    def __init__(self, setup: Setup) -> None:
        self._setup = setup
        self._start = {name: p.detach().clone() for name, p in _parameters(setup).items()}

    @torch.no_grad()
    def __call__(self) -> Digest:
        """``{name: [numel, sum, squares, moved sum, moved squares, *projections]}`` now."""
        digest: Digest = {}
        for name, param in _parameters(self._setup).items():
            flat = param.detach().reshape(-1)
            start = self._start.get(name)
            start = (start.reshape(-1) if start is not None and start.numel() == flat.numel()
                     else torch.full_like(flat, float("nan")))  # (one that changed shape)
            seed = zlib.crc32(name.encode())
            generators = [torch.Generator().manual_seed(seed * PROJECTIONS + k)
                          for k in range(PROJECTIONS)]
            sums = [0.0] * (4 + PROJECTIONS)
            for part, began in zip(flat.split(CHUNK), start.split(CHUNK)):
                wide = part.double()
                moved = wide - began.double()
                sums[0] += float(wide.sum())
                sums[1] += float(torch.dot(wide, wide))
                sums[2] += float(moved.sum())
                sums[3] += float(torch.dot(moved, moved))
                for k, generator in enumerate(generators):
                    weights = torch.randn(moved.numel(), generator=generator,
                                          dtype=torch.float64).to(moved.device)
                    sums[4 + k] += float(torch.dot(moved, weights))
            digest[name] = [flat.numel(), *sums]
        return digest


def gather_digests(digest: ParameterDigest, distributed: bool) -> list[Digest]:
    """Every rank's digest, in rank order (every rank of the job must call it).

    Args:
        digest: this rank's :class:`ParameterDigest`, made when the set-up was built.
        distributed: whether a default process group joins the ranks (``False``: ``single``).
    """
    mine = digest()
    if not distributed:
        return [mine]
    import torch.distributed as tdist

    gathered: list[Digest | None] = [None] * tdist.get_world_size()
    tdist.all_gather_object(gathered, mine)
    return [d if d is not None else {} for d in gathered]
