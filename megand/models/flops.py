"""Parameter counts and FLOPs per iteration, computed from the model shape alone.

Conventions (shared by every function here):

* One multiply-accumulate is 2 FLOPs; only matrix multiplications are counted (norms, activations,
  softmax, RoPE, the loss and the optimizer are elementwise and ignored, as in Megatron and PaLM).
* Forward matmul FLOPs per token of one layer:
    - QKV projection  2·h·(h + 2·kv)         kv = num_query_groups · head_dim (GQA shrinks K and V)
    - attention core  4·s·h                  scores Q·Kᵀ (2·s·h) and context P·V (2·s·h). The causal
                                             mask is *not* halved: kernels and Megatron/torchtitan
                                             count the full s×s product, and so does torch's
                                             FlopCounterMode.
    - output proj     2·h·h
    - MLP             gelu: 4·h·f (two matrices) ; swiglu: 6·h·f (gate, up, down; f is each width)
  plus the logits (output layer) 2·h·V per token, once per model.
* Model FLOPs (what MFU is measured against) = 3 × forward: the backward pass costs two forward
  matmuls (gradient w.r.t. input and w.r.t. weight).
* Hardware FLOPs add what recomputation really executes: ``full`` re-runs the whole forward of every
  layer (+1 forward of the layers; the logits are never recomputed), ``selective`` re-runs only the
  attention core (+4·s·h per token per layer).

With these conventions ``model_flops_per_token ≈ 6·N + 12·L·h·s + 6·h·V`` where N counts the non-embedding
matmul weights, which is the usual ``6N + 12Lhs`` figure plus the logits term.
"""

from dataclasses import dataclass
from typing import Any, Mapping


def _get(cfg: Mapping[str, Any], key: str, default: Any = None) -> Any:
    """Read ``key`` from a dict or an OmegaConf node (both support ``get``)."""
    value = cfg.get(key, default)
    return default if value is None else value


_SHAPES: dict = {}  # Shape.from_config's results by the model dict's items


@dataclass(frozen=True)
class Shape:
    """The numbers the formulas need, derived once from the model config mapping."""

    arch: str
    layers: int
    hidden: int
    ffn: int
    heads: int
    groups: int
    seq: int
    vocab: int
    swiglu: bool
    layernorm: bool   # LayerNorm has a bias; RMSNorm has none
    linear_bias: bool  # GPT-2 style linears carry biases, LLaMA style ones do not
    learned_positions: bool
    tied: bool

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def kv_dim(self) -> int:
        return self.groups * self.head_dim

    @classmethod
    def from_config(cls, model: Mapping[str, Any]) -> "Shape":
        if isinstance(model, dict):  # plain dicts (the estimator and planner call this a great many times)
            try:
                key = tuple(sorted(model.items()))
                hash(key)
            except TypeError:
                return cls._from_config(model)
            if key not in _SHAPES:
                if len(_SHAPES) > 256:
                    _SHAPES.clear()
                _SHAPES[key] = cls._from_config(model)
            return _SHAPES[key]
        return cls._from_config(model)

    @classmethod
    def _from_config(cls, model: Mapping[str, Any]) -> "Shape":
        arch = _get(model, "arch", "gpt")
        heads = int(_get(model, "num_attention_heads"))
        hidden = int(_get(model, "hidden_size"))
        if hidden % heads:
            raise ValueError(f"hidden_size {hidden} is not divisible by num_attention_heads {heads}")
        return cls(
            arch=arch,
            layers=int(_get(model, "num_layers")),
            hidden=hidden,
            ffn=int(_get(model, "ffn_hidden_size", 4 * hidden)),
            heads=heads,
            groups=int(_get(model, "num_query_groups", heads)),
            seq=int(_get(model, "seq_length")),
            vocab=int(_get(model, "vocab_size")),
            swiglu=_get(model, "activation", "swiglu" if arch == "llama" else "gelu") == "swiglu",
            layernorm=_get(model, "norm", "rmsnorm" if arch == "llama" else "layernorm") == "layernorm",
            linear_bias=arch == "gpt",
            learned_positions=_get(model, "position_embedding",
                                   "rope" if arch == "llama" else "learned") == "learned",
            tied=bool(_get(model, "tie_embeddings", arch == "gpt")),
        )


