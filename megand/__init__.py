"""megand: Megatron-style ND-parallel pretraining for GPT and LLaMA."""

import os

HUGE_PAGES = {"THP_MEM_ALLOC_ENABLE": "1"}  # torch's switch for huge pages under its large CPU tensors


def prefer_huge_pages() -> None:
    """Ask torch's CPU allocator for transparent huge pages (:data:`HUGE_PAGES`) unless the user has set it.
    Without a caching allocator on the CPU, each large tensor is fresh memory, faulted in 4 KiB at a time on
    its first write (the output layer's logits at llama_50m's size: 16,000 faults a step); huge pages come
    2 MiB at a time. torch reads the setting once, at its first allocation, so the entry points call this
    before anything imports torch (this module imports nothing else). Device memory is untouched."""
    for name, value in HUGE_PAGES.items():
        os.environ.setdefault(name, value)
