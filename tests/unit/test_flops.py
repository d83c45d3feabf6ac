"""FLOPs and parameter counts from the shape, checked against transformers reference models."""

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from megand.models import flops

LLAMA = dict(arch="llama", num_layers=2, hidden_size=64, ffn_hidden_size=96, num_attention_heads=4,
             num_query_groups=2, seq_length=32, vocab_size=256, norm="rmsnorm", activation="swiglu",
             position_embedding="rope", rope_theta=10000.0, tie_embeddings=False, init_std=0.02,
             hidden_dropout=0.0, attention_dropout=0.0)
HEAD_DIM_APART = {**LLAMA, "head_dim": 24}  # q width 96 != hidden 64 (Qwen3/Gemma-style)
GPT = dict(arch="gpt", num_layers=2, hidden_size=64, ffn_hidden_size=256, num_attention_heads=4,
           num_query_groups=4, seq_length=32, vocab_size=256, norm="layernorm", activation="gelu",
           position_embedding="learned", tie_embeddings=True, init_std=0.02,
           hidden_dropout=0.0, attention_dropout=0.0)


def _hf_model(cfg):
    from megand.models.hf import build_hf_model
    # eager attention: its matmuls are visible to FlopCounterMode (CPU sdpa kernels are not counted)
    return build_hf_model(cfg, attn_implementation="eager")


@pytest.mark.parametrize("cfg", [LLAMA, GPT, HEAD_DIM_APART], ids=["llama", "gpt", "head_dim"])
def test_param_count_matches_transformers(cfg):
    model = _hf_model(cfg)
    assert flops.param_counts(cfg).total == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("cfg", [LLAMA, GPT, HEAD_DIM_APART], ids=["llama", "gpt", "head_dim"])
def test_model_flops_match_flop_counter(cfg):
    model = _hf_model(cfg)
    batch = 2
    ids = torch.randint(0, cfg["vocab_size"], (batch, cfg["seq_length"]))
    counter = FlopCounterMode(display=False)
    with counter:
        model(input_ids=ids, labels=ids).loss.backward()
    measured = counter.get_total_flops()
    predicted = flops.flops_per_iteration(cfg, global_batch_size=batch)["model_flops"]
    # the acceptance bound is 5%; with these conventions the count is exact for both reference models
    assert abs(predicted - measured) / measured < 0.01, (predicted, measured)
    # attention matmuls were seen: dropping the attention term from the prediction breaks the match
    q_width = cfg["num_attention_heads"] * cfg.get("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"])
    attention = 3 * batch * cfg["seq_length"] * cfg["num_layers"] * 4 * cfg["seq_length"] * q_width
    assert abs(predicted - attention - measured) / measured > 0.05


def test_hand_computed_llama_numbers():
    fwd = flops.forward_flops_per_token(LLAMA)
    h, f, s, kv = 64, 96, 32, 2 * 16
    assert fwd.layer_dense == 2 * h * (h + 2 * kv) + 2 * h * h + 6 * h * f
    assert fwd.layer_attention == 4 * s * h
    assert fwd.logits == 2 * h * 256
    assert flops.model_flops_per_token(LLAMA) == 3 * fwd.total


def test_design_note_reference_figure():
    # 6N + 12·L·h·s (+ logits 6hV) with N = non-embedding matmul weights: a bias-free, norm-free count
    p = flops.param_counts(LLAMA)
    n_matmul = p.non_embedding - LLAMA["num_layers"] * 2 * 64 - 64  # drop RMSNorm weights
    expected = 6 * n_matmul + 12 * 2 * 64 * 32 + 6 * 64 * 256
    assert flops.model_flops_per_token(LLAMA) == expected


def test_recompute_adds_hardware_flops():
    fwd = flops.forward_flops_per_token(LLAMA)
    none = flops.hardware_flops_per_token(LLAMA, "none")
    assert none == flops.model_flops_per_token(LLAMA)
    assert flops.hardware_flops_per_token(LLAMA, "selective") == none + 2 * fwd.layer_attention
    assert flops.hardware_flops_per_token(LLAMA, "full") == none + fwd.total - fwd.logits
    with pytest.raises(ValueError):
        flops.hardware_flops_per_token(LLAMA, "sometimes")


def test_logits_count_the_padded_vocabulary():
    cfg = dict(LLAMA, vocab_size=250)  # padded to a multiple of 128 x tp
    assert flops.forward_flops_per_token(cfg).logits == 2 * 64 * 250  # an unpadded model (transformers)
    assert flops.forward_flops_per_token(cfg, tp=1).logits == 2 * 64 * 256
    assert flops.forward_flops_per_token(cfg, tp=4).logits == 2 * 64 * 512
    assert flops.forward_flops_per_token(dict(cfg, make_vocab_size_divisible_by=12), tp=2).logits == 2 * 64 * 264
    assert flops.flops_per_iteration(cfg, 1, tp=4)["model_flops"] == 32 * flops.model_flops_per_token(cfg, tp=4)
    assert flops.param_counts(cfg).output_layer == 250 * 64  # parameter counts are the real ones


