"""Prediction: a scale-out simulator that shares the runtime's scheduling code.

Workloads (model table, recorded traces, Chakra traces) x networks (multi-dimensional
topologies priced by ASTRA-sim's analytical model) x collective algorithms x the runtime's
own plans and policies (:mod:`scaleout.scheduler`). See docs/simulator.md.
"""

from scaleout.sim.collectives import ALGORITHMS, OPS, CollectiveCost, collective_cost
from scaleout.sim.config import CODECS, CodecModel, IterationConfig, codec_model
from scaleout.sim.events import EventQueue
from scaleout.sim.graph import chakra_nodes, run_graph
from scaleout.sim.iteration import IterationResult, simulate
from scaleout.sim.models import DEVICES, MODELS, Device, model, model_workload
from scaleout.sim.network import PRESETS, Dimension, Topology, parse_topology, preset
from scaleout.sim.scaling import sweep
from scaleout.sim.themis import pipelined_allreduce, themis_gain
from scaleout.sim.trace import read_trace, write_trace
from scaleout.sim.workload import Layer, Workload

__all__ = [
    "ALGORITHMS",
    "OPS",
    "CollectiveCost",
    "collective_cost",
    "EventQueue",
    "CODECS",
    "CodecModel",
    "codec_model",
    "IterationConfig",
    "IterationResult",
    "simulate",
    "DEVICES",
    "MODELS",
    "Device",
    "model",
    "model_workload",
    "PRESETS",
    "Dimension",
    "Topology",
    "parse_topology",
    "preset",
    "pipelined_allreduce",
    "themis_gain",
    "Layer",
    "Workload",
    "chakra_nodes",
    "run_graph",
    "sweep",
    "read_trace",
    "write_trace",
]
