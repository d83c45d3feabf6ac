"""From the dataset to this rank's micro-batches.

The global batch of iteration ``i`` is samples ``[i*B, (i+1)*B)`` whatever the layout; data-parallel
rank ``r`` takes the ``r``-th contiguous slice and splits it into micro-batches in order. Tensor- and
pipeline-parallel peers of a data-parallel rank load the same samples. Under context parallelism
each rank keeps its load-balanced sequence chunks and their global positions.
"""

from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class MicroBatch:
    input_ids: torch.Tensor  # [b, s_local]
    labels: torch.Tensor  # [b, s_local]
    positions: torch.Tensor  # [s_local] global token positions


def global_batch_range(iteration: int, global_batch_size: int) -> range:
    return range(iteration * global_batch_size, (iteration + 1) * global_batch_size)


def rank_microbatches(dataset, iteration, global_batch_size, micro_batch_size, topo, offset=0):
    """This rank's micro-batches of global batch ``iteration`` (samples from ``offset`` on)."""
    per_dp = global_batch_size // topo.dp_size
    first = offset + iteration * global_batch_size + topo.dp_rank * per_dp
    tokens = torch.from_numpy(np.stack([np.asarray(dataset[first + i], dtype=np.int64) for i in range(per_dp)]))
    seq_length = tokens.shape[1] - 1
    positions = torch.arange(seq_length)
    input_ids, labels = tokens[:, :-1], tokens[:, 1:]
    if topo.cp_size > 1:
        from megand.core.context_parallel import cp_positions, split_for_cp

        input_ids = split_for_cp(input_ids, 1, topo.cp_rank, topo.cp_size)
        labels = split_for_cp(labels, 1, topo.cp_rank, topo.cp_size)
        positions = cp_positions(seq_length, topo.cp_rank, topo.cp_size, positions.device)
    device = topo.device
    positions = positions.to(device)
    return [
        MicroBatch(input_ids[i: i + micro_batch_size].to(device), labels[i: i + micro_batch_size].to(device), positions)
        for i in range(0, per_dp, micro_batch_size)
    ]
