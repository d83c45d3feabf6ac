"""megand: Megatron-style ND-parallel pretraining for GPT and LLaMA."""
