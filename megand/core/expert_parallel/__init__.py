"""Expert parallelism: routed experts split over the ep ranks, tokens exchanged by all-to-all."""

from megand.core.expert_parallel.dispatcher import AllToAllDispatcher
from megand.core.expert_parallel.mappings import all_to_all

__all__ = ["AllToAllDispatcher", "all_to_all"]
