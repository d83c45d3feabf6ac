"""The data-parallel engine's own configuration (built from the run config by the training package)."""

from dataclasses import dataclass

# What is kept only as this rank's shard of the shard group (ZeRO-0..3), cumulative.
SHARDING_LEVELS = ("none", "optim", "optim_grads", "optim_grads_params")


@dataclass(frozen=True)
class DataParallelConfig:
    sharding: str = "none"  # none | optim (ZeRO-1) | optim_grads (ZeRO-2) | optim_grads_params (ZeRO-3)
    reshard_after_forward: bool = True  # ZeRO-3: free gathered params after each module's forward
    overlap_grad_reduce: bool = False  # reduce each gradient bucket as soon as backward has finished it
    overlap_param_gather: bool = False  # all-gather updated params during the next forward (sharded optimizer)
    bucket_size: int = 40_000_000  # elements per bucket
    fp8_param_gather: bool = True  # ZeRO-3: gather FP8 layers' weights in FP8 (off: bf16, as other parameters)

    def __post_init__(self):
        if self.sharding not in SHARDING_LEVELS:
            raise ValueError(f"sharding={self.sharding!r}: expected one of {', '.join(SHARDING_LEVELS)}")

    @property
    def shards_optim(self) -> bool:
        return self.sharding != "none"

    @property
    def shards_grads(self) -> bool:
        return self.sharding in ("optim_grads", "optim_grads_params")

    @property
    def shards_params(self) -> bool:
        return self.sharding == "optim_grads_params"
