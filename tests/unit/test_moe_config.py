"""The MoE keys: invalid values fail in validate() with a message naming them; valid ones reach core."""

import pytest

from megand.training.config import ConfigError, compose, transformer_config, validate

MOE = ["+experiment=tiny_llama", "model=moe_tiny"]


@pytest.mark.parametrize("overrides, world_size, message", [
    (["model.num_experts=0"], 1, r"model.num_experts=0 must be >= 1"),
    (["model.moe_top_k=5"], 1, r"model.moe_top_k=5 must be between 1 and model.num_experts=4"),
    (["model.moe_top_k=0"], 1, r"model.moe_top_k=0 must be between 1"),
    (["model.moe_router=hash"], 1, r"model.moe_router='hash': expected one of softmax, sigmoid"),
    (["model.moe_shared_experts=-1"], 1, r"model.moe_shared_experts=-1 must be >= 0"),
    (["model.moe_shared_expert_gate=true"], 1, r"moe_shared_expert_gate=true needs shared experts"),
    (["model.moe_layer_freq=0"], 1, r"model.moe_layer_freq=0 must be >= 1"),
    (["model.moe_capacity_factor=0"], 1, r"model.moe_capacity_factor=0.0 must be > 0"),
    (["model.moe_ffn_hidden_size=0"], 1, r"model.moe_ffn_hidden_size=0 must be >= 1"),
    (["model.moe_aux_loss_coeff=-0.1"], 1, r"model.moe_aux_loss_coeff=-0.1 must be >= 0"),
    (["model.moe_z_loss_coeff=-1"], 1, r"model.moe_z_loss_coeff=-1.0 must be >= 0"),
    (["model.moe_bias_update_rate=-1"], 1, r"model.moe_bias_update_rate=-1.0 must be >= 0"),
    (["model.moe_ffn_hidden_size=63", "parallel.tp=2"], 2,
     r"experts' width 63 .* not divisible by the expert tensor-parallel size parallel.etp=2"),
    (["model.moe_shared_experts=1", "model.moe_ffn_hidden_size=6", "parallel.tp=4", "parallel.etp=1",
      "model.num_query_groups=4"], 4,
     r"shared experts' width 6 .* not divisible by parallel.tp=4"),
    (["parallel.tp=2", "parallel.etp=4"], 2, r"parallel.etp=4 must be 1 or parallel.tp=2"),
    (["model.seq_length=36", "parallel.tp=4", "parallel.cp=2", "parallel.etp=1", "model.num_query_groups=4"], 8,
     r"parallel.etp=1 splits each rank's 18 tokens .* over parallel.tp=4"),
    (["parallel.ep=2"], 2, r"parallel.ep=2: expert parallelism is not available"),
    (["model.num_experts=null", "parallel.ep=2"], 2, r"parallel.ep=2 needs a Mixture-of-Experts model"),
])
def test_invalid_moe_values_are_named(overrides, world_size, message):
    with pytest.raises(ConfigError, match=message):
        validate(compose([*MOE, *overrides]), world_size)


def test_keys_reach_the_transformer_config():
    cfg = compose([*MOE, "model.moe_router=sigmoid", "model.moe_layer_freq=2", "parallel.tp=2", "parallel.etp=1"])
    validate(cfg, 2)
    core = transformer_config(cfg)
    assert (core.num_experts, core.moe_top_k, core.moe_router, core.expert_tensor_parallel) == (4, 2, "sigmoid", False)
    assert [core.is_moe_layer(i) for i in range(4)] == [True, False, True, False]
    assert transformer_config(compose([*MOE, "parallel.tp=2"])).expert_tensor_parallel
    assert not transformer_config(compose(["+experiment=tiny_llama"])).is_moe_layer(0)
