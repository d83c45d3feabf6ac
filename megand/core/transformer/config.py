"""The model's shape and the runtime choices that change how its layers are built."""

from dataclasses import dataclass, fields, replace
from typing import Any, Mapping

import torch

from megand.core.transformer.rope import RopeScaling, yarn_mscale
from megand.core.vocab_padding import MAKE_VOCAB_SIZE_DIVISIBLE_BY, padded_vocab_size

NORM_PLACEMENTS = ("pre", "sandwich", "post")  # model.norm_placement
QK_NORM_SCOPES = ("head", "projection")  # model.qk_norm_scope
LAYER_TYPES = ("attention", "linear_attention")  # model.layer_types: the token mixers a layer may have
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def resolve_head_dim(hidden_size: int, num_attention_heads: int, head_dim: int | None = None) -> int:
    """The width of one attention head: ``head_dim`` when set, else ``hidden_size // num_attention_heads``."""
    return head_dim if head_dim is not None else hidden_size // num_attention_heads


@dataclass(frozen=True)
class TransformerConfig:
    """A model's shape, and the runtime choices that change how its layers are built.

    The fields above ``# runtime`` are the run's ``model`` keys, and this class is their only schema: the
    run's configuration schema is generated from these fields, their defaults and their trailing comments
    (the configuration reference prints them). A union type the configuration cannot express (``int |
    tuple | None``, ``RopeScaling | None``) is checked here, in ``__post_init__``."""

    arch: str = "gpt"  # gpt | llama
    num_layers: int = 4  # transformer layers
    hidden_size: int = 64  # model width h
    ffn_hidden_size: int = 256  # MLP width (for swiglu: the width of each of gate and up)
    num_attention_heads: int = 4  # query heads
    num_query_groups: int | None = None  # null: multi-head attention
    head_dim: int | None = None  # width of one attention head; null: hidden_size / num_attention_heads (Qwen3 and Gemma set it apart)
    seq_length: int = 32  # tokens per sample
    vocab_size: int = 256  # > every token id of the data and >= the tokenizer's vocab (both checked)
    make_vocab_size_divisible_by: int = MAKE_VOCAB_SIZE_DIVISIBLE_BY  # the embedding and output layer are padded to a multiple of this x tp rows (aligned logits GEMM); padding is never predicted nor saved
    norm: str = "layernorm"  # layernorm | rmsnorm
    norm_eps: float = 1e-5  # epsilon of every norm (Qwen's published models use 1e-6)
    activation: str = "gelu"  # gelu | swiglu | geglu (gelu-tanh gate times up, the fused layout of swiglu; Gemma)
    position_embedding: str = "learned"  # learned | rope
    rope_theta: float = 10000.0  # RoPE base
    rope_scaling: RopeScaling | None = None  # RoPE frequency scaling with Hugging Face's keys: {rope_type: linear|llama3|yarn|proportional, factor, partial_rotary_factor (proportional), original_max_position_embeddings, low_freq_factor, high_freq_factor (llama3), beta_fast, beta_slow, mscale, mscale_all_dim, attention_factor (yarn)}; null: none
    qk_norm: bool = False  # RMSNorm over each query and key head before RoPE (Qwen3)
    sliding_window: int | tuple | None = None  # sliding-window attention (Mistral): each query sees the N latest keys (itself included); an int for every layer or a list with one entry per layer (null entries: full attention); null: none
    attention_output_gate: bool = False  # scale each attention head's output by sigmoid of a gate projected with its query (Qwen3-Next, Qwen3.5)
    attention_sinks: bool = False  # a learned logit per head in each query's softmax denominator, attending to no value (GPT-OSS)
    attention_out_bias: bool = False  # a bias on the attention output projection (GPT-OSS; qkv_bias is the q/k/v one)
    swiglu_limit: float | None = None  # clamped SwiGLU (GPT-OSS) when set: gate clamped to <= limit, up to [-limit, limit], out = gate * sigmoid(swiglu_alpha * gate) * (up + 1); null: silu(gate) * up
    swiglu_alpha: float = 1.702  # the clamped SwiGLU's sigmoid gain (read with swiglu_limit)
    partial_rotary_factor: float = 1.0  # RoPE rotates this fraction of each query/key head (its first dims; Qwen3-Next: 0.25)
    norm_placement: str = "pre"  # pre: a norm before attention and before the MLP | sandwich: also one on each branch's output before the residual add (Gemma 2/3) | post: only the norms on the branch outputs (OLMo 2/3)
    embedding_scale: bool = False  # multiply the word embeddings by sqrt(hidden_size), rounded to the parameters' dtype (Gemma); the tied output layer reads the unscaled table
    rope_local_theta: float | None = None  # RoPE base of the sliding-window layers, which take no rope_scaling (Gemma 3's local base, OLMo 3's local layers); null: one RoPE for every layer
    no_rope: tuple | None = None  # per layer: true where the layer applies no RoPE (NoPE; SmolLM3: every fourth); null: RoPE on every layer
    query_pre_attn_scalar: int | None = None  # attention scores scaled by 1/sqrt(this) instead of 1/sqrt(head_dim) (Gemma); null: head_dim
    v_norm: bool = False  # an RMSNorm without weight over each value head (Gemma 4)
    final_logit_softcapping: float | None = None  # logits become c * tanh(logits / c) before the loss and generation (Gemma 2, Gemma 4: 30); null: none
    qk_norm_scope: str = "head"  # what model.qk_norm normalises: head (each query/key head, Qwen3, Gemma 3) | projection (all query heads together, all key heads together, one weight per channel: OLMo 2/3)
    norm_unit_offset: bool = False  # RMSNorms scale by (1 + w): their weights are stored as the difference from 1, zero at init (Qwen3-Next, Qwen3.5)
    layer_types: tuple | None = None  # the token mixer of each layer: a list of attention | linear_attention (Gated DeltaNet), one per layer; null: attention everywhere
    linear_num_key_heads: int = 4  # Gated DeltaNet: query/key heads
    linear_num_value_heads: int = 8  # Gated DeltaNet: value heads (a multiple of the key heads; each key head serves value/key of them)
    linear_key_head_dim: int = 16  # Gated DeltaNet: width of a query/key head
    linear_value_head_dim: int = 16  # Gated DeltaNet: width of a value head
    linear_conv_kernel: int = 4  # Gated DeltaNet: taps of the short causal depthwise convolution over q, k and v
    qkv_bias: bool = False  # biases on the query/key/value projection only (Qwen2 / Qwen2-MoE); arch=gpt has biases on every linear anyway
    kv_lora_rank: int | None = None  # multi-head latent attention (DeepSeek-V2/V3) when set: keys and values of every head from one latent of this width per token; null: standard attention
    q_lora_rank: int | None = None  # latent attention: queries from a latent of this width (with its RMSNorm); null: a full-rank query projection
    qk_nope_head_dim: int | None = None  # latent attention: the query/key head width without position (needs kv_lora_rank)
    qk_rope_head_dim: int | None = None  # latent attention: the rotary query/key head width (one rotary key shared by all heads)
    v_head_dim: int | None = None  # latent attention: the value head width
    tie_embeddings: bool = True  # output layer shares the word embedding
    init_std: float = 0.02  # std of the normal init (output projections scaled by 1/sqrt(2*num_layers))
    hidden_dropout: float = 0.0  # dropout on embeddings and residual branches
    attention_dropout: float = 0.0  # dropout on attention probabilities
    num_experts: int | None = None  # Mixture-of-Experts: routed experts per MoE layer; null: dense MLP everywhere
    moe_top_k: int = 2  # experts each token is routed to
    moe_ffn_hidden_size: int | None = None  # width of one routed expert (for swiglu: of each of gate and up); null: ffn_hidden_size
    moe_shared_experts: int = 0  # always-on experts, one MLP of width moe_shared_experts * moe_ffn_hidden_size (0: none)
    moe_shared_expert_gate: bool = False  # scale the shared experts' output by sigmoid(x @ gate) (Qwen2-MoE)
    moe_layer_freq: int = 1  # layer i (0-based) is MoE when i % moe_layer_freq == 0; the others stay dense
    moe_first_k_dense_replace: int = 0  # the first k layers stay dense MLPs of ffn_hidden_size (DeepSeek-V3: 3)
    moe_router: str = "softmax"  # softmax (top-k of softmax, Mixtral) | sigmoid (DeepSeek-V3: sigmoid scores, aux-loss-free bias)
    moe_norm_topk_prob: bool = True  # renormalise the k chosen weights to sum to 1 (the sigmoid router too)
    moe_n_group: int | None = None  # group-limited routing (DeepSeek-V3's n_group): experts in this many groups, a group scored by its 2 best experts; null: none
    moe_topk_group: int | None = None  # group-limited routing: each token chooses among the experts of its topk_group best groups
    moe_routed_scaling_factor: float = 1.0  # the routed experts' weights are multiplied by this (DeepSeek-V3: 2.5)
    moe_bias_update_rate: float = 0.001  # sigmoid router: step of the aux-loss-free balancing bias after each optimizer step (0: off)
    moe_aux_loss_coeff: float = 0.0  # load-balancing (Switch/GShard) loss coefficient, over each micro-batch's global tokens
    moe_z_loss_coeff: float = 0.0  # router z-loss coefficient
    moe_bias: bool = False  # biases on the router's logits and on each routed expert's fc1 and fc2 (GPT-OSS)
    moe_capacity_factor: float | None = None  # per rank and expert keep ceil(factor * tokens * k / experts) assignments; null: dropless
    moe_beside_mlp: bool = False  # Gemma 4's MoE block: the routed experts run beside the layer's dense MLP (not in its place), on the residual with their own input norm, each branch's output normalised before the two are added; the router reads the RMS-normalised residual times a learned per-channel scale and 1/sqrt(hidden_size), and each chosen expert's weight is times a learned per-expert scale
    per_layer_input_size: int = 0  # per-layer input embeddings (Gemma 4's PLE) when > 0: each layer adds a gated projection of its own token embedding of this width (a table of per_layer_input_vocab_size rows per layer) plus a projection of the word embedding; 0: none
    per_layer_input_vocab_size: int | None = None  # rows of each layer's per-layer input embedding (at least vocab_size: every id has a row); null: vocab_size
    mtp_layers: int = 0  # multi-token prediction depths (DeepSeek-V3): depth k predicts the token k+1 ahead with one transformer layer of its own and the shared embedding and output layer, on the last pipeline stage; 0: none
    mtp_loss_weight: float = 0.3  # the depths' mean loss times this is added to the training objective (DeepSeek-V3: 0.3, then 0.1); logged apart as mtp_loss
    dsa_index_topk: int | None = None  # DeepSeek Sparse Attention (DeepSeek-V3.2, on latent attention with q_lora_rank): each query attends only to the keys its lightning indexer scores best, this many (causal); null: dense attention
    dsa_index_heads: int = 64  # DeepSeek Sparse Attention: the indexer's heads (replicated over tp)
    dsa_index_head_dim: int = 128  # DeepSeek Sparse Attention: the indexer's head width (its first qk_rope_head_dim dims rotary)
    dsa_indexer_loss_coeff: float = 0.0  # DeepSeek Sparse Attention: weight of the indexer loss (KL from the main attention's head-summed distribution over the selected keys, detached, to the indexer's softmax; the only signal that trains the indexer), logged as indexer_loss; 0: the indexer is not trained
    global_head_dim: int | None = None  # head width of the full-attention layers (those model.sliding_window leaves without a window; Gemma 4: 512); null: head_dim
    num_global_query_groups: int | None = None  # key/value heads of the full-attention layers (Gemma 4's num_global_key_value_heads); null: num_query_groups
    global_k_eq_v: bool = False  # the full-attention layers' values are their keys' projection (before the key norm and RoPE; the value norm still applies): no value rows (Gemma 4's attention_k_eq_v)
    num_kv_shared_layers: int = 0  # the last N layers compute no keys/values: each attends over those of the last earlier layer with its window (full or sliding; Gemma 4); 0: none
    double_wide_mlp: bool = False  # the layers that read earlier keys/values (model.num_kv_shared_layers) have an MLP of twice ffn_hidden_size (Gemma 4's use_double_wide_mlp)
    # runtime: from parallel.* and train.*, not model keys
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
        if not self.multi_latent:
            object.__setattr__(self, "head_dim", resolve_head_dim(self.hidden_size, self.num_attention_heads,
                                                                  self.head_dim))
        if self.multi_latent:
            self._check_latent()
            object.__setattr__(self, "head_dim", self.qk_nope_head_dim + self.qk_rope_head_dim)
        if self.dsa_index_topk is not None:
            self._check_sparse_attention()
        if isinstance(self.sliding_window, (list, tuple)):
            object.__setattr__(self, "sliding_window", tuple(self.sliding_window))
            if len(self.sliding_window) != self.num_layers:
                raise ValueError(f"model.sliding_window has {len(self.sliding_window)} entries for "
                                 f"model.num_layers={self.num_layers}: give one per layer (null: full attention)")
        windows = self.sliding_window if isinstance(self.sliding_window, tuple) else (self.sliding_window,)
        if any(w is not None and (isinstance(w, bool) or not isinstance(w, int) or w < 1) for w in windows):
            raise ValueError(f"model.sliding_window={self.sliding_window!r}: expected a positive int, a list of "
                             f"them (null entries: full attention) or null")
        if self.moe_n_group is not None or self.moe_topk_group is not None:
            self._check_groups()
        if self.layer_types is not None:
            self._check_layer_types()
        self._check_block_variants()
        self._check_layer_shapes()
        if isinstance(self.mtp_layers, bool) or not isinstance(self.mtp_layers, int) or self.mtp_layers < 0:
            raise ValueError(f"model.mtp_layers={self.mtp_layers!r}: expected an int >= 0 (0: no multi-token prediction)")
        if isinstance(self.rope_scaling, Mapping):
            object.__setattr__(self, "rope_scaling", RopeScaling.from_dict(self.rope_scaling))
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, RopeScaling):
            raise ValueError(f"model.rope_scaling={self.rope_scaling!r} must be a dict (rope_type, factor, ...) or null")
        if self.rope_scaling is not None and self.position_embedding != "rope":
            raise ValueError(f"model.rope_scaling is set but model.position_embedding={self.position_embedding} "
                             f"has no rotary embedding to scale")

    def _check_layer_types(self):
        types = tuple(self.layer_types)
        object.__setattr__(self, "layer_types", types)
        unknown = sorted({t for t in types if t not in LAYER_TYPES})
        if unknown or len(types) != self.num_layers:
            raise ValueError(f"model.layer_types={list(types)}: expected one of {', '.join(LAYER_TYPES)} per layer "
                             f"(model.num_layers={self.num_layers})")
        if "linear_attention" in types:
            widths = dict(linear_num_key_heads=self.linear_num_key_heads, linear_num_value_heads=self.linear_num_value_heads,
                          linear_key_head_dim=self.linear_key_head_dim, linear_value_head_dim=self.linear_value_head_dim)
            if (any(not isinstance(v, int) or v < 1 for v in widths.values()) or self.linear_conv_kernel < 2
                    or self.linear_num_value_heads % self.linear_num_key_heads):
                raise ValueError(f"Gated DeltaNet layers need positive {', '.join(f'model.{k}={v}' for k, v in widths.items())} "
                                 f"(value heads a multiple of key heads) and model.linear_conv_kernel="
                                 f"{self.linear_conv_kernel} >= 2")

    def _check_block_variants(self):
        """One line naming the values for the norm placement, GeGLU, NoPE layers, the local RoPE base, the
        query scalar and the q/k norm's scope."""
        if self.norm_placement not in NORM_PLACEMENTS:
            raise ValueError(f"model.norm_placement={self.norm_placement!r}: expected one of {', '.join(NORM_PLACEMENTS)}")
        if self.qk_norm_scope not in QK_NORM_SCOPES:
            raise ValueError(f"model.qk_norm_scope={self.qk_norm_scope!r}: expected one of {', '.join(QK_NORM_SCOPES)}")
        if self.moe_beside_mlp and (self.num_experts is None or self.norm_placement != "sandwich" or self.norm != "rmsnorm"
                                    or self.moe_router != "softmax" or self.moe_shared_experts):
            raise ValueError(f"model.moe_beside_mlp (Gemma 4's MoE block) needs model.num_experts (got "
                             f"{self.num_experts}), norm_placement=sandwich (got {self.norm_placement}), norm=rmsnorm "
                             f"(got {self.norm}), moe_router=softmax (got {self.moe_router}) and no shared experts "
                             f"(got moe_shared_experts={self.moe_shared_experts})")
        if self.per_layer_input_size:
            self._check_per_layer_inputs()
        if self.embedding_scale and self.mtp_layers:
            raise ValueError(f"model.embedding_scale with model.mtp_layers={self.mtp_layers}: the depths' embeddings "
                             f"are not scaled")
        if self.no_rope is not None:
            object.__setattr__(self, "no_rope", tuple(self.no_rope))
            if len(self.no_rope) != self.num_layers or any(not isinstance(v, bool) for v in self.no_rope):
                raise ValueError(f"model.no_rope={list(self.no_rope)}: expected one true/false per layer "
                                 f"(model.num_layers={self.num_layers})")
        if (self.no_rope is not None or self.rope_local_theta is not None) and self.position_embedding != "rope":
            raise ValueError(f"model.no_rope / model.rope_local_theta are set but model.position_embedding="
                             f"{self.position_embedding} has no rotary embedding")
        if self.rope_local_theta is not None and not self.rope_local_theta > 0:
            raise ValueError(f"model.rope_local_theta={self.rope_local_theta}: expected > 0 (null: one RoPE base)")
        cap = self.final_logit_softcapping
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, (int, float)) or not cap > 0 or self.mtp_layers):
            raise ValueError(f"model.final_logit_softcapping={cap} (model.mtp_layers={self.mtp_layers}): expected a "
                             f"number > 0 without multi-token prediction (null: no soft-capping)")
        if self.v_norm and self.multi_latent:
            raise ValueError("model.v_norm with model.kv_lora_rank (latent attention): the value norm is standard "
                             "attention's")
        if self.swiglu_limit is not None and (self.activation != "swiglu" or not self.swiglu_limit > 0):
            raise ValueError(f"model.swiglu_limit={self.swiglu_limit}: the clamped SwiGLU needs a limit > 0 and "
                             f"model.activation=swiglu (got {self.activation})")
        if self.attention_sinks and (self.multi_latent or self.attention_dropout):
            raise ValueError(f"model.attention_sinks with model.kv_lora_rank={self.kv_lora_rank} / "
                             f"model.attention_dropout={self.attention_dropout}: sinks need standard attention "
                             f"without attention dropout")
        if self.query_pre_attn_scalar is not None and (self.multi_latent or not self.query_pre_attn_scalar > 0):
            raise ValueError(f"model.query_pre_attn_scalar={self.query_pre_attn_scalar}: expected > 0, with standard "
                             f"attention (null: head_dim)")

    def _check_layer_shapes(self):
        """One line naming the values for the full-attention layers' own shape and key/value sharing."""
        own = dict(global_head_dim=self.global_head_dim, num_global_query_groups=self.num_global_query_groups,
                   global_k_eq_v=self.global_k_eq_v, num_kv_shared_layers=self.num_kv_shared_layers,
                   double_wide_mlp=self.double_wide_mlp)
        if not any(own.values()):
            return
        given = " ".join(f"model.{k}={v}" for k, v in own.items() if v)
        if self.multi_latent or self.linear_attention or self.mtp_layers or self.attention_output_gate:
            raise ValueError(f"{given}: needs standard attention on every layer, without model.kv_lora_rank, "
                             f"linear_attention layers, model.mtp_layers or model.attention_output_gate")
        for key in ("global_head_dim", "num_global_query_groups"):
            v = own[key]
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ValueError(f"model.{key}={v!r}: expected a positive int (null: the sliding layers')")
        groups = self.num_global_query_groups
        if groups is not None and self.num_attention_heads % groups:
            raise ValueError(f"model.num_global_query_groups={groups}: model.num_attention_heads="
                             f"{self.num_attention_heads} is not divisible by it")
        n = self.num_kv_shared_layers
        if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n < self.num_layers:
            raise ValueError(f"model.num_kv_shared_layers={n!r}: expected 0 <= it < model.num_layers={self.num_layers}")
        for i in range(self.num_layers - n, self.num_layers):
            self.kv_source(i)  # each sharing layer has a source
        if self.double_wide_mlp and (not n or (self.num_experts is not None and not self.moe_beside_mlp)):
            raise ValueError(f"model.double_wide_mlp with model.num_kv_shared_layers={n}, model.num_experts="
                             f"{self.num_experts}: it widens the dense MLP of the key/value-sharing layers")

    def ffn_width(self, layer_id: int) -> int:
        """The MLP width of layer ``layer_id``: twice ffn_hidden_size in a key/value-sharing layer under
        model.double_wide_mlp."""
        wide = self.double_wide_mlp and self.kv_source(layer_id) is not None
        return self.ffn_hidden_size * (2 if wide else 1)

    def layer_config(self, layer_id: int) -> "TransformerConfig":
        """The attention shape of layer ``layer_id``: a full-attention layer's own head width and key/value heads
        (``global_head_dim``, ``num_global_query_groups``) as its ``head_dim`` and ``num_query_groups``; every
        reader of one layer's widths (the layer, its cache, the adapters) reads them here."""
        if self.window(layer_id) is not None or (self.global_head_dim is None and self.num_global_query_groups is None):
            return self
        return replace(self, head_dim=self.global_head_dim or self.head_dim,
                       num_query_groups=self.num_global_query_groups or self.query_groups)

    def kv_source(self, layer_id: int) -> int | None:
        """The layer whose keys and values layer ``layer_id`` attends over (model.num_kv_shared_layers: the last
        layer before the sharing ones with its window); None: its own."""
        first = self.num_layers - self.num_kv_shared_layers
        if layer_id < first or layer_id >= self.num_layers:
            return None
        window = self.window(layer_id)
        for j in range(first - 1, -1, -1):
            if self.window(j) == window:
                return j
        raise ValueError(f"model.num_kv_shared_layers={self.num_kv_shared_layers}: layer {layer_id} (window {window}) "
                         f"has no earlier layer with its window among the first {first} to share keys/values with")

    def kv_rows(self, layer_id: int) -> int:
        """Key/value heads of the fused QKV weight per query group of layer ``layer_id``: 2 (key and value), 1 (the
        values are the keys' projection: model.global_k_eq_v on a full-attention layer) or 0 (a layer that reads
        another layer's keys and values)."""
        if self.kv_source(layer_id) is not None:
            return 0
        return 1 if self.global_k_eq_v and self.window(layer_id) is None else 2

    def kv_shared(self, layer_id: int) -> bool:
        """Whether a later layer reads the keys and values of layer ``layer_id``."""
        return any(self.kv_source(i) == layer_id for i in range(self.num_layers - self.num_kv_shared_layers,
                                                               self.num_layers))

    def _check_per_layer_inputs(self):
        """One line naming the values for per-layer input embeddings that cannot be built."""
        size, rows = self.per_layer_input_size, self.per_layer_input_vocab_size
        if (isinstance(size, bool) or not isinstance(size, int) or size < 0 or self.activation != "geglu"
                or self.norm != "rmsnorm" or self.mtp_layers or (rows is not None and rows < self.vocab_size)):
            raise ValueError(f"model.per_layer_input_size={size} model.per_layer_input_vocab_size={rows}: per-layer "
                             f"input embeddings need a width >= 0, activation=geglu (their gate is GeGLU's gelu-tanh; "
                             f"got {self.activation}), norm=rmsnorm (got {self.norm}), no multi-token prediction (got "
                             f"mtp_layers={self.mtp_layers}) and a table of at least vocab_size={self.vocab_size} rows")

    @property
    def per_layer_inputs_width(self) -> int:
        """Width of every layer's per-layer inputs together (0: none): what the word embedding is projected to,
        and what a pipeline link carries beside the hidden state."""
        return self.num_layers * self.per_layer_input_size

    @property
    def pipeline_width(self) -> int:
        """The last dim of what crosses a pipeline link: the hidden state, and with per-layer input embeddings the
        projected word embedding of every layer (computed on the first stage, which alone holds the word
        embedding; each stage reads its layers' columns)."""
        return self.hidden_size + self.per_layer_inputs_width

    def layer_rope(self, layer_id: int) -> str | None:
        """Which RoPE layer ``layer_id`` applies: None (NoPE, or no rotary embedding), ``local`` (a
        sliding-window layer with its own base, model.rope_local_theta) or ``global``."""
        if self.position_embedding != "rope" or (self.no_rope is not None and
                                                 self.no_rope[min(layer_id, self.num_layers - 1)]):
            return None
        return "local" if self.local_rope and self.window(layer_id) is not None else "global"

    @property
    def local_rope(self) -> bool:
        """Whether the sliding-window layers have a RoPE table of their own: a base of their own
        (model.rope_local_theta), or a head width apart from the full layers' (model.global_head_dim)."""
        return self.rope_local_theta is not None or self.global_rope_dim != self.rope_dim

    @property
    def global_rope_dim(self) -> int:
        """The rotated width of the full-attention layers' heads (:attr:`rope_dim` unless model.global_head_dim)."""
        if self.global_head_dim is None:
            return self.rope_dim
        return int(self.global_head_dim * self.partial_rotary_factor)

    def is_linear_attention(self, layer_id: int) -> bool:
        """Whether layer ``layer_id`` mixes tokens with Gated DeltaNet (a multi-token prediction layer, beyond
        the last, has attention)."""
        return self.layer_types is not None and layer_id < self.num_layers and \
            self.layer_types[layer_id] == "linear_attention"

    @property
    def linear_attention(self) -> bool:
        """Whether any layer is a Gated DeltaNet layer."""
        return self.layer_types is not None and "linear_attention" in self.layer_types

    def _check_groups(self):
        g, k, e = self.moe_n_group, self.moe_topk_group, self.num_experts
        ok = (e is not None and isinstance(g, int) and isinstance(k, int) and g >= 1 and e % g == 0
              and 1 <= k <= g and self.moe_top_k <= k * (e // g) and self.moe_router == "sigmoid")
        if not ok:
            raise ValueError(f"model.moe_n_group={g} model.moe_topk_group={k}: group-limited routing needs both, "
                             f"num_experts={e} divisible by n_group, 1 <= topk_group <= n_group, moe_top_k="
                             f"{self.moe_top_k} <= topk_group x experts per group, and moe_router=sigmoid "
                             f"(got {self.moe_router})")

    def _check_latent(self):
        """One line naming the values for a latent-attention config that cannot be built."""
        widths = dict(qk_nope_head_dim=self.qk_nope_head_dim, qk_rope_head_dim=self.qk_rope_head_dim,
                      v_head_dim=self.v_head_dim)
        bad = [k for k, v in widths.items() if not isinstance(v, int) or v < 1 or (k == "qk_rope_head_dim" and v % 2)]
        if bad or self.kv_lora_rank < 1 or (self.q_lora_rank is not None and self.q_lora_rank < 1):
            raise ValueError(f"model.kv_lora_rank={self.kv_lora_rank} (latent attention) needs positive "
                             f"model.q_lora_rank (or null), {', '.join(f'model.{k}={v}' for k, v in widths.items())} "
                             f"(qk_rope_head_dim even)")
        if self.position_embedding != "rope":
            raise ValueError(f"model.kv_lora_rank is set (latent attention) but model.position_embedding="
                             f"{self.position_embedding}: its decoupled head is rotary")
        clash = {k: v for k, v in dict(qk_norm=self.qk_norm, qkv_bias=self.qkv_bias, num_query_groups=self.num_query_groups,
                                       head_dim=self.head_dim).items() if v not in (None, False)}
        if clash.get("head_dim") == self.qk_nope_head_dim + self.qk_rope_head_dim:
            clash.pop("head_dim")
        if clash.get("num_query_groups") == self.num_attention_heads:  # one key/value per head: MLA's own
            clash.pop("num_query_groups")
        if clash:
            raise ValueError(f"model.kv_lora_rank is set (latent attention): {', '.join(f'model.{k}={v}' for k, v in clash.items())} "
                             f"belong(s) to the standard attention (unset them)")

    def _check_sparse_attention(self):
        """One line naming the values for a DeepSeek Sparse Attention config that cannot be built."""
        sizes = dict(dsa_index_topk=self.dsa_index_topk, dsa_index_heads=self.dsa_index_heads,
                     dsa_index_head_dim=self.dsa_index_head_dim)
        if (not self.multi_latent or self.q_lora_rank is None or any(isinstance(v, bool) or not isinstance(v, int)
                                                                     or v < 1 for v in sizes.values())
                or self.dsa_index_head_dim < self.qk_rope_head_dim):
            raise ValueError(f"{' '.join(f'model.{k}={v}' for k, v in sizes.items())}: DeepSeek Sparse Attention "
                             f"needs latent attention with model.q_lora_rank (got kv_lora_rank={self.kv_lora_rank}, "
                             f"q_lora_rank={self.q_lora_rank}), positive sizes and dsa_index_head_dim >= "
                             f"model.qk_rope_head_dim={self.qk_rope_head_dim}")
        if self.sliding_window is not None:
            raise ValueError(f"model.dsa_index_topk with model.sliding_window={self.sliding_window}: not supported")

    @property
    def multi_latent(self) -> bool:
        """Multi-head latent attention (DeepSeek-V2/V3)."""
        return self.kv_lora_rank is not None

    @property
    def rope_dim(self) -> int:
        """The rotated width of a query/key head: the decoupled RoPE head under latent attention, the first
        ``partial_rotary_factor`` of the head otherwise."""
        return self.qk_rope_head_dim if self.multi_latent else int(self.head_dim * self.partial_rotary_factor)

    @property
    def value_head_dim(self) -> int:
        return self.v_head_dim if self.multi_latent else self.head_dim

    @property
    def softmax_scale(self) -> float:
        """The attention scores' factor: 1/sqrt(query head width), times DeepSeek's yarn temperature
        ``mscale(factor, mscale_all_dim)**2`` under latent attention with yarn scaling (as transformers does)."""
        scalar = self.head_dim if self.query_pre_attn_scalar is None else self.query_pre_attn_scalar
        return scalar ** -0.5 * self.attention_temperature

    @property
    def attention_temperature(self) -> float:
        """DeepSeek's yarn factor on the attention scores (1.0 elsewhere)."""
        rs = self.rope_scaling
        if self.multi_latent and rs is not None and rs.rope_type == "yarn" and rs.mscale_all_dim:
            return yarn_mscale(rs.factor, rs.mscale_all_dim) ** 2
        return 1.0

    @property
    def query_width(self) -> int:
        """Width of all query heads."""
        return self.num_attention_heads * self.head_dim

    @property
    def attention_output_width(self) -> int:
        """Width of all heads' attention outputs (the output projection's input)."""
        return self.num_attention_heads * self.value_head_dim

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
        return (self.num_experts is not None and layer_id >= self.moe_first_k_dense_replace
                and layer_id % self.moe_layer_freq == 0)

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
                             "moe_bias_update_rate", "moe_capacity_factor", "mtp_loss_weight",
                             "dsa_indexer_loss_coeff"})
