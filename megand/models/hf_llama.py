"""State-dict adapter: megand LLaMA-style models <-> ``transformers`` ``LlamaForCausalLM``.

Separate ``q_proj``/``k_proj``/``v_proj`` are megand's fused QKV, ``gate_proj``/``up_proj`` its fused
SwiGLU fc1; both use the rotate-half RoPE; RMSNorm's epsilon is ``model.norm_eps``. RoPE scaling
(``rope_parameters`` with rope_type linear, llama3 or yarn: Llama 3.1+) is ``model.rope_scaling``, and a
``head_dim`` apart from hidden/heads is ``model.head_dim``; the LLaMA-family adapters (Qwen2, Qwen3) share
these helpers.
"""

from __future__ import annotations

from megand.core.transformer.attention import fuse_qkv, split_qkv
from megand.core.transformer.config import resolve_head_dim
from megand.core.transformer.mlp import fuse_swiglu, split_swiglu
from megand.core.transformer.rope import ROPE_TYPES, RopeScaling
from megand.models.hf import SIZE, Family, Rule, When, dims, equals, norm_eps

# the architecture keys that mark every LLaMA-family architecture (RMSNorm, SwiGLU, RoPE, no linear biases) ...
LLAMA_MARKS = frozenset({"arch", "norm", "activation", "position_embedding"})
LLAMA_SHAPE = {**SIZE, **{k: equals(k, v) for k, v in dict(arch="llama", norm="rmsnorm", activation="swiglu",
                                                           position_embedding="rope").items()},
               "rope_theta": None, "rope_scaling": None}
# ... and those of its standard attention (grouped queries, a head width of its own)
ATTENTION = dict.fromkeys(("num_query_groups", "head_dim"))
# the config.json keys llama_like_config reads (rope_theta/rope_scaling: older files' spelling of rope_parameters)
LLAMA_LIKE_READS = frozenset({
    "hidden_size", "num_attention_heads", "num_hidden_layers", "num_key_value_heads", "head_dim", "hidden_act",
    "intermediate_size", "max_position_embeddings", "vocab_size", "rms_norm_eps", "tie_word_embeddings",
    "initializer_range", "rope_parameters", "rope_theta", "rope_scaling", "partial_rotary_factor"})
# the config.json keys of a Qwen-family window (qwen_windows; transformers derives layer_types from max_window_layers)
QWEN_WINDOW_READS = frozenset({"use_sliding_window", "sliding_window", "layer_types", "max_window_layers"})
DROPOUT = frozenset({"attention_dropout"})  # a training choice: imports as megand's 0.0


def rope_parameters(m) -> dict:
    """The ``transformers`` ``rope_parameters`` of a megand ``model`` config (its theta and scaling)."""
    out = {"rope_type": "default", "rope_theta": float(m.get("rope_theta", 10000.0))}
    scaling = m.get("rope_scaling")
    if scaling:
        scaling = scaling if isinstance(scaling, RopeScaling) else RopeScaling.from_dict(dict(scaling))
        required = {"linear": ("factor",),
                    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
                    "yarn": ("factor", "original_max_position_embeddings"),
                    "proportional": ("partial_rotary_factor",)}[scaling.rope_type]
        optional = ("beta_fast", "beta_slow", "mscale", "mscale_all_dim", "attention_factor", "truncate")
        defaults = RopeScaling(scaling.rope_type, scaling.factor)
        out.update({k: getattr(scaling, k) for k in required}, rope_type=scaling.rope_type)
        if scaling.rope_type == "proportional" and scaling.factor != 1.0:  # its factor is optional
            out["factor"] = scaling.factor
        if scaling.rope_type == "yarn":  # the optional keys only where they differ from their defaults
            out.update({k: getattr(scaling, k) for k in optional if getattr(scaling, k) != getattr(defaults, k)})
    return out


