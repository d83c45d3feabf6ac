"""``train.recompute_layers``: per (virtual) pipeline stage, how many of its first layers apply
``train.recompute``. Refused in one line when it cannot apply; the layers built, the activations they
store, the estimator and the FLOPs follow it."""

import pytest
import torch
from omegaconf import OmegaConf

from megand.models.flops import hardware_flops_per_token
from megand.tools.estimate_memory import Layout, estimate_memory
from megand.training.config import ConfigError, compose, validate
from megand.training.core_configs import pipeline_plan

TINY = ["+experiment=tiny_llama"]  # 4 layers


@pytest.mark.parametrize("overrides, world, message", [
    (["train.recompute=full", "train.recompute_layers=[2,1]"], 1,
     r"train.recompute_layers=\[2, 1\] must have one entry per \(virtual\) pipeline stage \(1\), each between 0 and "
     r"that stage's layers \[4\]"),
    (["train.recompute=full", "train.recompute_layers=[5]"], 1, r"each between 0 and that stage's layers \[4\]"),
    (["train.recompute=full", "train.recompute_layers=[-1]"], 1, r"recompute_layers=\[-1\]"),
    (["parallel.pp=2", "parallel.pipeline_layout=[3,1]", "train.recompute=full", "train.recompute_layers=[1,2]"], 2,
     r"recompute_layers=\[1, 2\] .* layers \[3, 1\]"),
    (["parallel.pp=2", "parallel.vpp=2", "train.recompute=full", "train.recompute_layers=[1,1]"], 2,
     r"one entry per \(virtual\) pipeline stage \(4\)"),
    (["train.recompute_layers=[2]"], 1, r"train.recompute_layers=\[2\] .* train.recompute, which is none"),
])
def test_bad_recompute_layers_are_refused_in_one_line(overrides, world, message):
    with pytest.raises(ConfigError, match=message) as e:
        validate(compose(TINY + overrides), world)
    assert "\n" not in str(e.value)


def test_the_first_layers_of_each_virtual_stage_recompute():
    cfg = compose(TINY + ["parallel.pp=2", "parallel.vpp=2", "train.recompute=full", "train.recompute_layers=[1,0,1,0]"])
    validate(cfg, 2)
    assert pipeline_plan(cfg).recompute_ids == {0, 2}
    cfg = compose(TINY + ["parallel.pp=2", "parallel.pipeline_layout=[3,1]", "train.recompute=full",
                          "train.recompute_layers=[2,1]"])
    assert pipeline_plan(cfg).recompute_ids == {0, 1, 3}
    assert pipeline_plan(compose(TINY + ["train.recompute=full"])).recompute_ids is None  # null: every layer


def _saved_bytes(recompute_layers):
    """Bytes autograd saves in one forward of the one-process model (storages counted once)."""
    from megand.core.checkpointing.offline import single_process_topology
    from megand.training.core_configs import core_configs
    from megand.training.pretrain import build_model

    cfg = compose(TINY + ["train.recompute=full", f"train.recompute_layers={recompute_layers}"])
    validate(cfg, 1)
    topo = single_process_topology()
    (model,) = build_model(core_configs(cfg, topo.device, topo.world_size), topo)
    modes = [model.layers[str(i)].cfg.recompute for i in range(4)]
    storages = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    tokens = torch.randint(0, cfg.model.vocab_size, (2, cfg.model.seq_length))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(tokens, labels=tokens).sum()
    return modes, sum(storages.values())


def test_layers_recompute_as_asked_and_store_less():
    saved = {}
    for n in (0, 1, 2, 4):
        modes, saved[n] = _saved_bytes(f"[{n}]")
        assert modes == ["full"] * n + ["none"] * (4 - n)
    # each recomputed layer stores the same smaller amount instead of its activations
    per_layer = saved[0] - saved[1]
    assert per_layer > 0
    assert saved[0] - saved[2] == 2 * per_layer
    # (all four: the last layer's output, which the final norm saves anyway, is a few KiB apart)
    assert abs((saved[0] - saved[4]) - 4 * per_layer) < 0.01 * per_layer


def test_estimator_counts_each_layer_with_its_own_recompute():
    model = OmegaConf.to_container(compose(TINY).model, resolve=True)
    base = dict(pp=2, pipeline_layout=(3, 1), recompute="full", precision="fp32", micro_batch_size=2, num_microbatches=4)

    def stages(recompute_layers, **kw):
        est = estimate_memory(model, Layout.of(**{**base, **kw}, recompute_layers=recompute_layers), stages=(0, 1))
        return est.stages

    everything, none_first, nothing = stages(None), stages((0, 1)), stages((0, 0))
    stored = stages(None, recompute="none")
    # [0, 1]: the first stage stores what it would without recompute, the last recomputes its one layer
    assert none_first[0].layer_activation_bytes == stored[0].layer_activation_bytes
    assert none_first[0].recompute_working_bytes == 0
    assert none_first[1].layer_activation_bytes == everything[1].layer_activation_bytes
    assert none_first[1].recompute_working_bytes == everything[1].recompute_working_bytes > 0
    assert [s.total_bytes for s in nothing] == [s.total_bytes for s in stored]
    # in between: linear in the recomputed layers
    one = stages((1, 0))[0].layer_activation_bytes
    two = stages((2, 0))[0].layer_activation_bytes
    assert stored[0].layer_activation_bytes - one == one - two > 0


def test_hardware_flops_count_the_recomputing_layers_only():
    model = OmegaConf.to_container(compose(TINY).model, resolve=True)
    none = hardware_flops_per_token(model, "none")
    for mode in ("selective", "full"):
        every = hardware_flops_per_token(model, mode)
        assert hardware_flops_per_token(model, mode, recomputed_layers=range(4)) == every
        assert hardware_flops_per_token(model, mode, recomputed_layers=()) == none
        half = hardware_flops_per_token(model, mode, recomputed_layers=(0, 3))
        assert half - none == (every - none) // 2
    # MoE every other layer: a recomputed MoE layer re-runs its routed experts, a dense one its MLP
    moe = {**model, "num_experts": 4, "moe_top_k": 2, "moe_layer_freq": 2, "moe_ffn_hidden_size": 32}
    full = hardware_flops_per_token(moe, "full") - hardware_flops_per_token(moe, "none")
    parts = [hardware_flops_per_token(moe, "full", recomputed_layers=(i,)) - hardware_flops_per_token(moe, "none")
             for i in range(4)]
    assert sum(parts) == full and parts[0] != parts[1]