# --- Mixture of Experts: FLOPs and MFU follow the active parameters ------------------------------------

MIXTRAL_8X7B = dict(arch="llama", num_layers=32, hidden_size=4096, ffn_hidden_size=14336, num_attention_heads=32,
                    num_query_groups=8, seq_length=4096, vocab_size=32000, norm="rmsnorm", activation="swiglu",
                    position_embedding="rope", tie_embeddings=False, num_experts=8, moe_top_k=2)
MIXTRAL_TINY = dict(LLAMA, num_experts=4, moe_top_k=2, moe_ffn_hidden_size=48)
# Qwen2-MoE-like: gated shared experts, q/k/v biases, every other layer dense, no top-k renormalisation
QWEN_MOE_TINY = dict(LLAMA, num_layers=3, num_experts=8, moe_top_k=3, moe_ffn_hidden_size=32, moe_shared_experts=2,
                     moe_shared_expert_gate=True, moe_layer_freq=2, qkv_bias=True, moe_norm_topk_prob=False)


def test_mixtral_8x7b_total_and_active_parameters():
    h, f, kv, E, V, L = 4096, 14336, 8 * 128, 8, 32000, 32
    attention = h * (h + 2 * kv) + h * h           # 41,943,040
    expert = 3 * h * f                            # 176,160,768 (gate, up, down)
    layer_rest = attention + E * h + 2 * h        # + router + two RMSNorms
    embeddings = 2 * V * h + h                    # untied embedding and output layer, final norm
    counts = flops.param_counts(MIXTRAL_8X7B)
    assert counts.total == L * (layer_rest + E * expert) + embeddings == 46_702_792_704    # "46.7B"
    assert counts.active == L * (layer_rest + 2 * expert) + embeddings == 12_879_925_248   # "12.9B"
    assert counts.moe_layers == 32 and counts.per_moe_layer == layer_rest + E * expert
    # forward FLOPs per token: attention projections, router, two of the eight experts (dropless)
    fwd = flops.forward_flops_per_token(MIXTRAL_8X7B)
    assert fwd.layer_moe == 2 * attention + 2 * h * E + 2 * 2 * expert
    assert fwd.total == L * (fwd.layer_moe + 4 * 4096 * h) + 2 * h * V
    # 6 x active non-embedding matmul weights + attention + logits (the norms are no matmuls)
    n_active_matmul = counts.active_non_embedding - L * 2 * h - h
    assert flops.model_flops_per_token(MIXTRAL_8X7B) == 6 * n_active_matmul + 12 * L * h * 4096 + 6 * h * V


def test_small_moe_counts_by_hand():
    h, kv, fe, E, k, V = 64, 32, 32, 8, 3, 256
    attention = h * (h + 2 * kv) + (h + 2 * kv) + h * h + 2 * h   # with q/k/v biases; two norms
    dense_layer = attention + 3 * h * 96
    shared = 3 * h * 2 * fe + h                                   # the shared MLP (2 x fe wide) and its gate
    moe_layer = attention + E * h + shared + E * 3 * h * fe
    counts = flops.param_counts(QWEN_MOE_TINY)
    assert counts.moe_layers == 2                                 # layers 0 and 2 (i % 2 == 0)
    assert counts.total == 2 * moe_layer + dense_layer + h + 2 * V * h
    assert counts.active == 2 * (moe_layer - (E - k) * 3 * h * fe) + dense_layer + h + 2 * V * h
    fwd = flops.forward_flops_per_token(QWEN_MOE_TINY)
    proj = 2 * h * (h + 2 * kv) + 2 * h * h
    assert fwd.layer_moe == proj + 2 * h * E + k * 6 * h * fe + 6 * h * 2 * fe + 2 * h
    assert fwd.layers_matmul == 2 * fwd.layer_moe + fwd.layer_dense
    # full recompute re-runs every layer's matmuls once more (not the logits)
    assert (flops.hardware_flops_per_token(QWEN_MOE_TINY, "full")
            == flops.model_flops_per_token(QWEN_MOE_TINY) + fwd.total - fwd.logits)
    # a dense model's active count is its total
    assert flops.param_counts(LLAMA).active == flops.param_counts(LLAMA).total


