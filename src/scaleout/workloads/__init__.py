"""Reference workloads: models, deterministic data and losses for tests and benchmarks.

Six workloads, by name (see :func:`get_workload`):

========== =====================================================================
resnet18   CIFAR-style ResNet-18 on synthetic 3x32x32 images (11.2M parameters)
resnet50   CIFAR-style ResNet-50 on synthetic 3x32x32 images (23.5M parameters)
transformer GPT-style causal LM on a synthetic Markov chain
dlrm       DLRM on synthetic Zipf-distributed Criteo-like click data
digits-mlp MLP on scikit-learn's real 8x8 digits
digits-cnn small CNN on scikit-learn's real 8x8 digits
========== =====================================================================

Example:
    >>> import torch
    >>> from scaleout.workloads import get_workload
    >>> wl = get_workload("digits-mlp")
    >>> model = wl.build_model(seed=0)
    >>> # rank 1 of 2 gets rows 32..63 of the 64-sample global batch of step 0
    >>> inputs, targets = wl.make_batch(64, step=0, seed=0, rank=1, world_size=2)
    >>> wl.loss_fn(model(inputs), targets).backward()

The library proper never imports this package: it is a recipe, not a mechanism.
"""

from scaleout.workloads.base import (
    Batch,
    Workload,
    batch_to,
    build_seeded,
    make_generator,
    shard_bounds,
    shard_tensors,
)
from scaleout.workloads.digits import (
    DigitsData,
    DigitsWorkload,
    digits_cnn,
    digits_mlp,
    evaluate_accuracy,
    load_digits_data,
)
from scaleout.workloads.dlrm import DLRM, DLRMConfig, DLRMInputs, DLRMWorkload, zipf_cdf
from scaleout.workloads.layers import LayerSize, layer_sizes, total_grad_bytes
from scaleout.workloads.registry import get_workload, workload_names
from scaleout.workloads.resnet import ResNet, ResNetWorkload, resnet18, resnet50
from scaleout.workloads.transformer import GPT, TransformerConfig, TransformerWorkload

__all__ = [
    "Batch",
    "DLRM",
    "DLRMConfig",
    "DLRMInputs",
    "DLRMWorkload",
    "DigitsData",
    "DigitsWorkload",
    "GPT",
    "LayerSize",
    "ResNet",
    "ResNetWorkload",
    "TransformerConfig",
    "TransformerWorkload",
    "Workload",
    "batch_to",
    "build_seeded",
    "digits_cnn",
    "digits_mlp",
    "evaluate_accuracy",
    "get_workload",
    "layer_sizes",
    "load_digits_data",
    "make_generator",
    "resnet18",
    "resnet50",
    "shard_bounds",
    "shard_tensors",
    "total_grad_bytes",
    "workload_names",
    "zipf_cdf",
]
