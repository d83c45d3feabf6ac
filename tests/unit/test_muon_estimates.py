"""The estimator and the planner count Muon: one fp32 moment for the layers' matrices, the Newton-Schulz
FLOPs of every logical matrix (counted here by hand) and the pieces it moves."""

import pytest

from megand.tools.estimate_memory import Layout, estimate_memory, matrix_step_cost, stage_layer_params
from megand.tools.planner.cluster import parse_cluster
from megand.tools.planner.cost import predict
from megand.tools.planner.layout import Candidate

MODEL = dict(arch="llama", num_layers=4, hidden_size=256, ffn_hidden_size=512, num_attention_heads=8,
             num_query_groups=2, seq_length=128, vocab_size=1000, activation="swiglu", norm="rmsnorm",
             position_embedding="rope", tie_embeddings=False)


def ns(m, n):
    m, n = min(m, n), max(m, n)
    return 5 * (2 * m * m * n + 2 * m * m * m + 2 * m * m * n)  # X X^T, A A, B X per iteration


def test_muon_keeps_one_moment_of_the_layers_matrices():
    adam = Layout.of(tp=2, dp=4, sharding="optim", precision="bf16")
    muon = Layout.of(tp=2, dp=4, sharding="optim", precision="bf16", optimizer="muon")
    a, m = estimate_memory(MODEL, adam).stages[0], estimate_memory(MODEL, muon).stages[0]
    assert a.optimizer_bytes - m.optimizer_bytes == pytest.approx(4 * stage_layer_params(MODEL, muon, 0) / 4)
    assert a.param_bytes == m.param_bytes and a.grad_bytes == m.grad_bytes


def test_newton_schulz_flops_per_logical_matrix():
    per_layer = ns(256, 256) + 2 * ns(64, 256) + ns(256, 256) + 3 * ns(512, 256)  # q, k, v, proj; gate, up, down
    cost = matrix_step_cost(MODEL, Layout.of(tp=2, dp=4, sharding="optim", optimizer="muon"), 0)
    assert cost["flops"] == pytest.approx(4 * per_layer / (2 * 4))  # dealt over tp x the shard group
    assert cost["bytes"] == pytest.approx(2 * 4 * stage_layer_params(MODEL, Layout.of(tp=2, dp=4), 0))
    unsharded = matrix_step_cost(MODEL, Layout.of(tp=2, dp=4, optimizer="muon"), 0)  # still spread over dp
    assert unsharded["flops"] == pytest.approx(cost["flops"])


def test_planner_step_includes_newton_schulz():
    cluster = parse_cluster({"groups": [{"name": "a", "nodes": 1, "devices_per_node": 8, "device": "h100"}]})
    c = Candidate.of(tp=2, dp=4, sharding="optim", micro_batch_size=1)
    adam = predict(MODEL, c, 32, [cluster.groups[0]])
    muon = predict(MODEL, c.with_(optimizer="muon"), 32, [cluster.groups[0]])
    assert muon.parts["optimizer_s"] > adam.parts["optimizer_s"]
    assert muon.mem_peak_gib[0] < adam.mem_peak_gib[0]
