"""Context parallelism: the sequence split over cp ranks (load-balanced for causal masks) and the
attention that sees the whole sequence (ring p2p, all-gather, or all-to-all over heads: Ulysses)."""

from megand.core.context_parallel.ring_attention import all_gather_attention, ring_attention
from megand.core.context_parallel.ulysses import check_ulysses_heads, ulysses_attention
from megand.core.context_parallel.sequence import (cp_positions, gather_from_cp,
                                                   merge_cp_shards, split_for_cp)

__all__ = ["all_gather_attention", "ring_attention", "ulysses_attention", "check_ulysses_heads", "cp_positions", "gather_from_cp",
           "merge_cp_shards", "split_for_cp"]