def rope_keys(config) -> dict:
    """megand's ``rope_theta`` and ``rope_scaling`` of a ``transformers`` config; ValueError naming what
    megand does not implement (another rope type, partial rotary)."""
    rope = dict(getattr(config, "rope_parameters", None) or {})
    kind = rope.pop("rope_type", rope.pop("type", "default"))
    theta = rope.pop("rope_theta", getattr(config, "rope_theta", 10000.0))
    partial = rope.pop("partial_rotary_factor", None) or getattr(config, "partial_rotary_factor", None) or 1.0
    if kind == "proportional":  # its turning share is part of the frequencies (the whole head is rotated)
        rope["partial_rotary_factor"], partial = partial, 1.0
    if partial != 1.0:
        raise ValueError(f"partial_rotary_factor={partial}: megand rotates the whole head (1.0)")
    if kind == "default":
        return dict(rope_theta=float(theta), rope_scaling=None)
    if kind not in ROPE_TYPES:
        raise ValueError(f"rope scaling {kind!r} is not supported (megand has {', '.join(ROPE_TYPES)})")
    known = set(RopeScaling.__dataclass_fields__)
    scaling = {k: v for k, v in rope.items() if k in known and v is not None}
    if kind == "yarn" and scaling.get("factor") is None:  # DeepSeek-style: the ratio of the two contexts
        scaling["factor"] = config.max_position_embeddings / scaling["original_max_position_embeddings"]
    RopeScaling.from_dict({"rope_type": kind, **scaling})  # refuses a missing key in one line
    return dict(rope_theta=float(theta), rope_scaling={"rope_type": kind, **scaling})


def hf_config(m: dict):
    from transformers import LlamaConfig

    h, heads, groups, hd = dims(m)
    return LlamaConfig(vocab_size=m["vocab_size"], hidden_size=h, intermediate_size=m["ffn_hidden_size"],
                       num_hidden_layers=m["num_layers"], num_attention_heads=heads, num_key_value_heads=groups,
                       head_dim=hd, hidden_act="silu", max_position_embeddings=m["seq_length"],
                       initializer_range=m.get("init_std", 0.02), rms_norm_eps=norm_eps(m),
                       rope_parameters=rope_parameters(m),
                       tie_word_embeddings=bool(m["tie_embeddings"]), attention_bias=False, mlp_bias=False,
                       attention_dropout=m.get("attention_dropout", 0.0),
                       bos_token_id=None, eos_token_id=None, pad_token_id=None)


def llama_like_config(config) -> dict:
    """The megand ``model`` keys of a LLaMA-family ``transformers`` config (attention, norms, RoPE,
    embeddings); ValueError for what megand does not implement."""
    h, heads, L = config.hidden_size, config.num_attention_heads, config.num_hidden_layers
    groups = config.num_key_value_heads or heads
    head_dim = getattr(config, "head_dim", None)
    head_dim = None if head_dim in (None, resolve_head_dim(h, heads)) else head_dim  # megand's null: derived
    if config.hidden_act != "silu":
        raise ValueError(f"hidden_act={config.hidden_act!r}: megand's SwiGLU uses silu")
    return dict(sliding_window=qwen_windows(config), **rope_keys(config), arch="llama", num_layers=L, hidden_size=h, ffn_hidden_size=config.intermediate_size,
                num_attention_heads=heads, num_query_groups=groups, head_dim=head_dim,
                seq_length=config.max_position_embeddings,
                vocab_size=config.vocab_size, norm="rmsnorm", norm_eps=float(config.rms_norm_eps), activation="swiglu",
                position_embedding="rope", tie_embeddings=bool(config.tie_word_embeddings),
                init_std=config.initializer_range, hidden_dropout=0.0, attention_dropout=0.0)


def qwen_windows(config):
    """megand's ``model.sliding_window`` of a Qwen-family config (None for the others): ``use_sliding_window``
    turns ``sliding_window`` on for the layers ``layer_types`` marks ``sliding_attention`` (transformers derives
    them from ``max_window_layers``: layer i has the window when i >= max_window_layers); a config without
    ``layer_types`` (Qwen3-MoE) has it on every layer. A window no shorter than the context is full attention."""
    window = getattr(config, "sliding_window", None) if getattr(config, "use_sliding_window", False) else None
    if not window or window >= config.max_position_embeddings:
        return None
    types = getattr(config, "layer_types", None)
    if types is None:
        return window
    unknown = sorted(set(types) - {"full_attention", "sliding_attention"})
    if unknown:
        raise ValueError(f"layer_types holds {unknown[0]!r}: megand's layers have full or sliding-window attention")
    per_layer = [window if t == "sliding_attention" else None for t in types]
    return per_layer[0] if len(set(per_layer)) == 1 else per_layer


def one_window_size(m) -> bool:
    """Whether ``model.sliding_window`` is None, an int, or a list whose windows are all one size (what a
    Qwen-family config can say: one ``sliding_window`` for the layers that have one)."""
    w = m.get("sliding_window")
    if w is None or (isinstance(w, int) and not isinstance(w, bool)):
        return True
    return isinstance(w, (list, tuple)) and len({x for x in w if x is not None}) <= 1


