"""Parameter counts and FLOPs per iteration, computed from the model shape alone.

Conventions (shared by every function here):

* One multiply-accumulate is 2 FLOPs; only matrix multiplications are counted (norms, activations,
  softmax, RoPE, the loss and the optimizer are elementwise and ignored, as in Megatron and PaLM).
* Forward matmul FLOPs per token of one layer:
    - QKV projection  2·h·(q + 2·kv)         q = num_attention_heads · head_dim (= h unless head_dim is
                                             set apart), kv = num_query_groups · head_dim (GQA shrinks K, V)
                      latent attention (kv_lora_rank set; H heads, r_q/r_kv the latents, d_qk = nope + rope):
                      2·(h·r_q + r_q·H·d_qk) (or 2·h·H·d_qk without a query latent) + 2·h·(r_kv + rope)
                      + 2·r_kv·H·(nope + v_head_dim); the output projection then 2·H·v_head_dim·h
    - attention core  4·s·q                  scores Q·Kᵀ (2·s·q) and context P·V (2·s·q; latent attention:
                                             2·s·H·v_head_dim, the model's width, not the kernel's padding). The causal
                                             mask is *not* halved: kernels and Megatron/torchtitan
                                             count the full s×s product, and so does torch's
                                             FlopCounterMode. A layer with a sliding window w
                                             counts 4·min(s, w)·q: the band a windowed kernel
                                             computes (its blocks outside the window are skipped).
    - output proj     2·q·h ; with the output gate (attention_output_gate) the QKV projection also makes the
                      gates: 2·h·(2q + 2·kv)
    - Gated DeltaNet  (the layers model.layer_types marks linear_attention; Hk key heads of width dk, Hv value
                      heads of width dv, K taps) instead of QKV, core and output projection: the in-projections
                      2·h·(2·Hk·dk + 2·Hv·dv + 2·Hv), the depthwise convolution 2·K·(2·Hk·dk + Hv·dv), the
                      output projection 2·Hv·dv·h, and the chunked delta rule per value head (chunks of C = 64
                      tokens, the sequence padded to a multiple of C as the kernel computes it):
                      4·C·dk + 2·C·dv (the chunk's two C×C products and its C×C by values) + 6·dk·dv (the
                      state read twice and written once) per token. Its two unit-triangular solves are no
                      matmul, but their backward forms the C×C matrix's gradient by products: the backward
                      adds 2·C·(dk + dv) per token and value head to the 3× rule (``backward_extra``), less
                      what it skips per sequence and value head: the state's gradient products of the first
                      chunk (its state is zero, a constant) and the last chunk's state update (its final state
                      is unused), 8·C·dk·dv.
    - MLP             gelu: 4·h·f (two matrices) ; swiglu: 6·h·f (gate, up, down; f is each width)
    - per-layer inputs (per_layer_input_size p, Gemma 4's PLE): each layer's gate and up 4·h·p; once per model
                      the word embedding's projection to every layer's input 2·h·L·p (the tables are lookups)
    - MoE layer       instead of the MLP (beside it with moe_beside_mlp: the dense MLP's too): router 2·h·E, the k
                      routed experts a token is sent to (each an
                      MLP of width f_e = moe_ffn_hidden_size), the shared experts (one MLP of width
                      moe_shared_experts·f_e) and the shared-expert gate 2·h. The E - k experts a token
                      is not routed to cost it nothing: FLOPs (and MFU) follow the *active* parameters.
                      Routing is counted dropless (a capacity factor only lowers the work actually done).
  plus the logits (output layer) 2·h·V per token, once per model (once more per multi-token prediction
  depth, which also runs its projection 2·2h·h and one transformer layer, MoE or dense by the layers' rule). Given the tensor-parallel size, V
  is the padded vocabulary that the output layer really computes (``make_vocab_size_divisible_by`` x tp);
  without it, the model's vocabulary (an unpadded model such as transformers').
* Parameter counts are the model's real ones (unpadded vocabulary): what a checkpoint or a Hugging Face
  export holds; the memory estimator counts the padded rows that are allocated.
* Model FLOPs (what MFU is measured against) = 3 × forward: the backward pass costs two forward
  matmuls (gradient w.r.t. input and w.r.t. weight).
* Hardware FLOPs add what recomputation really executes: ``full`` re-runs the whole forward of every
  layer (+1 forward of the layers; the logits are never recomputed), ``selective`` re-runs only the
  attention core (+4·s·h per token per layer).
* DeepSeek Sparse Attention (``model.dsa_index_topk``), DeepSeek's definition: the attention core over each
  query's top-k keys (what a sparse kernel computes), the indexer's scores over every key (its forward: the
  selection), and with the indexer loss its backward and target over the chosen keys (``Shape.indexer_step``),
  whichever path runs (the dense mask on short sequences computes the same over every key). The top-k path
  (megand/core/transformer/dsa_sparse.py) recomputes its blocks in backward: hardware FLOPs add its attention
  cores and the indexer loss's chosen scores once more (``selective``'s core recompute is that one).

With these conventions ``model_flops_per_token ≈ 6·N + 12·L·h·s + 6·h·V`` where N counts the non-embedding
matmul weights, which is the usual ``6N + 12Lhs`` figure plus the logits term; for MoE models N is the
*active* count (``ParamCounts.active_non_embedding``), not the total.
"""

from dataclasses import MISSING, dataclass, fields, replace
from typing import Any, Mapping

from megand.core.transformer.config import TransformerConfig
from megand.core.transformer.dsa_sparse import use_sparse
from megand.core.transformer.gated_deltanet import CHUNK as LINEAR_CHUNK
from megand.core.vocab_padding import MAKE_VOCAB_SIZE_DIVISIBLE_BY, padded_vocab_size