@pytest.mark.parametrize("cfg", [MIXTRAL_TINY, QWEN_MOE_TINY], ids=["mixtral", "qwen2_moe"])
def test_moe_counts_match_transformers(cfg):
    from megand.models.hf import build_hf_model
    # eager experts: a loop of visible matmuls over the tokens routed to each expert
    model = build_hf_model(cfg, attn_implementation="eager", experts_implementation="eager")
    assert flops.param_counts(cfg).total == sum(p.numel() for p in model.parameters())
    ids = torch.randint(0, cfg["vocab_size"], (2, cfg["seq_length"]), generator=torch.Generator().manual_seed(0))
    counter = FlopCounterMode(display=False)
    with counter:
        model(input_ids=ids, labels=ids).loss.backward()
    assert flops.flops_per_iteration(cfg, global_batch_size=2)["model_flops"] == counter.get_total_flops()


def test_training_logs_tflops_of_the_active_parameters(tmp_path):
    """The trainer's TFLOP/s (and so MFU) of a MoE run: the model FLOPs of the routed top-k, not of every expert."""
    from omegaconf import OmegaConf

    from tests.harness import read_metrics, run_pretrain

    run_pretrain(tmp_path, ["+experiment=tiny_llama", "model=moe_tiny", "train.iters=1"])
    record = read_metrics(tmp_path)[0]
    model = OmegaConf.to_container(OmegaConf.load(tmp_path / "config.yaml").model, resolve=True)
    batch = OmegaConf.load(tmp_path / "config.yaml").train.global_batch_size
    logged = record["tflops_per_s"] * 1e12 * record["iter_time_ms"] / 1e3
    active = flops.flops_per_iteration(model, batch, tp=1)["model_flops"]
    every_expert = flops.flops_per_iteration(dict(model, moe_top_k=model["num_experts"]), batch, tp=1)["model_flops"]
    assert logged == pytest.approx(active, rel=1e-9) and active < every_expert


def test_sliding_windows_count_the_band_each_query_sees():
    """A layer with a window w counts 4·min(s, w)·q for its attention core (a windowed kernel skips the
    blocks outside the band); per-layer windows (null: full attention) count layer by layer."""
    s, q = LLAMA["seq_length"], LLAMA["hidden_size"]
    full = flops.forward_flops_per_token(LLAMA)
    assert full.attention == LLAMA["num_layers"] * 4 * s * q
    assert flops.forward_flops_per_token({**LLAMA, "sliding_window": 8}).attention == 2 * 4 * 8 * q
    assert flops.forward_flops_per_token({**LLAMA, "sliding_window": [8, None]}).attention == 4 * 8 * q + 4 * s * q
    assert flops.forward_flops_per_token({**LLAMA, "sliding_window": 64}).total == full.total  # no shorter than s
    windowed = {**LLAMA, "sliding_window": 8}
    assert (flops.hardware_flops_per_token(windowed, "selective") - flops.model_flops_per_token(windowed)
            == 2 * 4 * 8 * q)


# DeepSeek-V3 in small: latent attention (a query latent, value heads narrower than query/key heads), a dense
# first layer, then MoE layers (sigmoid router, grouped top-k, a shared expert); and dense without a query latent
MLA_MOE = dict(LLAMA, num_layers=3, num_query_groups=None, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=12,
               qk_rope_head_dim=8, v_head_dim=10, num_experts=8, moe_top_k=2, moe_ffn_hidden_size=32,
               moe_shared_experts=1, moe_router="sigmoid", moe_n_group=4, moe_topk_group=2,
               moe_routed_scaling_factor=2.5, moe_first_k_dense_replace=1)
MLA_DENSE = {k: v for k, v in MLA_MOE.items() if not k.startswith(("moe_", "num_experts"))} | {"q_lora_rank": None}


@pytest.mark.parametrize("cfg", [MLA_MOE, MLA_DENSE], ids=["moe", "dense_no_q_lora"])
def test_latent_attention_counts_match_transformers(cfg):
    from megand.models.hf import build_hf_model

    model = build_hf_model(cfg, attn_implementation="eager", experts_implementation="eager")
    assert flops.param_counts(cfg).total == sum(p.numel() for p in model.parameters())
    ids = torch.randint(0, cfg["vocab_size"], (2, cfg["seq_length"]), generator=torch.Generator().manual_seed(0))
    counter = FlopCounterMode(display=False)
    with counter:
        model(input_ids=ids, labels=ids).loss.backward()
    assert flops.flops_per_iteration(cfg, global_batch_size=2)["model_flops"] == counter.get_total_flops()
    # the attention core counts the value width apart: scores over d_qk = 20, context over v_head_dim = 10
    assert flops.forward_flops_per_token(cfg).layer_attention == 2 * 32 * 4 * (20 + 10)