@dataclass(frozen=True)
class LayerParams:
    """Parameters of one transformer layer, split by the way tensor parallelism shards them."""

    qkv_weight: int
    qkv_bias: int
    proj_weight: int
    proj_bias: int
    mlp_in_weight: int   # fc1 (gelu) or gate+up (swiglu)
    mlp_in_bias: int
    mlp_out_weight: int
    mlp_out_bias: int
    norms: int           # the two norms of the layer (weight, and bias for LayerNorm)

    @property
    def total(self) -> int:
        return sum(vars(self).values())

    def per_tp_rank(self, tp: int) -> float:
        """Column-parallel (qkv, mlp_in) weights+biases and row-parallel weights are split over tp;
        row-parallel biases and norms are replicated."""
        split = (self.qkv_weight + self.qkv_bias + self.proj_weight
                 + self.mlp_in_weight + self.mlp_in_bias + self.mlp_out_weight)
        return split / tp + self.proj_bias + self.mlp_out_bias + self.norms


def layer_params(shape: Shape) -> LayerParams:
    h, f, kv = shape.hidden, shape.ffn, shape.kv_dim
    bias = shape.linear_bias
    mlp_in = (2 if shape.swiglu else 1) * h * f
    return LayerParams(
        qkv_weight=h * (h + 2 * kv),
        qkv_bias=(h + 2 * kv) if bias else 0,
        proj_weight=h * h,
        proj_bias=h if bias else 0,
        mlp_in_weight=mlp_in,
        mlp_in_bias=(mlp_in // h) if bias else 0,
        mlp_out_weight=f * h,
        mlp_out_bias=h if bias else 0,
        norms=2 * norm_params(shape),
    )


def norm_params(shape: Shape) -> int:
    return (2 if shape.layernorm else 1) * shape.hidden


@dataclass(frozen=True)
class ParamCounts:
    total: int
    non_embedding: int   # every parameter except word/position embeddings and an untied output layer
    per_layer: int
    word_embedding: int
    position_embedding: int
    output_layer: int    # 0 when tied to the word embedding
    final_norm: int


def param_counts(model: Mapping[str, Any]) -> ParamCounts:
    shape = Shape.from_config(model)
    per_layer = layer_params(shape).total
    word = shape.vocab * shape.hidden
    pos = shape.seq * shape.hidden if shape.learned_positions else 0
    out = 0 if shape.tied else shape.vocab * shape.hidden
    final_norm = norm_params(shape)
    non_embedding = shape.layers * per_layer + final_norm
    return ParamCounts(total=non_embedding + word + pos + out, non_embedding=non_embedding,
                       per_layer=per_layer, word_embedding=word, position_embedding=pos,
                       output_layer=out, final_norm=final_norm)


@dataclass(frozen=True)
class ForwardFlopsPerToken:
    """Forward matmul FLOPs for one token (see the module docstring)."""

    layer_dense: int      # QKV, output projection and MLP of one layer
    layer_attention: int  # attention core (scores + context) of one layer
    logits: int
    layers: int

    @property
    def total(self) -> int:
        return self.layers * (self.layer_dense + self.layer_attention) + self.logits


def forward_flops_per_token(model: Mapping[str, Any]) -> ForwardFlopsPerToken:
    s = Shape.from_config(model)
    h = s.hidden
    dense = 2 * h * (h + 2 * s.kv_dim) + 2 * h * h + (6 if s.swiglu else 4) * h * s.ffn
    return ForwardFlopsPerToken(layer_dense=dense, layer_attention=4 * s.seq * h,
                                logits=2 * h * s.vocab, layers=s.layers)


def model_flops_per_token(model: Mapping[str, Any]) -> int:
    """Forward + backward FLOPs per token (3 × forward), independent of recomputation."""
    return 3 * forward_flops_per_token(model).total


def hardware_flops_per_token(model: Mapping[str, Any], recompute: str = "none") -> int:
    """Model FLOPs plus the forward work that activation recomputation executes again."""
    fwd = forward_flops_per_token(model)
    extra = {
        "none": 0,
        "selective": fwd.layers * fwd.layer_attention,
        "full": fwd.layers * (fwd.layer_dense + fwd.layer_attention),
    }
    if recompute not in extra:
        raise ValueError(f"recompute must be none|selective|full, got {recompute!r}")
    return 3 * fwd.total + extra[recompute]


def flops_per_iteration(model: Mapping[str, Any], global_batch_size: int,
                        recompute: str = "none") -> dict:
    """Model and hardware FLOPs of one optimizer step over ``global_batch_size`` sequences.

    Divide by (iteration time × world size) for achieved FLOP/s per rank.
    """
    tokens = global_batch_size * int(_get(model, "seq_length"))
    return {
        "tokens": tokens,
        "model_flops": tokens * model_flops_per_token(model),
        "hardware_flops": tokens * hardware_flops_per_token(model, recompute),
    }
