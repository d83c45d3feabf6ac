"""The real-scale presets of conf/experiment/ compose, validate for the world size they are written for,
and fit an 80 GB GPU by the memory estimator."""

import pytest
from omegaconf import OmegaConf

from megand.training.config import compose, validate
from megand.tools.estimate_memory import Layout, estimate_memory

PRESETS = {"gpt2_125m_1gpu": 1, "llama8b_8gpu": 8, "llama70b_64gpu": 64, "mixtral_8x7b_64gpu": 64,
           "llama3_1_8b_8gpu": 8, "llama3_1_70b_64gpu": 64, "qwen3_8b_8gpu": 8,
           "deepseek_v3_small_16gpu": 16, "deepseek_v3_671b_1024gpu": 1024, "qwen3_30b_a3b_16gpu": 16}


@pytest.mark.parametrize("name,world_size", PRESETS.items())
def test_preset_is_valid_for_its_world_size(name, world_size):
    cfg = compose([f"+experiment={name}"])
    validate(cfg, world_size)
    assert cfg.name == name and cfg.train.precision == "bf16"
    layout = Layout.from_config(cfg.parallel, cfg.train, cfg.optim, world_size=world_size)
    assert layout.tp * layout.pp * layout.cp * layout.dp == world_size
    assert layout.tp <= 8  # tensor parallelism stays inside one 8-GPU node
    if layout.dp > 1:
        assert layout.level != "none"  # at least the distributed optimizer
    if cfg.model.num_experts:
        assert layout.ep * layout.tp <= 8  # the token all-to-alls stay inside one 8-GPU node
    peak = estimate_memory(OmegaConf.to_container(cfg.model, resolve=True), layout).peak.total_bytes
    assert peak < 72 * 2**30, f"{name}: estimated {peak / 2**30:.1f} GiB per GPU"
