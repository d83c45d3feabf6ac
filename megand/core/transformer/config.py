"""The model's shape and the runtime choices that change how its layers are built."""

from dataclasses import dataclass

import torch

from megand.core.vocab_padding import MAKE_VOCAB_SIZE_DIVISIBLE_BY, padded_vocab_size

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class TransformerConfig:
    arch: str = "gpt"  # gpt: biases everywhere, tanh-GELU; llama: no biases
    num_layers: int = 4
    hidden_size: int = 64
    ffn_hidden_size: int = 256
    num_attention_heads: int = 4
    num_query_groups: int | None = None  # None: multi-head attention (one K/V head per query head)
    seq_length: int = 32
    vocab_size: int = 256
    make_vocab_size_divisible_by: int = MAKE_VOCAB_SIZE_DIVISIBLE_BY
    norm: str = "layernorm"
    activation: str = "gelu"
    position_embedding: str = "learned"
    rope_theta: float = 10000.0
    tie_embeddings: bool = True
    init_std: float = 0.02
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    norm_eps: float = 1e-5
    # runtime
    sequence_parallel: bool = False
    recompute: str = "none"  # none | selective (attention core) | full (whole layer)
    precision: str = "fp32"
    cp_comm: str = "p2p"

    @property
    def query_groups(self) -> int:
        return self.num_query_groups or self.num_attention_heads

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def add_bias(self) -> bool:
        return self.arch == "gpt"

    def padded_vocab_size(self, tp_size: int) -> int:
        """The vocabulary rounded up to a multiple of ``make_vocab_size_divisible_by`` x tp."""
        return padded_vocab_size(self.vocab_size, tp_size, self.make_vocab_size_divisible_by)

    @property
    def params_dtype(self) -> torch.dtype:
        return DTYPES[self.precision]
