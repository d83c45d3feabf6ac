"""The model's shape and the runtime choices that change how its layers are built."""

from dataclasses import dataclass, fields
from typing import Any, Mapping

import torch

from megand.core.transformer.rope import RopeScaling
from megand.core.vocab_padding import MAKE_VOCAB_SIZE_DIVISIBLE_BY, padded_vocab_size

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def resolve_head_dim(hidden_size: int, num_attention_heads: int, head_dim: int | None = None) -> int:
    """The width of one attention head: ``head_dim`` when set, else ``hidden_size // num_attention_heads``."""
    return head_dim if head_dim is not None else hidden_size // num_attention_heads


@dataclass(frozen=True)
class TransformerConfig:
    arch: str = "gpt"  # gpt: biases everywhere, tanh-GELU; llama: no biases
    num_layers: int = 4
    hidden_size: int = 64
    ffn_hidden_size: int = 256
    num_attention_heads: int = 4
    num_query_groups: int | None = None  # None: multi-head attention (one K/V head per query head)
    head_dim: int | None = None  # width of one attention head; None: hidden_size // num_attention_heads
    seq_length: int = 32
    vocab_size: int = 256
    make_vocab_size_divisible_by: int = MAKE_VOCAB_SIZE_DIVISIBLE_BY
    norm: str = "layernorm"
    activation: str = "gelu"
    position_embedding: str = "learned"
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None  # a dict (HF's rope_scaling keys) is turned into RopeScaling
    qkv_bias: bool = False  # biases on the query/key/value projection only (Qwen2); gpt has biases everywhere
    qk_norm: bool = False  # RMSNorm over each query and key head before RoPE (Qwen3), one weight [head_dim] each
    # sliding-window attention (Mistral): a query sees the `window` latest keys (itself included); an int for
    # every layer, or one entry per layer (None: full causal attention in that layer); None: none
    sliding_window: int | tuple | None = None
    tie_embeddings: bool = True
    init_std: float = 0.02
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    norm_eps: float = 1e-5
    # Mixture-of-Experts (num_experts None: dense MLP everywhere)
    num_experts: int | None = None
    moe_top_k: int = 2
    moe_ffn_hidden_size: int | None = None  # None: ffn_hidden_size
    moe_shared_experts: int = 0
    moe_shared_expert_gate: bool = False
    moe_layer_freq: int = 1  # layer i is MoE when i % moe_layer_freq == 0
    moe_router: str = "softmax"  # softmax | sigmoid
    moe_norm_topk_prob: bool = True
    moe_bias_update_rate: float = 0.001
    moe_aux_loss_coeff: float = 0.0
    moe_z_loss_coeff: float = 0.0
    moe_capacity_factor: float | None = None  # None: dropless
    # multi-token prediction (DeepSeek-V3): depths after the last layer, each predicting one token further
    # ahead with one transformer layer of its own and the shared embedding and output layer; 0: none
    mtp_layers: int = 0
    mtp_loss_weight: float = 0.3  # the depths' mean loss times this is added to the training objective
    # runtime
    sequence_parallel: bool = False
    recompute: str = "none"  # none | selective (attention core) | full (whole layer)
    precision: str = "fp32"
    cp_comm: str = "p2p"
    # experts split over tp like the dense MLP (etp = tp); False: whole experts on every tp rank, each
    # tp rank routing its own share of the tokens (etp = 1)
    expert_tensor_parallel: bool = True

    @property
    def query_groups(self) -> int:
        return self.num_query_groups or self.num_attention_heads

    @classmethod
    def from_model(cls, model: Mapping[str, Any], **runtime) -> "TransformerConfig":
        """The config of a ``model`` mapping (the run's ``model`` section, or the one a checkpoint stores)
        plus the ``runtime`` choices; a model key this config does not declare is an error naming it (a
        forgotten field would otherwise be silently ignored). Runtime fields in ``model`` are taken too (tools
        building a one-process model pass e.g. ``precision`` with its shape)."""
        unknown = sorted(set(model) - MODEL_FIELDS - RUNTIME_FIELDS)
        if unknown:
            raise ValueError(f"unknown model key(s) {', '.join('model.' + k for k in unknown)}: not part of "
                             f"the model schema")
        return cls(**dict(model), **runtime)

    def __post_init__(self):
        # the one place the head width is derived: every width below and every reader (FLOPs, estimator,
        # checkpoint adapters) follow from it
        object.__setattr__(self, "head_dim", resolve_head_dim(self.hidden_size, self.num_attention_heads,
                                                              self.head_dim))
        if isinstance(self.sliding_window, (list, tuple)):
            object.__setattr__(self, "sliding_window", tuple(self.sliding_window))
            if len(self.sliding_window) != self.num_layers:
                raise ValueError(f"model.sliding_window has {len(self.sliding_window)} entries for "
                                 f"model.num_layers={self.num_layers}: give one per layer (null: full attention)")
        windows = self.sliding_window if isinstance(self.sliding_window, tuple) else (self.sliding_window,)
        if any(w is not None and (isinstance(w, bool) or not isinstance(w, int) or w < 1) for w in windows):
            raise ValueError(f"model.sliding_window={self.sliding_window!r}: expected a positive int, a list of "
                             f"them (null entries: full attention) or null")
        if isinstance(self.mtp_layers, bool) or not isinstance(self.mtp_layers, int) or self.mtp_layers < 0:
            raise ValueError(f"model.mtp_layers={self.mtp_layers!r}: expected an int >= 0 (0: no multi-token prediction)")
        if isinstance(self.rope_scaling, Mapping):
            object.__setattr__(self, "rope_scaling", RopeScaling.from_dict(self.rope_scaling))
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, RopeScaling):
            raise ValueError(f"model.rope_scaling={self.rope_scaling!r} must be a dict (rope_type, factor, ...) or null")
        if self.rope_scaling is not None and self.position_embedding != "rope":
            raise ValueError(f"model.rope_scaling is set but model.position_embedding={self.position_embedding} "
                             f"has no rotary embedding to scale")

    @property
    def query_width(self) -> int:
        """Width of all query heads (the attention output projection's input)."""
        return self.num_attention_heads * self.head_dim

    @property
    def kv_width(self) -> int:
        """Width of all key (or all value) heads."""
        return self.query_groups * self.head_dim

    @property
    def add_bias(self) -> bool:
        return self.arch == "gpt"

    def padded_vocab_size(self, tp_size: int) -> int:
        """The vocabulary rounded up to a multiple of ``make_vocab_size_divisible_by`` x tp."""
        return padded_vocab_size(self.vocab_size, tp_size, self.make_vocab_size_divisible_by)

    @property
    def expert_ffn_hidden_size(self) -> int:
        return self.moe_ffn_hidden_size or self.ffn_hidden_size

    def window(self, layer_id: int) -> int | None:
        """The attention window of layer ``layer_id`` (None: full causal attention)."""
        if isinstance(self.sliding_window, tuple):  # a multi-token prediction layer (beyond the last): the last's
            return self.sliding_window[min(layer_id, self.num_layers - 1)]
        return self.sliding_window

    def is_moe_layer(self, layer_id: int) -> bool:
        return self.num_experts is not None and layer_id % self.moe_layer_freq == 0

    @property
    def params_dtype(self) -> torch.dtype:
        return DTYPES[self.precision]


