"""Tensor (model) parallelism after Megatron-LM (Shoeybi et al. 2019, §3)."""
from megatron_moe.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from megatron_moe.tensor_parallel.layers import (ColumnParallelLinear, ReplicatedLinear, RowParallelLinear,
                                                 VocabParallelEmbedding, padded_vocab_size)
from megatron_moe.tensor_parallel.mappings import (copy_to_tp_region, gather_from_tp_region, reduce_from_tp_region,
                                                   scatter_to_tp_region)
from megatron_moe.tensor_parallel.random import Dropout, DropoutRNG

__all__ = [
    "ColumnParallelLinear", "ReplicatedLinear", "RowParallelLinear", "VocabParallelEmbedding", "padded_vocab_size",
    "vocab_parallel_cross_entropy", "copy_to_tp_region", "reduce_from_tp_region", "gather_from_tp_region",
    "scatter_to_tp_region", "Dropout", "DropoutRNG",
]
