"""The analytic models of a hybrid Gated DeltaNet / attention model (Qwen3-Next's pattern): parameter counts,
FLOPs (``FlopCounterMode`` on the transformers model, dense and MoE) and the estimator's terms (parameter and
optimizer bytes on that model; the activations a linear attention layer saves for backward, the recurrent state
at each chunk boundary included)."""

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode, conv_flop_count

from megand.models import flops
from megand.models.hf import build_hf_model
from megand.tools.estimate_memory import Layout, estimate_memory, linear_attention_bytes

HYBRID = dict(arch="llama", num_layers=4, hidden_size=64, ffn_hidden_size=96, num_attention_heads=4, num_query_groups=2,
              seq_length=64, vocab_size=256, norm="rmsnorm", activation="swiglu", position_embedding="rope",
              tie_embeddings=False, layer_types=["linear_attention"] * 3 + ["attention"], linear_num_key_heads=2,
              linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=8, linear_conv_kernel=4,
              attention_output_gate=True, partial_rotary_factor=0.25, norm_unit_offset=True, qk_norm=True, head_dim=32)
MOE = dict(HYBRID, num_experts=4, moe_top_k=2, moe_ffn_hidden_size=32, moe_shared_experts=2,
           moe_shared_expert_gate=True, moe_norm_topk_prob=True)


def depthwise_conv_backward(grad_out_shape, x_shape, w_shape, _bias, _stride, _padding, _dilation, transposed,
                            _output_padding, _groups, output_mask, out_shape=None):
    """The backward of a convolution: the forward's products once per gradient it forms. (torch's own formula
    ignores ``groups``: it counts a depthwise convolution's backward as a dense one's, C times too much.)"""
    return conv_flop_count(x_shape, w_shape, grad_out_shape, transposed) * sum(bool(m) for m in output_mask[:2])


@pytest.fixture(scope="module", autouse=True)
def no_process_group_left():
    yield
    import torch.distributed as dist

    if dist.is_initialized():  # the layer test's one-process topology: leave none to the next module
        dist.destroy_process_group()


@pytest.mark.parametrize("cfg", [HYBRID, MOE], ids=["dense", "moe"])
def test_param_counts_and_state_bytes_match_transformers(cfg):
    model = build_hf_model(cfg, attn_implementation="eager", experts_implementation="eager")
    assert flops.param_counts(cfg).total == sum(p.numel() for p in model.parameters())
    st = estimate_memory(cfg, Layout(precision="fp32")).stages[0]
    assert st.param_bytes == 4 * sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("cfg, seq", [(HYBRID, 64), (HYBRID, 100), (MOE, 64)], ids=["dense", "dense_padded", "moe"])
def test_flops_match_flop_counter(cfg, seq):
    cfg = dict(cfg, seq_length=seq)
    model = build_hf_model(cfg, attn_implementation="eager", experts_implementation="eager")
    ids = torch.randint(0, cfg["vocab_size"], (2, seq), generator=torch.Generator().manual_seed(0))
    counter = FlopCounterMode(display=False, custom_mapping={torch.ops.aten.convolution_backward: depthwise_conv_backward})
    with counter:
        model(input_ids=ids, labels=ids).loss.backward()
    measured = counter.get_total_flops()
    predicted = flops.flops_per_iteration(cfg, global_batch_size=2)["model_flops"]
    # what remains (2e-4 to 3e-4 here): transformers' convolution also computes K-1 padding positions per sequence
    assert abs(predicted - measured) / measured < 1e-3, (predicted, measured)
    # the linear layers' core was seen: dropping it breaks the match
    s = flops.Shape.from_config(cfg)
    core = 3 * 2 * seq * sum(s.core_flops(i) for i in s.linear)
    assert abs(predicted - core - measured) / measured > 0.05


@pytest.mark.parametrize("recompute", ["none", "selective"])
def test_linear_attention_activations_match_saved_tensors(recompute):
    """The bytes one Gated DeltaNet token mixer saves for backward (fp32, one rank), within 10%."""
    from megand.core.checkpointing import offline
    from megand.core.transformer import TransformerConfig
    from megand.core.transformer.gated_deltanet import GatedDeltaNet

    cfg = dict(HYBRID, hidden_size=128, seq_length=128, linear_num_key_heads=4, linear_num_value_heads=8,
               linear_key_head_dim=32, linear_value_head_dim=32)
    layer = GatedDeltaNet(TransformerConfig.from_model(cfg, recompute=recompute), offline.single_process_topology(), None)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.02)
    x = torch.randn(cfg["seq_length"], 2, cfg["hidden_size"], requires_grad=True)
    saved = {}

    def pack(t):
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer(x)
    measured = sum(saved.values()) - x.nbytes  # its input is the norm's output, counted with the layer
    predicted = linear_attention_bytes(flops.Shape.from_config(cfg), 4, recompute) * 2 * cfg["seq_length"]
    assert abs(predicted - measured) / measured < 0.1, (predicted, measured)