def _get(cfg: Mapping[str, Any], key: str, default: Any = None) -> Any:
    """Read ``key`` from a dict or an OmegaConf node (both support ``get``)."""
    value = cfg.get(key, default)
    return default if value is None else value


_SHAPES: dict = {}  # Shape.from_config's results by the model dict's items
_SCHEMA_DEFAULTS = {f.name: f.default for f in fields(TransformerConfig) if f.default is not MISSING}


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
    vocab_divisible_by: int = MAKE_VOCAB_SIZE_DIVISIBLE_BY

    def padded_vocab(self, tp: int | None) -> int:
        """The vocabulary rows allocated and computed at tensor-parallel size ``tp`` (None: unpadded)."""
        return self.vocab if tp is None else padded_vocab_size(self.vocab, tp, self.vocab_divisible_by)
    qkv_bias: bool = False     # biases on Q, K, V only (Qwen-style; implied by linear_bias)
    out_bias: bool = False     # a bias on the attention output projection (GPT-OSS; implied by linear_bias)
    sinks: bool = False        # one sink logit per query head (GPT-OSS): parameters, no matmul
    moe_bias: bool = False     # biases on the router's logits and the routed experts (GPT-OSS; implied by linear_bias)
    qk_norm: bool = False      # an RMSNorm weight [head_dim] over each query and each key head (Qwen3)
    qk_norm_projection: bool = False  # the q/k norms over the whole projections: weights [q], [kv] (OLMo 2/3)
    layer_norms: int = 2       # norms of the hidden width per layer (sandwich placement: 4)
    v_norm: bool = False       # each value head normalised without a weight (Gemma 4): no parameter, no FLOPs counted
    softcap: bool = False      # the logits soft-capped (a tanh over them: no FLOPs counted)
    # Mixture of Experts (experts == 0: every layer dense)
    experts: int = 0           # routed experts E of a MoE layer
    top_k: int = 0             # experts per token
    moe_ffn: int = 0           # width f_e of one routed expert (of each of gate/up for swiglu)
    shared_experts: int = 0    # always-on experts: one MLP of width shared_experts·f_e
    shared_gate: bool = False  # the shared MLP's output scaled by sigmoid(x @ gate), gate [1, h]
    moe_freq: int = 1          # layer i is MoE when i % moe_freq == 0 (and i >= first_dense)
    first_dense: int = 0       # the first layers kept dense (DeepSeek-V3's first_k_dense_replace)
    # multi-head latent attention (kv_lora == 0: the standard attention); head_dim is then nope + rope
    q_lora: int = 0            # query latent width (0: a full-rank query projection)
    kv_lora: int = 0           # key/value latent width
    qk_rope: int = 0           # the rotary part of a query/key head
    v_head: int = 0            # value head width
    head_dim: int = 0          # width of one head (derived by the core config: hidden // heads unless set)
    windows: tuple = ()        # each layer's sliding window (None: full attention); () : none anywhere
    mtp_layers: int = 0        # multi-token prediction depths (each: a 2h->h projection, one layer, the logits)
    gate: bool = False         # attention_output_gate: the QKV projection also makes a gate per query
    linear: tuple = ()         # the Gated DeltaNet layers' ids
    lin_k_heads: int = 0       # Gated DeltaNet: key heads, value heads, their widths, the convolution's taps
    lin_v_heads: int = 0
    lin_dk: int = 0
    lin_dv: int = 0
    lin_kernel: int = 0
    index_topk: int = 0        # DeepSeek Sparse Attention: keys each query attends to (0: dense attention)
    index_heads: int = 0       # its lightning indexer's heads and head width
    index_dim: int = 0
    index_loss: bool = False   # the indexer loss trains the indexer (model.dsa_indexer_loss_coeff > 0)
    # per layer where the layers' attention differs (model.global_head_dim, num_global_query_groups,
    # global_k_eq_v, num_kv_shared_layers; core's TransformerConfig derives them): each layer's (head width,
    # key/value heads), its key/value projections per head (2; 1: values equal to the keys; 0: none) and the
    # layer whose keys and values it reads (None: its own); () where every layer is alike
    layer_attention: tuple = ()
    layer_ffn: tuple = ()  # and each layer's dense MLP width (model.double_wide_mlp: the sharing layers' twice)
    layer_kv_rows: tuple = ()
    kv_sources: tuple = ()

    @property
    def varied(self) -> bool:
        """Whether the layers' attention differs from layer to layer (their shapes or key/value projections)."""
        return bool(self.layer_attention)

    def at(self, layer: int | None) -> "Shape":
        """The shape of layer ``layer``'s attention (a full-attention layer's own head width and key/value
        heads); None: the layers without a shape of their own."""
        if layer is None or not self.layer_attention:
            return self
        head_dim, groups = self.layer_attention[layer]
        return self if (head_dim, groups) == (self.head_dim, self.groups) else replace(self, head_dim=head_dim,
                                                                                      groups=groups)

    def ffn_of(self, layer: int | None) -> int:
        """The dense MLP width of layer ``layer`` (None: ffn_hidden_size)."""
        return self.ffn if layer is None or not self.layer_ffn else self.layer_ffn[layer]

    def kv_rows(self, layer: int | None) -> int:
        """Key/value projections of layer ``layer`` per key/value head: 2, 1 (values equal to the keys), 0 (an
        earlier layer's keys and values)."""
        return 2 if layer is None or not self.layer_kv_rows else self.layer_kv_rows[layer]

    def projection_flops(self, layer: int | None = None) -> int:
        """Forward FLOPs per token of the QKV and output projections of standard attention and of the dense MLP
        in ``layer`` (None: a layer without a shape of its own)."""
        s, h = self.at(layer), self.hidden
        mlp = (6 if self.swiglu else 4) * h * self.ffn_of(layer)
        return 2 * h * (s.q_dim * (2 if self.gate else 1) + self.kv_rows(layer) * s.kv_dim) + 2 * s.q_dim * h + mlp
    ple: int = 0               # per-layer input embeddings' width p (0: none); each layer's table has ple_vocab rows
    ple_vocab: int = 0
    moe_beside: bool = False   # the MoE block beside the dense MLP (Gemma 4): the MoE layers keep the MLP too

    @property
    def linear_padded_seq(self) -> int:
        """The sequence as the chunked delta rule computes it: padded to a multiple of its chunk."""
        return -(-self.seq // LINEAR_CHUNK) * LINEAR_CHUNK

    @property
    def linear_backward_extra(self) -> int:
        """Per token: the backward's products beyond twice the forward's, over every Gated DeltaNet layer
        (the triangular solves' matrix gradients, less the first and last chunks' state products it skips)."""
        C, dk, dv = LINEAR_CHUNK, self.lin_dk, self.lin_dv
        per_sequence = 2 * C * (dk + dv) * self.linear_padded_seq - 8 * C * dk * dv
        return len(self.linear) * self.lin_v_heads * per_sequence / self.seq

    def core_flops(self, layer: int) -> int:
        """Forward FLOPs per token of layer ``layer``'s token mixing core: softmax attention over the keys it
        sees, or the chunked delta rule."""
        if layer in self.linear:
            C, dk, dv = LINEAR_CHUNK, self.lin_dk, self.lin_dv
            per_head = (4 * C * dk + 2 * C * dv + 6 * dk * dv) * self.linear_padded_seq // self.seq
            conv = 2 * self.lin_kernel * (2 * self.lin_k_heads * dk + self.lin_v_heads * dv)
            return conv + self.lin_v_heads * per_head
        s = self.at(layer)
        return 2 * (s.q_dim + s.value_dim) * self.keys_seen(layer)

    @property
    def q_dim(self) -> int:
        """Width of all query heads (= hidden unless head_dim is set apart)."""
        return self.heads * self.head_dim

    def keys_seen(self, layer: int) -> int:
        """Keys each query's attention core is counted over in ``layer`` (the sequence, or its window; a
        multi-token prediction layer, after the last, has the last one's window)."""
        window = self.windows[min(layer, self.layers - 1)] if self.windows else None
        if self.index_topk:  # DeepSeek Sparse Attention: the top-k keys a sparse kernel computes
            window = self.index_topk
        return self.seq if window is None else min(self.seq, window)

    @property
    def indexer_forward(self) -> int:
        """Forward FLOPs per token of one layer's lightning indexer: its projections (queries from the query
        latent, the shared key, the head weights) and its scores over every key (each head's q·k, then the
        weighted sum over heads)."""
        if not self.index_topk:
            return 0
        hi, di, h = self.index_heads, self.index_dim, self.hidden
        return 2 * (self.q_lora * hi * di + h * di + h * hi) + 2 * (hi * di + hi) * self.seq

    @property
    def index_keys(self) -> int:
        """DeepSeek Sparse Attention: the keys each query attends to (its top-k, or the whole sequence)."""
        return min(self.seq, self.index_topk)

    @property
    def topk_path(self) -> bool:
        """DeepSeek Sparse Attention runs its top-k gather, not the dense mask (the model's one rule)."""
        return bool(self.index_topk) and use_sparse(self.seq, self.index_topk)

    @property
    def index_loss_scores(self) -> int:
        """Per token: one layer's indexer scores over the chosen keys (the indexer loss's input)."""
        return 2 * (self.index_heads * self.index_dim + self.index_heads) * self.index_keys

    @property
    def indexer_step(self) -> int:
        """What a training step computes per token for one layer's indexer: its forward only (no gradient
        reaches it) or, with the indexer loss, also its backward (weight gradients of the projections: 1x;
        both operands of the score products over the chosen keys: 2x; its inputs are detached) and the loss's
        target, the main attention's scores over the chosen keys (2·k·H·width, the kernels' padded width).
        DeepSeek's definition, as for the attention: the top-k path's arithmetic, whichever path runs (the
        dense mask computes the same over every key; equal when the top-k covers the sequence)."""
        if not self.index_topk or not self.index_loss:
            return self.indexer_forward
        hi, di, h = self.index_heads, self.index_dim, self.hidden
        projections = 2 * (self.q_lora * hi * di + h * di + h * hi)
        scores = 2 * (hi * di + hi) * self.seq
        target = 2 * self.heads * max(self.head_dim, self.v_head) * self.index_keys
        return 2 * projections + scores + 2 * self.index_loss_scores + target

    @property
    def kv_dim(self) -> int:
        return self.groups * self.head_dim

    @property
    def value_dim(self) -> int:
        """Width of all value heads (the attention output): q_dim unless latent attention sets v_head_dim."""
        return self.heads * self.v_head if self.kv_lora else self.q_dim

    def is_moe(self, layer: int) -> bool:
        return self.experts > 0 and layer % self.moe_freq == 0 and layer >= self.first_dense

    @property
    def moe_layers(self) -> int:
        return sum(self.is_moe(i) for i in range(self.layers))

    @property
    def dense_layers(self) -> int:
        return self.layers - self.moe_layers

    @property
    def mtp_layer_ids(self) -> range:
        """The multi-token prediction layers' global indices (after the main model's)."""
        return range(self.layers, self.layers + self.mtp_layers)

    @classmethod
    def from_config(cls, model: Mapping[str, Any]) -> "Shape":
        if isinstance(model, FrozenModel):
            return model.shape
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
        # a key the mapping leaves out has the model schema's default (core's TransformerConfig): the model
        # a run builds, never a default of this module's own
        model = {**_SCHEMA_DEFAULTS, **{k: v for k, v in model.items() if v is not None}}
        arch = _get(model, "arch")
        heads = int(_get(model, "num_attention_heads"))
        hidden = int(_get(model, "hidden_size"))
        head_dim = model.get("head_dim")
        if head_dim is None and hidden % heads:
            raise ValueError(f"hidden_size {hidden} is not divisible by num_attention_heads {heads} (set head_dim)")
        attention = _attention_schema(model)  # the head widths as the model schema derives them
        return cls(
            arch=arch,
            layers=int(_get(model, "num_layers")),
            hidden=hidden,
            ffn=int(_get(model, "ffn_hidden_size", 4 * hidden)),
            heads=heads,
            groups=attention.query_groups,
            seq=int(_get(model, "seq_length")),
            vocab=int(_get(model, "vocab_size")),
            swiglu=_get(model, "activation") in ("swiglu", "geglu"),  # gated: gate, up, down (GeGLU alike)
            layernorm=_get(model, "norm") == "layernorm",
            linear_bias=arch == "gpt",
            learned_positions=_get(model, "position_embedding") == "learned",
            tied=bool(_get(model, "tie_embeddings")),
            vocab_divisible_by=int(_get(model, "make_vocab_size_divisible_by", MAKE_VOCAB_SIZE_DIVISIBLE_BY)),
            qkv_bias=bool(_get(model, "qkv_bias", False)),
            out_bias=bool(_get(model, "attention_out_bias", False)),
            sinks=bool(_get(model, "attention_sinks", False)),
            moe_bias=bool(_get(model, "moe_bias", False)),
            qk_norm=bool(_get(model, "qk_norm", False)),
            qk_norm_projection=_get(model, "qk_norm_scope", "head") == "projection",
            layer_norms=4 if _get(model, "norm_placement", "pre") == "sandwich" else 2,
            v_norm=bool(_get(model, "v_norm", False)),
            softcap=_get(model, "final_logit_softcapping") is not None,
            head_dim=attention.head_dim,
            **_latent_fields(model),
            windows=_windows(model, int(_get(model, "num_layers"))),
            mtp_layers=int(_get(model, "mtp_layers", 0)),
            gate=bool(_get(model, "attention_output_gate", False)),
            **_linear_fields(model),
            **_sparse_fields(model),
            **_moe_fields(model, int(_get(model, "ffn_hidden_size", 4 * hidden))),
            **_layer_attention_fields(attention),
            **_per_layer_input_fields(model),
        )


class FrozenModel(dict):
    """A model config (plain values) that never changes, holding its :class:`Shape`: the planner asks the
    estimator about hundreds of thousands of layouts of one model, and every answer reads the shape."""

    def __init__(self, model: Mapping[str, Any]):
        super().__init__(model)
        self.shape = Shape._from_config(self)

    def _frozen(self, *args, **kwargs):
        raise TypeError("a FrozenModel does not change: copy it into a dict first")

    __setitem__ = __delitem__ = update = pop = popitem = clear = setdefault = _frozen
    # hashed by identity (it never changes), so the estimator can memoise its answers per model; two equal
    # FrozenModels are still equal, they only miss each other's cache entries
    __hash__ = object.__hash__

    def __reduce__(self):  # copies and pickles are made from the plain values
        return FrozenModel, (dict(self),)


# the model keys that shape the attention heads
_ATTENTION_KEYS = ("hidden_size", "num_attention_heads", "num_query_groups", "head_dim", "position_embedding",
                   "qk_norm", "qk_norm_scope", "qkv_bias", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                   "v_head_dim", "num_layers", "sliding_window", "global_head_dim", "num_global_query_groups",
                   "global_k_eq_v", "num_kv_shared_layers", "ffn_hidden_size", "double_wide_mlp")


def _layer_attention_fields(attention: TransformerConfig) -> dict:
    """Each layer's attention shape, key/value projections and key/value source, where they differ per layer."""
    if not (attention.global_head_dim or attention.num_global_query_groups or attention.global_k_eq_v
            or attention.num_kv_shared_layers):
        return {}
    layers = range(attention.num_layers)
    shapes = (attention.layer_config(i) for i in layers)
    return dict(layer_attention=tuple((c.head_dim, c.query_groups) for c in shapes),
                layer_ffn=tuple(attention.ffn_width(i) for i in layers),
                layer_kv_rows=tuple(attention.kv_rows(i) for i in layers),
                kv_sources=tuple(attention.kv_source(i) for i in layers))


def _attention_schema(model: Mapping[str, Any]) -> TransformerConfig:
    """Core's config of ``model``'s attention keys: its derived head width and query groups."""
    keys = {k: model[k] for k in _ATTENTION_KEYS if k in model}
    if hasattr(keys.get("sliding_window"), "__len__"):  # a list of the run's config (OmegaConf's, too)
        keys["sliding_window"] = tuple(keys["sliding_window"])
    return TransformerConfig(**keys)


def _windows(model: Mapping[str, Any], layers: int) -> tuple:
    window = model.get("sliding_window")
    if window is None:
        return ()
    return tuple(window) if isinstance(window, (list, tuple)) or hasattr(window, "__len__") else (window,) * layers


def _linear_fields(model: Mapping[str, Any]) -> dict:
    linear = tuple(i for i, t in enumerate(model.get("layer_types") or ()) if t == "linear_attention")
    if not linear:
        return {}
    return dict(linear=linear, lin_k_heads=int(model["linear_num_key_heads"]),
                lin_v_heads=int(model["linear_num_value_heads"]), lin_dk=int(model["linear_key_head_dim"]),
                lin_dv=int(model["linear_value_head_dim"]), lin_kernel=int(model["linear_conv_kernel"]))


def _sparse_fields(model: Mapping[str, Any]) -> dict:
    if not model.get("dsa_index_topk"):
        return {}
    return dict(index_topk=int(model["dsa_index_topk"]), index_heads=int(_get(model, "dsa_index_heads")),
                index_dim=int(_get(model, "dsa_index_head_dim")),
                index_loss=bool(_get(model, "dsa_indexer_loss_coeff", 0.0)))


def _latent_fields(model: Mapping[str, Any]) -> dict:
    if not model.get("kv_lora_rank"):
        return {}
    return dict(q_lora=int(_get(model, "q_lora_rank", 0)), kv_lora=int(model["kv_lora_rank"]),
                qk_rope=int(model["qk_rope_head_dim"]), v_head=int(model["v_head_dim"]))


def _per_layer_input_fields(model: Mapping[str, Any]) -> dict:
    width = int(_get(model, "per_layer_input_size", 0) or 0)
    if not width:
        return {}
    return dict(ple=width, ple_vocab=int(_get(model, "per_layer_input_vocab_size") or _get(model, "vocab_size")))


def _moe_fields(model: Mapping[str, Any], ffn: int) -> dict:
    experts = int(_get(model, "num_experts", 0))
    if not experts:
        return {}
    return dict(experts=experts, top_k=int(_get(model, "moe_top_k", 2)), moe_beside=bool(_get(model, "moe_beside_mlp")),
                moe_ffn=int(_get(model, "moe_ffn_hidden_size", ffn)),
                shared_experts=int(_get(model, "moe_shared_experts", 0)),
                shared_gate=bool(_get(model, "moe_shared_expert_gate", False)),
                moe_freq=int(_get(model, "moe_layer_freq", 1)),
                first_dense=int(_get(model, "moe_first_k_dense_replace", 0)))


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
    # MoE layers only (0 in dense layers; the mlp_* fields above are then the shared experts' MLP):
    router: int = 0             # router weight [E, h], replicated over tp
    shared_gate: int = 0        # shared-expert gate [1, h], replicated over tp
    experts_split: int = 0      # all E routed experts: fc1 weight+bias and fc2 weight (split over ep and etp)
    experts_replicated: int = 0  # all E routed experts: fc2 bias [E, h] (split over ep, replicated over etp)
    top_k: int = 0
    experts: int = 0
    attention_replicated: int = 0  # latent attention: the down projections and latent norms, replicated over tp
    indexer: int = 0  # DeepSeek Sparse Attention: the lightning indexer's weights and key norm, replicated over tp
    # the key/value rows of qkv_weight and qkv_bias, and the key/value heads they hold: split over at most
    # that many tp ranks (a larger tp replicates each head over the ranks sharing it)
    kv_part: int = 0
    kv_heads: int = 0
    sinks: int = 0  # the attention sinks, one per query head: split over tp with the heads
    # per-layer input embeddings: the gate, up and norm (replicated over tp), and the layer's table (an embedding,
    # split by vocab rows over tp; not a matmul weight)
    per_layer_input: int = 0
    per_layer_table: int = 0

    @property
    def total(self) -> int:
        return self.dense + self.experts_split + self.experts_replicated

    @property
    def dense(self) -> int:
        """Everything but the routed experts (what every token uses)."""
        return (self.qkv_weight + self.qkv_bias + self.proj_weight + self.proj_bias + self.mlp_in_weight
                + self.mlp_in_bias + self.mlp_out_weight + self.mlp_out_bias + self.norms + self.router
                + self.shared_gate + self.attention_replicated + self.sinks + self.indexer + self.per_layer_input
                + self.per_layer_table)

    @property
    def active(self) -> int:
        """Parameters one token uses: the dense part and top_k of the E routed experts."""
        if not self.experts:
            return self.total
        return self.dense + (self.experts_split + self.experts_replicated) * self.top_k // self.experts

    def per_tp_rank(self, tp: int, ep: int = 1, etp: int | None = None) -> float:
        """Column-parallel (qkv, mlp_in) weights+biases and row-parallel weights are split over tp;
        row-parallel biases, norms, the router and the shared-expert gate are replicated. Routed experts
        are split over ep (whole experts) and etp (expert tensor parallelism; default tp)."""
        etp = tp if etp is None else etp
        split = (self.qkv_weight + self.qkv_bias - self.kv_part + self.proj_weight + self.sinks
                 + self.mlp_in_weight + self.mlp_in_bias + self.mlp_out_weight)
        kv_split = min(tp, self.kv_heads) if self.kv_heads else tp
        return (split / tp + self.kv_part / kv_split + self.proj_bias + self.mlp_out_bias + self.norms + self.router + self.shared_gate
                + self.attention_replicated + self.indexer + self.experts_split / (ep * etp) + self.experts_replicated / ep
                + self.per_layer_input + self.per_layer_table / tp)


def _mlp_params(shape: Shape, width: int) -> dict:
    """The four tensors of a (dense or shared-expert) MLP of ``width``."""
    h, bias = shape.hidden, shape.linear_bias
    mlp_in = (2 if shape.swiglu else 1) * h * width
    return dict(mlp_in_weight=mlp_in, mlp_in_bias=(mlp_in // h) if bias and width else 0,
                mlp_out_weight=width * h, mlp_out_bias=h if bias and width else 0)


def layer_params(shape: Shape, moe: bool = False, layer: int | None = None) -> LayerParams:
    """One layer's parameters: a dense layer, or (``moe``) a MoE layer of ``shape``; ``layer``: its id (a
    Gated DeltaNet layer has its own token mixer; None: an attention layer)."""
    own = shape.at(layer)  # the layer's attention shape; its key/value projections: rows per head
    h, q, kv, rows = shape.hidden, own.q_dim, own.kv_dim, shape.kv_rows(layer)
    bias = shape.linear_bias
    attention = dict(
        qkv_weight=h * (q * (2 if shape.gate else 1) + rows * kv),
        qkv_bias=(q + rows * kv) if bias or shape.qkv_bias else 0,
        proj_weight=q * h,
        proj_bias=h if bias or shape.out_bias else 0,
        sinks=shape.heads if shape.sinks else 0,
        norms=shape.layer_norms * norm_params(shape) + (qk_norm_params(own, keys=rows > 0) if shape.qk_norm else 0),
        kv_part=rows * kv * (h + (1 if bias or shape.qkv_bias else 0)), kv_heads=own.groups,
    )
    if shape.kv_lora:
        attention.update(_latent_params(shape))
    if layer in shape.linear:
        attention = _linear_params(shape)
    if shape.ple:  # gate [p, h], up [h, p], the norm of their output; the table [V, p]
        attention.update(per_layer_input=2 * h * shape.ple + norm_params(shape), per_layer_table=shape.ple_vocab * shape.ple)
    if not moe:
        return LayerParams(**attention, **_mlp_params(shape, shape.ffn_of(layer)))
    E, fe = shape.experts, shape.moe_ffn
    expert_in = (2 if shape.swiglu else 1) * fe
    bias = bias or shape.moe_bias
    if shape.moe_beside:  # the dense MLP stays; the block's three norms, the router's norm and per-expert scale
        attention["norms"] += 3 * norm_params(shape)
    return LayerParams(
        **attention, **_mlp_params(shape, shape.ffn_of(layer) if shape.moe_beside else shape.shared_experts * fe),
        router=E * h + (E if shape.moe_bias else 0) + ((h + E) if shape.moe_beside else 0),
        shared_gate=h if shape.shared_gate and shape.shared_experts else 0,
        experts_split=E * (expert_in * h + (expert_in if bias else 0) + h * fe),
        experts_replicated=E * h if bias else 0,
        top_k=shape.top_k, experts=E,
    )


def _linear_params(shape: Shape) -> dict:
    """A Gated DeltaNet token mixer's tensors: the in-projections (``qkv_weight``), the convolution's taps,
    ``A_log`` and ``dt_bias`` (split over tp with the heads: ``qkv_bias``), the output projection and the gated
    norm (replicated)."""
    h, Hk, Hv, dk, dv = shape.hidden, shape.lin_k_heads, shape.lin_v_heads, shape.lin_dk, shape.lin_dv
    channels = 2 * Hk * dk + Hv * dv
    return dict(qkv_weight=h * (2 * Hk * dk + 2 * Hv * dv + 2 * Hv), qkv_bias=channels * shape.lin_kernel + 2 * Hv,
                proj_weight=Hv * dv * h, proj_bias=0, norms=2 * norm_params(shape) + dv)


def _latent_params(shape: Shape) -> dict:
    """Latent attention's tensors: the up projections (split over tp, counted as ``qkv_weight``), the output
    projection, and the replicated down projections with their latent norms."""
    h, H, qk, r_q, r_kv = shape.hidden, shape.heads, shape.head_dim, shape.q_lora, shape.kv_lora
    nope = qk - shape.qk_rope
    up = (r_q * H * qk if r_q else h * H * qk) + r_kv * H * (nope + shape.v_head)
    down = (h * r_q + r_q if r_q else 0) + h * (r_kv + shape.qk_rope) + r_kv
    hi, di = shape.index_heads, shape.index_dim
    indexer = (r_q * hi * di + h * di + 2 * di + h * hi) if shape.index_topk else 0  # wq, wk, k_norm, weights
    return dict(qkv_weight=up, qkv_bias=0, proj_weight=shape.value_dim * h, proj_bias=0, attention_replicated=down,
                kv_part=0, kv_heads=0, indexer=indexer)


def qk_norm_params(shape: Shape, keys: bool = True) -> int:
    """The q and k norms' weights: one per head width, or one per channel of the whole projections (``keys``
    False: a layer that reads another layer's keys has the query norm alone)."""
    if shape.qk_norm_projection:
        return shape.q_dim + (shape.kv_dim if keys else 0)
    return (2 if keys else 1) * shape.head_dim


def norm_params(shape: Shape) -> int:
    return (2 if shape.layernorm else 1) * shape.hidden


@dataclass(frozen=True)
class ParamCounts:
    total: int
    non_embedding: int   # every parameter except word/position embeddings and an untied output layer
    per_layer: int       # a dense layer
    word_embedding: int
    position_embedding: int
    output_layer: int    # 0 when tied to the word embedding
    final_norm: int
    # Mixture of Experts (equal to the totals / 0 for a dense model)
    active: int = 0                # parameters one token uses: top_k of the routed experts of each MoE layer
    active_non_embedding: int = 0
    per_moe_layer: int = 0         # a MoE layer, all experts
    moe_layers: int = 0
    mtp: int = 0                   # of non_embedding: the multi-token prediction depths (all experts)
    # per-layer input embeddings: every layer's table (of total, not of non_embedding) and the word embedding's
    # projection to every layer's input with its norm (of non_embedding; on the first pipeline stage)
    per_layer_tables: int = 0
    per_layer_projection: int = 0


def param_counts(model: Mapping[str, Any]) -> ParamCounts:
    shape = Shape.from_config(model)
    dense, moe = layer_params(shape), layer_params(shape, moe=True)
    word = shape.vocab * shape.hidden
    pos = shape.seq * shape.hidden if shape.learned_positions else 0
    out = 0 if shape.tied else shape.vocab * shape.hidden
    final_norm = norm_params(shape)
    n_moe = shape.moe_layers
    mtp, mtp_active = mtp_params(shape)
    layers = [layer_params(shape, moe=shape.is_moe(i), layer=i) for i in range(shape.layers)]
    tables = sum(p.per_layer_table for p in layers)
    projection = per_layer_projection_params(shape)
    non_embedding = sum(p.total for p in layers) - tables + projection + final_norm + mtp
    active_non_embedding = sum(p.active for p in layers) - tables + projection + final_norm + mtp_active
    return ParamCounts(total=non_embedding + tables + word + pos + out, non_embedding=non_embedding,
                       per_layer=dense.total, word_embedding=word, position_embedding=pos,
                       output_layer=out, final_norm=final_norm,
                       active=active_non_embedding + tables + word + pos + out, active_non_embedding=active_non_embedding,
                       per_moe_layer=moe.total if n_moe else 0, moe_layers=n_moe, mtp=mtp, per_layer_tables=tables,
                       per_layer_projection=projection)


def per_layer_projection_params(shape: Shape) -> int:
    """The word embedding's projection to every layer's per-layer input ``[L·p, h]`` and its norm ``[p]`` (the
    first stage's, replicated over tp); 0 without per-layer input embeddings."""
    return shape.layers * shape.ple * shape.hidden + shape.ple if shape.ple else 0


def mtp_depth_extra(shape: Shape) -> int:
    """One multi-token prediction depth's parameters besides its transformer layer: the embedding and hidden
    norms, the projection ``[h, 2h]`` and the depth's final norm."""
    return 3 * norm_params(shape) + 2 * shape.hidden * shape.hidden


def mtp_params(shape: Shape) -> tuple[int, int]:
    """(all, active) parameters of the multi-token prediction depths (they share the embedding and the output
    layer with the main model)."""
    layers = [layer_params(shape, moe=shape.is_moe(i)) for i in shape.mtp_layer_ids]
    extra = shape.mtp_layers * mtp_depth_extra(shape)
    return extra + sum(p.total for p in layers), extra + sum(p.active for p in layers)


@dataclass(frozen=True)
class ForwardFlopsPerToken:
    """Forward matmul FLOPs for one token (see the module docstring)."""

    layer_dense: int      # QKV, output projection and MLP of one dense layer
    layer_attention: int  # attention core (scores + context) of one layer with full attention
    logits: int
    layers: int
    moe_layers: int = 0   # of ``layers``, those with a MoE block instead of the MLP
    layer_moe: int = 0    # QKV, output projection, router, k routed and the shared experts of one MoE layer
    windowed_attention: int | None = None  # the token-mixing cores of all layers when they differ per layer
    # (sliding windows, Gated DeltaNet layers)
    linear_layers_delta: int = 0  # Gated DeltaNet layers: their projections' FLOPs minus attention's, all of them
    # layers whose projections differ from ``layer_dense``'s (a full layer's own shape, keys as values, an earlier
    # layer's keys and values, a double-wide MLP): their projections' FLOPs minus a plain layer's, all of them
    attention_layers_delta: int = 0
    backward_extra: float = 0  # what the backward computes beyond twice the forward (Gated DeltaNet's solves)
    # multi-token prediction depths (all of them): their transformer layers' matmuls, the 2h->h projections,
    # the layers' attention cores and their logits
    mtp_layers_matmul: int = 0
    mtp_proj: int = 0
    mtp_attention: int = 0
    mtp_logits: int = 0
    # DeepSeek Sparse Attention: every layer's indexer (the depths' too), its forward and what a training step
    # computes for it (not 3x its forward: see Shape.indexer_step); outside ``total``
    indexer: int = 0
    indexer_step: int = 0
    # DeepSeek Sparse Attention's top-k path: what its blocks compute again in every backward (they keep only
    # their inputs): the attention cores over the chosen keys, the indexer loss's chosen scores. Hardware
    # FLOPs, never model FLOPs; 0 on the dense mask
    topk_core_recompute: int = 0
    topk_loss_recompute: int = 0
    per_layer_projection: int = 0  # the word embedding's projection to every layer's per-layer input (2·h·L·p)

    @property
    def attention(self) -> int:
        """The attention cores of all layers."""
        return self.layers * self.layer_attention if self.windowed_attention is None else self.windowed_attention

    @property
    def layers_matmul(self) -> int:
        """Every layer's matmuls except the attention core."""
        return ((self.layers - self.moe_layers) * self.layer_dense + self.moe_layers * self.layer_moe
                + self.linear_layers_delta + self.attention_layers_delta)

    @property
    def mtp(self) -> int:
        """Everything the multi-token prediction depths compute."""
        return self.mtp_layers_matmul + self.mtp_proj + self.mtp_attention + self.mtp_logits

    @property
    def total(self) -> int:
        return self.layers_matmul + self.attention + self.logits + self.mtp + self.per_layer_projection


def forward_flops_per_token(model: Mapping[str, Any], tp: int | None = None) -> ForwardFlopsPerToken:
    """``tp``: the logits span the vocabulary padded for that tensor-parallel size (None: unpadded)."""
    s = Shape.from_config(model)
    h, q = s.hidden, s.q_dim
    mlp = 6 if s.swiglu else 4  # per h·width of one MLP
    attention = 2 * h * (q * (2 if s.gate else 1) + 2 * s.kv_dim) + 2 * q * h
    if s.kv_lora:  # every matmul weight of latent attention is used once per token
        latent = _latent_params(s)
        attention = 2 * (latent["qkv_weight"] + latent["proj_weight"] + latent["attention_replicated"]
                         - (s.q_lora if s.q_lora else 0) - s.kv_lora)  # the norms are no matmul
    ple = 4 * h * s.ple  # per-layer inputs: the gate and up of every layer (0 without)
    dense = attention + ple + mlp * h * s.ffn
    moe = 0
    if s.moe_layers:
        moe = (attention + ple + 2 * h * s.experts + s.top_k * mlp * h * s.moe_ffn
               + mlp * h * s.shared_experts * s.moe_ffn + (2 * h if s.shared_gate and s.shared_experts else 0)
               + (mlp * h * s.ffn if s.moe_beside else 0))
    core = 2 * (q + s.value_dim)  # per key seen: scores and context
    windowed = (sum(s.core_flops(i) for i in range(s.layers)) if s.windows or s.linear or s.index_topk or s.varied
                else None)
    varied = sum(s.projection_flops(i) - s.projection_flops() for i in range(s.layers)) if s.varied else 0
    linear = 0
    if s.linear:
        lp = _linear_params(s)
        linear = len(s.linear) * (2 * (lp["qkv_weight"] + lp["proj_weight"]) - attention)
    logits = 2 * h * s.padded_vocab(tp)
    return ForwardFlopsPerToken(
        layer_dense=dense, layer_attention=core * s.seq, windowed_attention=windowed, logits=logits,
        layers=s.layers, moe_layers=s.moe_layers, layer_moe=moe, linear_layers_delta=linear,
        attention_layers_delta=varied,
        backward_extra=s.linear_backward_extra if s.linear else 0,
        mtp_layers_matmul=sum(moe if s.is_moe(i) else dense for i in s.mtp_layer_ids),  # MoE by the same rule
        mtp_proj=s.mtp_layers * 2 * (2 * h) * h,
        mtp_attention=sum(core * s.keys_seen(i) for i in s.mtp_layer_ids), mtp_logits=s.mtp_layers * logits,
        indexer=(s.layers + s.mtp_layers) * s.indexer_forward, indexer_step=(s.layers + s.mtp_layers) * s.indexer_step,
        per_layer_projection=2 * h * s.layers * s.ple,
        **_topk_recompute(s, windowed + sum(core * s.keys_seen(i) for i in s.mtp_layer_ids) if s.topk_path else 0))


def _topk_recompute(s: Shape, cores: int) -> dict:
    if not s.topk_path:
        return {}
    return dict(topk_core_recompute=cores,
                topk_loss_recompute=(s.layers + s.mtp_layers) * s.index_loss_scores if s.index_loss else 0)


def model_flops_per_token(model: Mapping[str, Any], tp: int | None = None) -> int:
    """Forward + backward FLOPs per token (3 × forward, and what a backward computes beyond twice its forward),
    independent of recomputation."""
    fwd = forward_flops_per_token(model, tp)
    return 3 * fwd.total + fwd.backward_extra + fwd.indexer_step


def hardware_flops_per_token(model: Mapping[str, Any], recompute: str = "none", tp: int | None = None,
                             recomputed_layers=None) -> int:
    """Model FLOPs plus the forward work that activation recomputation executes again;
    ``recomputed_layers``: the ids of the layers that recompute (``train.recompute_layers``), None: all."""
    fwd = forward_flops_per_token(model, tp)
    if recompute not in ("none", "selective", "full"):
        raise ValueError(f"recompute must be none|selective|full, got {recompute!r}")
    # the top-k path's blocks recompute in backward whatever train.recompute (selective's core is theirs)
    blocks = fwd.topk_core_recompute + fwd.topk_loss_recompute
    if recompute == "none":
        return 3 * fwd.total + fwd.backward_extra + fwd.indexer_step + blocks
    if recomputed_layers is None:  # the multi-token prediction layers recompute as the others do
        extra = fwd.attention + fwd.mtp_attention
        if recompute == "selective":
            blocks -= fwd.topk_core_recompute
        if recompute == "full":
            extra += fwd.layers_matmul + fwd.mtp_layers_matmul + fwd.indexer
    else:
        s = Shape.from_config(model)
        extra = 0
        for i in recomputed_layers:
            extra += s.core_flops(i)  # the token-mixing core (attention's scores and context)
            if recompute == "selective" and fwd.topk_core_recompute:
                blocks -= s.core_flops(i)
            if recompute == "full":
                extra += fwd.layer_moe if s.is_moe(i) else fwd.layer_dense
                extra += s.indexer_forward
                if i in s.linear:
                    extra += fwd.linear_layers_delta // len(s.linear)
                if s.varied:
                    extra += s.projection_flops(i) - s.projection_flops()
    return 3 * fwd.total + fwd.backward_extra + fwd.indexer_step + extra + blocks


def flops_per_iteration(model: Mapping[str, Any], global_batch_size: int,
                        recompute: str = "none", tp: int | None = None, recomputed_layers=None) -> dict:
    """Model and hardware FLOPs of one optimizer step over ``global_batch_size`` sequences; ``tp``: of a
    megand model at that tensor-parallel size (its padded logits), None: of an unpadded model;
    ``recomputed_layers``: the layer ids that recompute (None: all).

    Divide by (iteration time × world size) for achieved FLOP/s per rank.
    """
    tokens = global_batch_size * int(_get(model, "seq_length"))
    return {
        "tokens": tokens,
        "model_flops": tokens * model_flops_per_token(model, tp),
        "hardware_flops": tokens * hardware_flops_per_token(model, recompute, tp, recomputed_layers),
    }


def fp8_flops_fraction(model: Mapping[str, Any], fp8_layers: int, tp: int | None = None) -> float:
    """The share of the model FLOPs (forward and backward) that ``train.fp8`` runs as FP8 GEMMs: the linear
    and expert products of ``fp8_layers`` transformer layers (the attention core, the router and the
    output layer stay in bf16). Dense and MoE layers are weighed by their share of the layers."""
    fwd = forward_flops_per_token(model, tp)
    if not fp8_layers or not fwd.layers:
        return 0.0
    router = 2 * int(_get(model, "hidden_size")) * int(_get(model, "num_experts") or 0)
    per_layer = (fwd.layers_matmul - fwd.moe_layers * router) / fwd.layers
    return min(fp8_layers, fwd.layers) * per_layer / fwd.total