# the runtime choices (from parallel.* and train.*); every other field is the model's shape (model.*)
RUNTIME_FIELDS = frozenset({"sequence_parallel", "recompute", "precision", "cp_comm", "expert_tensor_parallel"})
MODEL_FIELDS = frozenset(f.name for f in fields(TransformerConfig)) - RUNTIME_FIELDS
# model keys that shape no weight nor what the weights compute: a run may set them apart from a checkpoint's
# (seq_length: only within the model's positions; its learned position table has seq_length rows)
TRAINING_FIELDS = frozenset({"seq_length", "hidden_dropout", "attention_dropout", "init_std",
                             "make_vocab_size_divisible_by", "moe_aux_loss_coeff", "moe_z_loss_coeff",
                             "moe_bias_update_rate", "moe_capacity_factor", "mtp_loss_weight"})
ARCHITECTURE_FIELDS = MODEL_FIELDS - TRAINING_FIELDS


def comparable(model: Mapping[str, Any]) -> dict:
    """``model`` with the values that have two spellings made one, for comparing two models' keys: the
    head width and the query groups resolved (null means derived), the RoPE scaling's defaults filled in."""
    out = dict(model)
    if "hidden_size" in out and "num_attention_heads" in out:
        out["head_dim"] = resolve_head_dim(out["hidden_size"], out["num_attention_heads"], out.get("head_dim"))
        out["num_query_groups"] = out.get("num_query_groups") or out["num_attention_heads"]
    if isinstance(out.get("sliding_window"), (list, tuple)):
        out["sliding_window"] = tuple(out["sliding_window"])
    if isinstance(out.get("rope_scaling"), Mapping):
        out["rope_scaling"] = RopeScaling.from_dict(out["rope_scaling"])
    return out