@pytest.mark.parametrize("cfg", [LLAMA, GPT], ids=["llama", "gpt"])
def test_mtp_counts_match_the_model(cfg):
    """Multi-token prediction: the depths' parameters are those megand builds, and the model FLOPs of a
    training step with them are what FlopCounterMode measures on megand's own model (one process; the
    logits of the main model and of each depth over the padded vocabulary)."""
    import torch.distributed as dist

    from megand.core.checkpointing.offline import single_process_topology
    from megand.core.tensor_parallel.random import TensorParallelRNG
    from megand.core.transformer import TransformerConfig
    from megand.models.gpt import GPTModel

    cfg = {**cfg, "mtp_layers": 2}
    topo = single_process_topology()
    try:
        model = GPTModel(TransformerConfig.from_model(cfg), topo, TensorParallelRNG(1, 0, torch.device("cpu")))
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(0, 0.02)
        assert flops.param_counts(cfg).mtp == sum(p.numel() for n, p in model.named_parameters() if n.startswith("mtp."))
        ids = torch.randint(0, cfg["vocab_size"], (2, cfg["seq_length"] + 1), generator=torch.Generator().manual_seed(0))
        counter = FlopCounterMode(display=False)
        with counter, torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
            loss, mtp = model(ids[:, :-1], labels=ids[:, 1:])
            (loss.sum() + mtp.sum()).backward()
        predicted = flops.flops_per_iteration(cfg, global_batch_size=2, tp=1)["model_flops"]
        assert predicted == counter.get_total_flops()
        plain = flops.flops_per_iteration({**cfg, "mtp_layers": 0}, global_batch_size=2, tp=1)["model_flops"]
        assert predicted > plain
    finally:
        dist.destroy_process_group()


def test_mtp_layers_take_the_last_layers_window():
    q = LLAMA["hidden_size"]
    windowed = flops.forward_flops_per_token({**LLAMA, "sliding_window": [None, 8], "mtp_layers": 2})
    assert windowed.mtp_attention == 2 * 4 * 8 * q
    assert (flops.hardware_flops_per_token({**LLAMA, "sliding_window": [None, 8], "mtp_layers": 2}, "selective")
            - flops.model_flops_per_token({**LLAMA, "sliding_window": [None, 8], "mtp_layers": 2})
            == 4 * LLAMA["seq_length"] * q + 4 * 8 * q + 2 * 4 * 8 * q)


# today's families through their transformers classes: Qwen3 (q/k norms, a head width apart from hidden/heads),
# Qwen3-MoE (q/k norms, softmax top-k experts without shared ones) and Mistral (a sliding window)
QWEN3_TINY = dict(LLAMA, qk_norm=True, head_dim=24, norm_eps=1e-6)
QWEN3_MOE_TINY = dict(QWEN3_TINY, num_experts=4, moe_top_k=2, moe_ffn_hidden_size=48)
MISTRAL_TINY = dict(LLAMA, sliding_window=8)


@pytest.mark.parametrize("cfg, model_class", [(QWEN3_TINY, "Qwen3ForCausalLM"), (QWEN3_MOE_TINY, "Qwen3MoeForCausalLM"),
                                              (MISTRAL_TINY, "MistralForCausalLM")],
                         ids=["qwen3", "qwen3_moe", "mistral"])
def test_families_counts_match_flop_counter(cfg, model_class):
    """Parameters and model FLOPs of a training step equal transformers' own model's, counted by
    FlopCounterMode. transformers' eager attention computes the whole s x s product and masks it, where
    megand counts the band a windowed kernel computes (4·min(s, w)·q): for Mistral the measured count is the
    prediction plus the product outside the window, exactly."""
    from megand.models.hf import build_hf_model

    model = build_hf_model(cfg, attn_implementation="eager",
                           experts_implementation="eager" if cfg.get("num_experts") else None)
    assert type(model).__name__ == model_class
    assert flops.param_counts(cfg).total == sum(p.numel() for p in model.parameters())
    ids = torch.randint(0, cfg["vocab_size"], (2, cfg["seq_length"]), generator=torch.Generator().manual_seed(0))
    counter = FlopCounterMode(display=False)
    with counter:
        model(input_ids=ids, labels=ids).loss.backward()
    predicted = flops.flops_per_iteration(cfg, global_batch_size=2)["model_flops"]
    s, window = cfg["seq_length"], cfg.get("sliding_window")
    outside = 0 if window is None else 3 * 2 * s * cfg["num_layers"] * 4 * (s - window) * flops.Shape.from_config(cfg).q_dim
    assert predicted + outside == counter.get_total_flops()
