"""Operation: one layer registered with a session (MLSL's Operation)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from scaleout.core.distribution import Distribution
from scaleout.core.grid import GroupType
from scaleout.session.activation import Activation, ActivationSpec
from scaleout.session.parameter_set import ParameterSet, ParameterSetSpec
from scaleout.session.statistics import Statistics

__all__ = ["Operation"]


class Operation:
    """A layer: its distribution, input/output activations and parameter sets.

    Operations are kept in registration order, which is taken as forward order: ``prev``
    and ``next`` link neighbours, and a lower ``index`` means the next forward needs its
    parameters sooner (it gets priority).
    """

    def __init__(self, index: int, name: str, distribution: Distribution,
                 parameter_sets: Sequence[ParameterSetSpec], inputs: Sequence[ActivationSpec],
                 outputs: Sequence[ActivationSpec], *, statistics: Statistics,
                 local_minibatch: Callable[[Distribution], int]) -> None:
        if not isinstance(distribution, Distribution):
            raise TypeError(f"operation {name}: distribution must be a scaleout.Distribution, "
                            f"got {type(distribution).__name__}")
        for spec in parameter_sets:
            if not isinstance(spec, ParameterSetSpec):
                raise TypeError(f"operation {name}: parameter_sets must hold ParameterSetSpec, "
                                f"got {type(spec).__name__}")
        for spec in (*inputs, *outputs):
            if not isinstance(spec, ActivationSpec):
                raise TypeError(f"operation {name}: inputs/outputs must hold ActivationSpec, "
                                f"got {type(spec).__name__}")
        self.index = index
        self.name = name
        self.distribution = distribution
        self._local_minibatch = local_minibatch
        self.parameter_sets = [ParameterSet(s, op_name=name, op_index=index, index=i,
                                            distribution=distribution, statistics=statistics)
                               for i, s in enumerate(parameter_sets)]
        model = distribution.communicator(GroupType.MODEL)
        self.inputs = [Activation(s, model, f"{name}.in{i}") for i, s in enumerate(inputs)]
        self.outputs = [Activation(s, model, f"{name}.out{i}") for i, s in enumerate(outputs)]
        self.prev: Operation | None = None
        self.next: Operation | None = None

    @property
    def local_minibatch_size(self) -> int:
        """The global minibatch size divided by this operation's data-group size."""
        return self._local_minibatch(self.distribution)

    def __repr__(self) -> str:
        return (f"<Operation {self.index}:{self.name} sets={len(self.parameter_sets)} "
                f"inputs={len(self.inputs)} outputs={len(self.outputs)}>")