ARCHITECTURE_FIELDS = MODEL_FIELDS - TRAINING_FIELDS
_DEFAULTS = {f.name: f.default for f in fields(TransformerConfig)}
_MOE = frozenset(k for k in ARCHITECTURE_FIELDS if k.startswith("moe_"))
_LATENT = frozenset({"q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"})
_DSA = frozenset({"dsa_index_heads", "dsa_index_head_dim"})
_LINEAR = frozenset({"linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
                     "linear_conv_kernel"})


def architecture(m: Mapping[str, Any]) -> dict[str, Any]:
    """The architecture keys of a megand ``model`` config set apart from the schema's defaults: a head width or
    a number of query groups equal to the derived one counts as unset, and so do keys with no effect in this
    model (MoE keys of a dense model, a shared experts' gate without shared experts, RoPE theta without RoPE,
    latent widths without latent attention, linear-attention widths without linear-attention layers)."""
    out = {k: m[k] for k in ARCHITECTURE_FIELDS if k in m and m[k] != _DEFAULTS[k]}
    hidden, heads = (m.get(k, _DEFAULTS[k]) for k in ("hidden_size", "num_attention_heads"))
    if out.get("num_query_groups") == heads:
        del out["num_query_groups"]
    if "head_dim" in out and (m.get("kv_lora_rank") is not None or out["head_dim"] == resolve_head_dim(hidden, heads)):
        del out["head_dim"]
    inert = set()
    if not m.get("num_experts"):
        inert |= _MOE
    if not m.get("per_layer_input_size"):
        inert.add("per_layer_input_vocab_size")
    if not m.get("moe_shared_experts"):
        inert.add("moe_shared_expert_gate")
    if m.get("position_embedding", _DEFAULTS["position_embedding"]) != "rope":
        inert.add("rope_theta")
    if not m.get("qk_norm"):
        inert.add("qk_norm_scope")
    if m.get("swiglu_limit") is None:
        inert.add("swiglu_alpha")
    if m.get("no_rope") is not None and not any(m["no_rope"]):
        inert.add("no_rope")
    if m.get("kv_lora_rank") is None:
        inert |= _LATENT
    if "linear_attention" not in (m.get("layer_types") or ()):
        inert |= _LINEAR
    if m.get("dsa_index_topk") is None:
        inert |= _DSA
    return {k: v for k, v in out.items() if k not in inert}


def comparable(model: Mapping[str, Any]) -> dict:
    """``model`` with the values that have two spellings made one, for comparing two models' keys: the
    head width and the query groups resolved (null means derived), the RoPE scaling's defaults filled in."""
    out = dict(model)
    if "hidden_size" in out and "num_attention_heads" in out:
        out["head_dim"] = resolve_head_dim(out["hidden_size"], out["num_attention_heads"], out.get("head_dim"))
        out["num_query_groups"] = out.get("num_query_groups") or out["num_attention_heads"]
    for key in ("sliding_window", "layer_types", "no_rope"):
        if isinstance(out.get(key), (list, tuple)):
            out[key] = tuple(out[key])
    if isinstance(out.get("rope_scaling"), Mapping):
        out["rope_scaling"] = RopeScaling.from_dict(out["rope_scaling"])
    return out
