"""The data-parallel engine's own configuration (built from the run config by the training package)."""

from dataclasses import dataclass


@dataclass(frozen=True)
class DataParallelConfig:
    distributed: bool = False  # shard fp32 main params and Adam states over dp x cp (the distributed optimizer)
    overlap_grad_reduce: bool = False  # reduce each gradient bucket as soon as backward has finished it
    overlap_param_gather: bool = False  # all-gather updated params during the next forward (distributed only)
    bucket_size: int = 40_000_000  # elements per bucket