ONE_WINDOW_SIZE = When("one window size for the layers that have one", one_window_size)


def qwen_window_keys(m) -> dict:
    """The Qwen-family config keys of ``model.sliding_window`` (:func:`one_window_size` holds): the windowed
    layers in ``layer_types``, and ``max_window_layers`` the first of them (what transformers versions without
    ``layer_types`` read: exact when the windowed layers are the last ones)."""
    w, L = m.get("sliding_window"), m["num_layers"]
    per_layer = list(w) if isinstance(w, (list, tuple)) else [w] * L
    sizes = {x for x in per_layer if x is not None}
    if not sizes:
        return dict(use_sliding_window=False, layer_types=["full_attention"] * L)
    types = ["sliding_attention" if x is not None else "full_attention" for x in per_layer]
    return dict(use_sliding_window=True, sliding_window=sizes.pop(), max_window_layers=types.index("sliding_attention"),
                layer_types=types)


def model_config(config) -> dict:
    """The megand ``model`` config of a ``LlamaConfig``; ValueError for what megand does not implement."""
    if getattr(config, "attention_bias", False) or getattr(config, "mlp_bias", False):
        raise ValueError("attention_bias / mlp_bias are not supported for llama models")
    return llama_like_config(config)


def attention_rules(m: dict, p: str, q: str) -> list[Rule]:
    """Attention and the two norms of layer prefix ``p`` (megand) / ``q`` (HF) in a LLaMA-family model;
    with ``model.qkv_bias`` also the q/k/v biases (Qwen2), with ``model.qk_norm`` the per-head q/k norms (Qwen3)."""
    _, heads, groups, _ = dims(m)
    names = {kind: tuple(q + f"self_attn.{x}_proj.{kind}" for x in "qkv") for kind in ("weight", "bias")}
    out = [Rule(p + "attention.qkv.weight", names["weight"],
                lambda t: split_qkv(t, heads, groups), lambda wq, wk, wv: fuse_qkv(wq, wk, wv, groups))]
    if m.get("qkv_bias"):
        out.append(Rule(p + "attention.qkv.bias", names["bias"],
                        lambda t: split_qkv(t, heads, groups), lambda bq, bk, bv: fuse_qkv(bq, bk, bv, groups)))
    if m.get("qk_norm"):
        out += [Rule(p + "attention.q_norm.weight", (q + "self_attn.q_norm.weight",)),
                Rule(p + "attention.k_norm.weight", (q + "self_attn.k_norm.weight",))]
    return out + [
        Rule(p + "attention.proj.weight", (q + "self_attn.o_proj.weight",)),
        Rule(p + "input_norm.weight", (q + "input_layernorm.weight",)),
        Rule(p + "post_attention_norm.weight", (q + "post_attention_layernorm.weight",)),
    ]


def mlp_rules(p: str, q: str) -> list[Rule]:
    """A SwiGLU MLP: megand's fused fc1 and fc2 under ``p`` <-> gate/up/down projections under ``q``."""
    return [Rule(p + "fc1.weight", (q + "gate_proj.weight", q + "up_proj.weight"), split_swiglu, fuse_swiglu),
            Rule(p + "fc2.weight", (q + "down_proj.weight",))]


def embedding_rules(m: dict) -> tuple[list[Rule], list[Rule]]:
    """(first, last) rules of a LLaMA-family model: the word embedding; the final norm and output layer."""
    last = [Rule("final_norm.weight", ("model.norm.weight",))]
    if not m["tie_embeddings"]:
        last.append(Rule("output_layer.weight", ("lm_head.weight",)))
    return [Rule("embedding.word.weight", ("model.embed_tokens.weight",))], last


def rules(m: dict) -> list[Rule]:
    first, last = embedding_rules(m)
    out = first
    for i in range(m["num_layers"]):
        p, q = f"layers.{i}.", f"model.layers.{i}."
        out += attention_rules(m, p, q) + mlp_rules(p + "mlp.", q + "mlp.")
    return out + last


FAMILY = Family("llama", "LlamaForCausalLM", expresses={**LLAMA_SHAPE, **ATTENTION}, marks=LLAMA_MARKS,
                reads=LLAMA_LIKE_READS | {"attention_bias", "mlp_bias"},
                ignores=DROPOUT | {"pretraining_tp"},  # transformers' model no longer reads pretraining_tp
                hf_config=hf_config, model_config=model_config, rules=rules)
