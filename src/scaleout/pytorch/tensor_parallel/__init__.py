"""Tensor (model) parallelism on the MODEL group of a Distribution (Megatron-style layers)."""

from scaleout.pytorch.model_rng import ModelParallelRNG, SplitRegionDropout
from scaleout.pytorch.tensor_parallel.convert import (
    STYLES,
    full_state_dict,
    load_full_state_dict,
    plan_tensor_parallel,
    tensor_parallel,
)
from scaleout.pytorch.tensor_parallel.exchanges import (
    copy_to_model,
    gather_from_model,
    reduce_from_model,
    scatter_to_model,
)
from scaleout.pytorch.tensor_parallel.layers import (
    ColumnParallelLinear,
    ModelParallelLayer,
    RowParallelLinear,
    VocabParallelEmbedding,
)

__all__ = [
    "ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding", "ModelParallelLayer",
    "tensor_parallel", "full_state_dict", "load_full_state_dict", "plan_tensor_parallel",
    "STYLES", "copy_to_model", "reduce_from_model", "gather_from_model", "scatter_to_model",
    "ModelParallelRNG", "SplitRegionDropout",
]
