"""Hugging Face ``transformers`` interoperability: megand full tensors <-> LlamaForCausalLM / GPT2LMHeadModel.

megand layouts that differ from Hugging Face's:
- fused QKV ``[groups, q_per_group + 2, head_dim, hidden]`` (each query group's query heads, then its
  key head, then its value head) <-> separate ``q_proj``/``k_proj``/``v_proj`` (Llama) or GPT-2's
  ``c_attn`` = ``[Q | K | V]`` (multi-head: one group per head);
- SwiGLU fc1 ``[ffn, 2, hidden]`` (gate row 0, up row 1) <-> ``gate_proj`` and ``up_proj``;
- GPT-2's Conv1D stores ``[in, out]``: every GPT-2 linear weight is transposed.
Both use the rotate-half RoPE, tanh-GELU (``gelu_new``) and norm epsilon 1e-5.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch
from tqdm import tqdm

NORM_EPS = 1e-5


def _dims(m: dict):
    h, heads = m["hidden_size"], m["num_attention_heads"]
    groups = m.get("num_query_groups") or heads
    return h, heads, groups, heads // groups, h // heads


def hf_kind(m: dict) -> str:
    if m["arch"] == "llama" and m["norm"] == "rmsnorm" and m["activation"] == "swiglu" and m["position_embedding"] == "rope":
        return "llama"
    if (m["arch"] == "gpt" and m["norm"] == "layernorm" and m["activation"] == "gelu" and m["position_embedding"] == "learned"
            and (m.get("num_query_groups") or m["num_attention_heads"]) == m["num_attention_heads"]):
        return "gpt2"
    raise ValueError(f"no Hugging Face architecture for this model: arch={m['arch']} norm={m['norm']} "
                     f"activation={m['activation']} position_embedding={m['position_embedding']} "
                     f"(llama: rmsnorm+swiglu+rope; gpt: layernorm+gelu+learned, multi-head)")


def hf_model_config(m: dict):
    """The transformers config of the same architecture and shape: the one mapping of megand's model keys,
    used by export and by the benchmark baseline."""
    kind = hf_kind(m)
    h, heads, groups, _, hd = _dims(m)
    tie = bool(m["tie_embeddings"])
    if kind == "llama":
        from transformers import LlamaConfig

        return LlamaConfig(vocab_size=m["vocab_size"], hidden_size=h, intermediate_size=m["ffn_hidden_size"],
                           num_hidden_layers=m["num_layers"], num_attention_heads=heads, num_key_value_heads=groups,
                           head_dim=hd, hidden_act="silu", max_position_embeddings=m["seq_length"],
                           initializer_range=m.get("init_std", 0.02), rms_norm_eps=NORM_EPS,
                           rope_parameters={"rope_type": "default", "rope_theta": float(m.get("rope_theta", 10000.0))},
                           tie_word_embeddings=tie, attention_bias=False, mlp_bias=False,
                           attention_dropout=m.get("attention_dropout", 0.0),
                           bos_token_id=None, eos_token_id=None, pad_token_id=None)
    from transformers import GPT2Config

    return GPT2Config(vocab_size=m["vocab_size"], n_positions=m["seq_length"], n_embd=h, n_layer=m["num_layers"],
                      n_head=heads, n_inner=m["ffn_hidden_size"], activation_function="gelu_new",
                      resid_pdrop=m.get("hidden_dropout", 0.0), embd_pdrop=m.get("hidden_dropout", 0.0),
                      attn_pdrop=m.get("attention_dropout", 0.0), layer_norm_epsilon=NORM_EPS,
                      initializer_range=m.get("init_std", 0.02), tie_word_embeddings=tie,
                      bos_token_id=None, eos_token_id=None)


# ------------------------------------------------------------------------------------------- export
def to_hf(tensors: dict[str, torch.Tensor], m: dict):
    """(transformers config, HF state dict) for megand full tensors ``tensors`` of model config ``m``."""
    kind = hf_kind(m)
    h, heads, groups, qpg, hd = _dims(m)
    tie = bool(m["tie_embeddings"])
    config = hf_model_config(m)
    W = tensors
    sd = {}
    if kind == "llama":
        sd["model.embed_tokens.weight"] = W["embedding.word.weight"]
        for i in tqdm(range(m["num_layers"]), desc="layers", unit="layer", disable=None):
            p, q = f"layers.{i}.", f"model.layers.{i}."
            qkv = W[p + "attention.qkv.weight"].view(groups, qpg + 2, hd, h)
            sd[q + "self_attn.q_proj.weight"] = qkv[:, :qpg].reshape(groups * qpg * hd, h)
            sd[q + "self_attn.k_proj.weight"] = qkv[:, qpg].reshape(groups * hd, h)
            sd[q + "self_attn.v_proj.weight"] = qkv[:, qpg + 1].reshape(groups * hd, h)
            sd[q + "self_attn.o_proj.weight"] = W[p + "attention.proj.weight"]
            fc1 = W[p + "mlp.fc1.weight"].view(m["ffn_hidden_size"], 2, h)
            sd[q + "mlp.gate_proj.weight"] = fc1[:, 0]
            sd[q + "mlp.up_proj.weight"] = fc1[:, 1]
            sd[q + "mlp.down_proj.weight"] = W[p + "mlp.fc2.weight"]
            sd[q + "input_layernorm.weight"] = W[p + "input_norm.weight"]
            sd[q + "post_attention_layernorm.weight"] = W[p + "post_attention_norm.weight"]
        sd["model.norm.weight"] = W["final_norm.weight"]
    else:
        sd["transformer.wte.weight"] = W["embedding.word.weight"]
        sd["transformer.wpe.weight"] = W["embedding.position"]
        for i in tqdm(range(m["num_layers"]), desc="layers", unit="layer", disable=None):
            p, q = f"layers.{i}.", f"transformer.h.{i}."
            qkv_w = W[p + "attention.qkv.weight"].view(heads, 3, hd, h)
            qkv_b = W[p + "attention.qkv.bias"].view(heads, 3, hd)
            sd[q + "attn.c_attn.weight"] = torch.cat([qkv_w[:, j].reshape(h, h) for j in range(3)]).t()
            sd[q + "attn.c_attn.bias"] = torch.cat([qkv_b[:, j].reshape(h) for j in range(3)])
            sd[q + "attn.c_proj.weight"] = W[p + "attention.proj.weight"].t()
            sd[q + "attn.c_proj.bias"] = W[p + "attention.proj.bias"]
            sd[q + "mlp.c_fc.weight"] = W[p + "mlp.fc1.weight"].t()
            sd[q + "mlp.c_fc.bias"] = W[p + "mlp.fc1.bias"]
            sd[q + "mlp.c_proj.weight"] = W[p + "mlp.fc2.weight"].t()
            sd[q + "mlp.c_proj.bias"] = W[p + "mlp.fc2.bias"]
            for ours, theirs in (("input_norm", "ln_1"), ("post_attention_norm", "ln_2")):
                sd[q + theirs + ".weight"] = W[p + ours + ".weight"]
                sd[q + theirs + ".bias"] = W[p + ours + ".bias"]
        sd["transformer.ln_f.weight"] = W["final_norm.weight"]
        sd["transformer.ln_f.bias"] = W["final_norm.bias"]
    sd["lm_head.weight"] = W["embedding.word.weight"] if tie else W["output_layer.weight"]
    return config, {k: v.contiguous().clone() for k, v in sd.items()}


def export(tensors: dict[str, torch.Tensor], m: dict, out_dir: str) -> None:
    """Write a ``transformers`` directory (safetensors + config.json)."""
    from transformers import AutoModelForCausalLM

    config, sd = to_hf(tensors, m)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(sd, strict=False)
    missing = [k for k in missing if not (config.tie_word_embeddings and k == "lm_head.weight")]
    if missing or unexpected:
        raise RuntimeError(f"Hugging Face state dict mismatch: missing {missing}, unexpected {unexpected}")
    model.save_pretrained(out_dir, safe_serialization=True)


# ------------------------------------------------------------------------------------------- import
def from_hf(config, sd: dict[str, torch.Tensor]) -> tuple[dict, dict[str, torch.Tensor]]:
    """(megand model config, megand full tensors) from a transformers config and state dict."""
    kind = config.model_type
    W = {}
    if kind == "llama":
        h, heads, L = config.hidden_size, config.num_attention_heads, config.num_hidden_layers
        groups = config.num_key_value_heads or heads
        hd, qpg = h // heads, heads // groups
        if getattr(config, "head_dim", hd) != hd:
            raise ValueError(f"head_dim={config.head_dim} != hidden_size/num_attention_heads={hd}: not supported")
        if abs(config.rms_norm_eps - NORM_EPS) > 1e-12:
            raise ValueError(f"rms_norm_eps={config.rms_norm_eps}: megand uses {NORM_EPS}")
        if getattr(config, "attention_bias", False) or getattr(config, "mlp_bias", False):
            raise ValueError("attention_bias / mlp_bias are not supported for llama models")
        rope = getattr(config, "rope_parameters", None) or {}
        if rope.get("rope_type", "default") != "default":
            raise ValueError(f"rope scaling {rope.get('rope_type')!r} is not supported")
        theta = rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        m = dict(arch="llama", num_layers=L, hidden_size=h, ffn_hidden_size=config.intermediate_size,
                 num_attention_heads=heads, num_query_groups=groups, seq_length=config.max_position_embeddings,
                 vocab_size=config.vocab_size, norm="rmsnorm", activation="swiglu", position_embedding="rope",
                 rope_theta=float(theta), tie_embeddings=bool(config.tie_word_embeddings),
                 init_std=config.initializer_range, hidden_dropout=0.0, attention_dropout=0.0)
        W["embedding.word.weight"] = sd["model.embed_tokens.weight"]
        for i in tqdm(range(L), desc="layers", unit="layer", disable=None):
            p, q = f"layers.{i}.", f"model.layers.{i}."
            wq = sd[q + "self_attn.q_proj.weight"].view(groups, qpg, hd, h)
            wk = sd[q + "self_attn.k_proj.weight"].view(groups, 1, hd, h)
            wv = sd[q + "self_attn.v_proj.weight"].view(groups, 1, hd, h)
            W[p + "attention.qkv.weight"] = torch.cat([wq, wk, wv], dim=1).reshape(-1, h)
            W[p + "attention.proj.weight"] = sd[q + "self_attn.o_proj.weight"]
            W[p + "mlp.fc1.weight"] = torch.stack([sd[q + "mlp.gate_proj.weight"], sd[q + "mlp.up_proj.weight"]],
                                                  dim=1).reshape(-1, h)
            W[p + "mlp.fc2.weight"] = sd[q + "mlp.down_proj.weight"]
            W[p + "input_norm.weight"] = sd[q + "input_layernorm.weight"]
            W[p + "post_attention_norm.weight"] = sd[q + "post_attention_layernorm.weight"]
        W["final_norm.weight"] = sd["model.norm.weight"]
    elif kind == "gpt2":
        h, heads, L = config.n_embd, config.n_head, config.n_layer
        hd = h // heads
        if config.activation_function not in ("gelu_new", "gelu_pytorch_tanh"):
            raise ValueError(f"activation_function={config.activation_function!r}: megand's GPT uses tanh-GELU")
        if abs(config.layer_norm_epsilon - NORM_EPS) > 1e-12:
            raise ValueError(f"layer_norm_epsilon={config.layer_norm_epsilon}: megand uses {NORM_EPS}")
        if config.scale_attn_by_inverse_layer_idx or config.reorder_and_upcast_attn:
            raise ValueError("scale_attn_by_inverse_layer_idx / reorder_and_upcast_attn are not supported")
        m = dict(arch="gpt", num_layers=L, hidden_size=h, ffn_hidden_size=config.n_inner or 4 * h,
                 num_attention_heads=heads, num_query_groups=None, seq_length=config.n_positions,
                 vocab_size=config.vocab_size, norm="layernorm", activation="gelu", position_embedding="learned",
                 rope_theta=10000.0, tie_embeddings=bool(config.tie_word_embeddings),
                 init_std=config.initializer_range, hidden_dropout=0.0, attention_dropout=0.0)
        W["embedding.word.weight"] = sd["transformer.wte.weight"]
        W["embedding.position"] = sd["transformer.wpe.weight"]
        for i in tqdm(range(L), desc="layers", unit="layer", disable=None):
            p, q = f"layers.{i}.", f"transformer.h.{i}."
            w = sd[q + "attn.c_attn.weight"].t().reshape(3, heads, hd, h)  # [Q|K|V] rows, per head
            b = sd[q + "attn.c_attn.bias"].reshape(3, heads, hd)
            W[p + "attention.qkv.weight"] = w.transpose(0, 1).reshape(-1, h)
            W[p + "attention.qkv.bias"] = b.transpose(0, 1).reshape(-1)
            W[p + "attention.proj.weight"] = sd[q + "attn.c_proj.weight"].t()
            W[p + "attention.proj.bias"] = sd[q + "attn.c_proj.bias"]
            W[p + "mlp.fc1.weight"] = sd[q + "mlp.c_fc.weight"].t()
            W[p + "mlp.fc1.bias"] = sd[q + "mlp.c_fc.bias"]
            W[p + "mlp.fc2.weight"] = sd[q + "mlp.c_proj.weight"].t()
            W[p + "mlp.fc2.bias"] = sd[q + "mlp.c_proj.bias"]
            for ours, theirs in (("input_norm", "ln_1"), ("post_attention_norm", "ln_2")):
                W[p + ours + ".weight"] = sd[q + theirs + ".weight"]
                W[p + ours + ".bias"] = sd[q + theirs + ".bias"]
        W["final_norm.weight"] = sd["transformer.ln_f.weight"]
        W["final_norm.bias"] = sd["transformer.ln_f.bias"]
    else:
        raise ValueError(f"model_type={kind!r}: only llama and gpt2 can be imported")
    if not m["tie_embeddings"]:
        W["output_layer.weight"] = sd["lm_head.weight"]
    return m, {k: v.detach().float().contiguous().clone() for k, v in W.items()}


def load_hf(hf_dir: str):
    """(config, state dict) of a transformers directory, fp32."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(hf_dir)
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    return config, model.state_dict()


# ------------------------------------------------------------------------------- benchmark baseline
def _require_transformers():
    try:
        import transformers
    except ImportError as e:  # optional dependency (pip install megand[dev])
        raise RuntimeError("this needs the optional package `transformers` "
                           "(pip install transformers)") from e
    return transformers


def hf_config(model: Mapping[str, Any], attn_implementation: str = "sdpa"):
    """A ``LlamaConfig`` (arch=llama) or ``GPT2Config`` (arch=gpt) of the same shape (the mapping that
    checkpoint export uses too)."""
    _require_transformers()
    cfg = hf_model_config({k: v for k, v in dict(model).items()})
    cfg._attn_implementation = attn_implementation
    return cfg


def build_hf_model(model: Mapping[str, Any], attn_implementation: str = "sdpa"):
    """A freshly initialised ``LlamaForCausalLM`` or ``GPT2LMHeadModel`` on the CPU."""
    tf = _require_transformers()
    cfg = hf_config(model, attn_implementation)
    cls = tf.LlamaForCausalLM if hf_kind(dict(model)) == "llama" else tf.GPT2LMHeadModel
    return cls(cfg)
