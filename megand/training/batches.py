"""From the dataset to this rank's micro-batches.

The global batch of iteration ``i`` is samples ``[i*B, (i+1)*B)`` whatever the layout; data-parallel
rank ``r`` takes the ``r``-th contiguous slice and splits it into micro-batches in order. Tensor- and
pipeline-parallel peers of a data-parallel rank load the same samples identically (reading a few
memory-mapped samples costs less than broadcasting them over tp), except pipeline stages that hold neither
the embedding nor the loss: they read no tokens at all, only the positions. Under context parallelism each
rank keeps its load-balanced sequence chunks and their global positions.
"""

from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class MicroBatch:
    input_ids: torch.Tensor | None  # [b, s_local]; None on stages that need no tokens
    labels: torch.Tensor | None  # [b, s_local]
    positions: torch.Tensor  # [s_local] global token positions
    batch_size: int


def global_batch_range(iteration: int, global_batch_size: int) -> range:
    return range(iteration * global_batch_size, (iteration + 1) * global_batch_size)


def rank_microbatches(dataset, iteration, global_batch_size, micro_batch_size, topo, offset=0, seq_length=None,
                      needs_tokens=True):
    """This rank's micro-batches of global batch ``iteration`` (samples from ``offset`` on).

    ``needs_tokens=False`` (a middle pipeline stage): only positions; ``seq_length`` is then required.
    """
    per_dp = global_batch_size // topo.dp_size
    first = offset + iteration * global_batch_size + topo.dp_rank * per_dp
    input_ids = labels = None
    if needs_tokens:
        tokens = torch.from_numpy(np.stack([np.asarray(dataset[first + i], dtype=np.int64) for i in range(per_dp)]))
        seq_length = tokens.shape[1] - 1
        input_ids, labels = tokens[:, :-1], tokens[:, 1:]
    positions = torch.arange(seq_length)
    if topo.cp_size > 1:
        from megand.core.context_parallel import cp_positions, split_for_cp

        if needs_tokens:
            input_ids = split_for_cp(input_ids, 1, topo.cp_rank, topo.cp_size)
            labels = split_for_cp(labels, 1, topo.cp_rank, topo.cp_size)
        positions = cp_positions(seq_length, topo.cp_rank, topo.cp_size, positions.device)
    device = topo.device
    positions = positions.to(device)

    def part(t, i):
        return None if t is None else t[i: i + micro_batch_size].to(device)

    return [MicroBatch(part(input_ids, i), part(labels, i), positions, micro_batch_size)
            for i in range(0, per_dp, micro_batch_size)]
