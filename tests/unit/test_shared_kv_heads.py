"""The sharding metadata of key/value heads replicated over runs of tp ranks (fewer key/value heads than tp
ranks), without processes: every rank's query rows and the first replica's key/value rows tile the one-process
fused QKV weight exactly once, each initialised as its slice of it, counted once in the norm and named as it
in checkpoints; and the pure run groups the replicas sum over."""

from types import SimpleNamespace

import pytest
import torch

from megand.core.checkpointing.sharded import saved_name, written
from megand.core.parallel_state import tp_run_groups
from megand.core.sharding import full_init, init_parameters
from megand.core.transformer import TransformerConfig
from megand.core.transformer.attention import SharedKVProjection
from megand.training.config import compose, validate


def _cfg(groups, bias=False):
    return TransformerConfig.from_model(dict(arch="llama", num_layers=1, hidden_size=64, ffn_hidden_size=128,
                                             num_attention_heads=8, num_query_groups=groups, seq_length=16,
                                             vocab_size=64, norm="rmsnorm", activation="swiglu",
                                             position_embedding="rope", qkv_bias=bias))


def _projection(cfg, tp, rank):
    topo = SimpleNamespace(tp_size=tp, tp_rank=rank, tp_group=None)
    holder = torch.nn.Module()
    holder.qkv = SharedKVProjection(cfg, topo, cfg.num_attention_heads // cfg.query_groups, bias=cfg.qkv_bias,
                                    dtype=torch.float32, device="cpu")
    init_parameters(holder, seed=7)
    return holder


@pytest.mark.parametrize("groups, tp", [(1, 2), (1, 4), (2, 4), (1, 8), (2, 8)])
def test_parts_tile_the_fused_weight_once_with_its_values(groups, tp):
    cfg = _cfg(groups, bias=True)
    full = {"qkv.weight": full_init(_projection(cfg, tp, 0).qkv.q_weight.meta, 7, "qkv.weight")}
    covered = {"qkv.weight": torch.zeros(full["qkv.weight"].shape[0]), "qkv.bias": torch.zeros(full["qkv.weight"].shape[0])}
    counted = torch.zeros_like(covered["qkv.weight"])
    for rank in range(tp):
        for name, p in _projection(cfg, tp, rank).named_parameters():
            meta, key = p.meta, saved_name(name, p.meta)
            rows = meta.local_slice()[0]
            if key == "qkv.weight":  # each part is its slice of the one-process fused weight
                torch.testing.assert_close(p.detach(), full[key][rows], rtol=0, atol=0)
            replicas = tp // groups if name.startswith("qkv.kv_") else 1
            assert meta.tp_replicas == replicas and meta.counted_in_norm == written(meta) == (rank % replicas == 0)
            if written(meta):
                covered[key][rows] += 1
            if meta.counted_in_norm and key == "qkv.weight":
                counted[rows] += 1
    for key, times in covered.items():
        assert torch.equal(times, torch.ones_like(times)), key
    assert torch.equal(counted, torch.ones_like(counted))


def test_tp_runs_are_consecutive_tp_ranks():
    assert tp_run_groups([[0, 1, 2, 3], [4, 5, 6, 7]]) == {"tp_run2": [[0, 1], [2, 3], [4, 5], [6, 7]]}
    assert tp_run_groups([[0, 2, 4, 6, 8, 10, 12, 14]]) == {"tp_run2": [[0, 2], [4, 6], [8, 10], [12, 14]],
                                                            "tp_run4": [[0, 2, 4, 6], [8, 10, 12, 14]]}
    assert tp_run_groups([[0, 1]]) == {}


@pytest.mark.parametrize("groups, tp", [(1, 2), (1, 4), (2, 4)])
def test_fewer_key_value_heads_than_tp_ranks_is_a_valid_layout(groups, tp):
    """Refused before ("model.num_query_groups=1 is not divisible by parallel.tp=2")."""
    validate(compose(["model=llama_tiny", f"model.num_query_groups={groups}", f"parallel.tp={tp}",
                      "parallel.sequence_parallel=true"]), tp)


@pytest.mark.parametrize("groups, tp", [(1, 2), (1, 4), (2, 4), (2, 2)])
def test_estimated_projection_per_rank_is_what_a_rank_holds(groups, tp):
    """The estimator's per-rank QKV: query rows split over tp, each key/value head over at most its groups."""
    from megand.models.flops import LayerParams, Shape, layer_params

    model = dict(arch="llama", num_layers=1, hidden_size=64, ffn_hidden_size=128, num_attention_heads=8,
                 num_query_groups=groups, seq_length=16, vocab_size=64, qkv_bias=True)
    lp = layer_params(Shape.from_config(model))
    qkv_only = LayerParams(qkv_weight=lp.qkv_weight, qkv_bias=lp.qkv_bias, proj_weight=0, proj_bias=0, mlp_in_weight=0,
                           mlp_in_bias=0, mlp_out_weight=0, mlp_out_bias=0, norms=0, kv_part=lp.kv_part,
                           kv_heads=lp.kv_heads)
    held = (sum(p.numel() for p in _projection(_cfg(groups, bias=True), tp, 0).parameters()) if tp > groups
            else (lp.qkv_weight + lp.qkv_bias) // tp)
    assert qkv_only.per_tp_rank(tp) == held
