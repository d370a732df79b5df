"""MLSL's object model: Session, Operation, ParameterSet, Activation, Statistics."""

from scaleout.session.activation import Activation, ActivationSpec, Exchange
from scaleout.session.operation import Operation
from scaleout.session.parameter_set import ParameterSet, ParameterSetSpec
from scaleout.session.session import Phase, Session
from scaleout.session.statistics import OperationStats, Statistics

__all__ = ["Session", "Phase", "Operation", "ParameterSet", "ParameterSetSpec", "Activation",
           "ActivationSpec", "Exchange", "Statistics", "OperationStats"]
