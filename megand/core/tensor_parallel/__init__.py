"""Tensor and sequence parallelism: layers, their communication, vocab-parallel loss, model-parallel RNG."""

from megand.core.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from megand.core.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    padded_vocab_size,
)
from megand.core.tensor_parallel.mappings import (
    copy_to_tp,
    gather_from_sp,
    gather_from_tp,
    reduce_from_tp,
    reduce_scatter_to_sp,
    scatter_to_sp,
)
from megand.core.tensor_parallel.random import TensorParallelRNG, checkpoint, seed_random_streams
