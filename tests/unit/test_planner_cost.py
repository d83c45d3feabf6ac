"""The planner's cost-model pieces: profiles, GEMM interpolation, alpha-beta collectives, links, cost."""

import json

import pytest

from megand.tools.planner.cluster import ClusterError, parse_cluster
from megand.tools.planner.cost import layer_times, predict
from megand.tools.planner.defaults import DEVICES
from megand.tools.planner.layout import Candidate, place, spanned_links
from megand.tools.planner.profile import (OPS, Profile, ProfileError, bus_factor, collective_time, gemm_efficiency,
                                          gemm_time)
from megand.models.flops import Shape


def _profile(**changes):
    d = {"name": "t", "source": "test", "dtype": "fp32", "peak_tflops": 1.0,
         "gemm": [{"m": 64, "n": 64, "k": 64, "tflops": 0.2}, {"m": 1024, "n": 1024, "k": 1024, "tflops": 0.8}],
         "memory_gbps": 10.0, "overhead_s": {"per_layer_step": 0.0, "per_microbatch": 0.0, "per_step": 0.0},
         "collectives": {link: {op: {"alpha_s": 1e-3, "gbps": gbps} for op in OPS}
                         for link, gbps in (("intra_node", 4.0), ("inter_node", 1.0))}}
    d.update(changes)
    return Profile.from_dict(d)


@pytest.mark.parametrize("op,n,factor", [("all_reduce", 4, 1.5), ("all_reduce", 2, 1.0), ("all_gather", 4, 0.75),
                                         ("reduce_scatter", 8, 0.875), ("all_to_all", 2, 0.5), ("p2p", 2, 1.0),
                                         ("all_reduce", 1, 0.0)])
def test_bus_bandwidth_factors(op, n, factor):
    assert bus_factor(op, n) == pytest.approx(factor)


def test_collective_time_is_alpha_plus_factor_bytes_over_bandwidth():
    p = _profile()
    # all-reduce of 1 GB over 4 ranks inside a node: 1e-3 + 1.5 * 1e9 / 4e9
    assert collective_time(p, "all_reduce", 1e9, 4, "intra_node") == pytest.approx(1e-3 + 0.375)
    assert collective_time(p, "all_gather", 1e9, 4, "inter_node") == pytest.approx(1e-3 + 0.75)
    assert collective_time(p, "p2p", 2e9, 2, "inter_node") == pytest.approx(1e-3 + 2.0)
    assert collective_time(p, "all_reduce", 1e9, 1, "inter_node") == 0.0  # a group of one moves nothing


def test_gemm_efficiency_interpolates_between_measured_points():
    p = _profile()
    assert gemm_efficiency(p, 64, 64, 64) == pytest.approx(0.2)  # exact at a measured shape
    assert gemm_efficiency(p, 1024, 1024, 1024) == pytest.approx(0.8)
    middle = gemm_efficiency(p, 256, 256, 256)  # halfway in log space: the mean of the two
    assert middle == pytest.approx(0.5)
    assert 0.2 < gemm_efficiency(p, 128, 128, 128) < middle < gemm_efficiency(p, 512, 512, 512) < 0.8
    assert gemm_efficiency(p, 8192, 8192, 8192) == pytest.approx(0.8, rel=0.05)  # no extrapolation above
    assert gemm_time(p, 1024, 1024, 1024) == pytest.approx(2 * 1024 ** 3 / 0.8e12)


def test_profile_round_trip_and_clear_errors(tmp_path):
    p = _profile()
    path = tmp_path / "p.json"
    p.save(str(path))
    assert Profile.load(str(path)) == p
    bad = p.to_dict()
    bad["collectives"]["inter_node"].pop("all_to_all")
    path.write_text(json.dumps(bad))
    with pytest.raises(ProfileError, match="collectives.inter_node.all_to_all"):
        Profile.load(str(path))
    with pytest.raises(ProfileError, match="peak_tflops=0"):
        _profile(peak_tflops=0)
    with pytest.raises(ProfileError, match=r"gemm\[0\]"):
        _profile(gemm=[{"m": 1, "n": 2}])


def test_shipped_profiles_state_their_source():
    for name, d in DEVICES.items():
        assert d["profile"].source and d["profile"].peak_tflops == d["peak_tflops"], name
        for link in ("intra_node", "inter_node"):
            assert set(d["profile"].collectives[link]) == set(OPS)


def _h100(nodes=2):
    return parse_cluster({"groups": [{"name": "h100", "nodes": nodes, "devices_per_node": 8, "device": "h100"}]})


def test_links_follow_megands_rank_order():
    g = _h100().groups[0]
    # tp=8 fills a node: tp inside it, dp (one rank per node) across nodes
    c = Candidate.of(tp=8, dp=2)
    links = spanned_links(c, place(c, [g]))
    assert links["tp"] == ["intra_node"] and links["dp_cp"] == ["inter_node"]
    # tp=2, dp=4: a stage is one node; the pipeline crosses nodes
    c = Candidate.of(tp=2, dp=4, pp=2)
    links = spanned_links(c, place(c, [g, g]))
    assert links["tp"] == ["intra_node"] * 2 and links["dp_cp"] == ["intra_node"] * 2 and links["pp"] == ["inter_node"]
    # an order with dp fastest puts the tensor-parallel peers 8 ranks apart: on two nodes
    c = Candidate.of(tp=2, dp=8, order="dp-tp-cp-pp")
    links = spanned_links(c, place(c, [g]))
    assert links["tp"] == ["inter_node"] and links["dp_cp"] == ["intra_node"]
    # hybrid sharding: shards inside a node, replicas across
    c = Candidate.of(tp=1, dp=16, sharding="optim", dp_shard=8)
    links = spanned_links(c, place(c, [g]))
    assert links["dp_shard"] == ["intra_node"] and links["dp_replica"] == ["inter_node"]


def test_tensor_parallel_collectives_use_the_link_they_span():
    shape = Shape.from_config(dict(arch="llama", num_layers=2, hidden_size=4096, ffn_hidden_size=14336,
                                   num_attention_heads=32, num_query_groups=8, seq_length=4096, vocab_size=32000))
    prof = DEVICES["h100"]["profile"]
    c = Candidate.of(tp=8, sequence_parallel=True)
    inside, across = layer_times(shape, c, prof, "intra_node", "intra_node"), layer_times(shape, c, prof, "inter_node", "intra_node")
    act = 4096 * 4096 * 2  # one micro-batch's bf16 activations
    for link, lt in (("intra_node", inside), ("inter_node", across)):  # two all-gathers and reduce-scatters
        assert lt.tp_fwd == pytest.approx(2 * (collective_time(prof, "all_gather", act, 8, link)
                                               + collective_time(prof, "reduce_scatter", act, 8, link)))
    assert across.tp_fwd > 5 * inside.tp_fwd


def test_uneven_split_and_slower_device_show_in_the_step():
    model = dict(arch="llama", num_layers=8, hidden_size=1024, ffn_hidden_size=4096, num_attention_heads=16,
                 num_query_groups=4, seq_length=1024, vocab_size=32000)
    cl = parse_cluster({"groups": [{"name": "a", "nodes": 1, "devices_per_node": 8, "device": "h100"},
                                   {"name": "b", "nodes": 1, "devices_per_node": 8, "device": "h100",
                                    "peak_tflops": 300}]})
    fast, slow = cl.groups
    even = Candidate.of(tp=8, pp=2, micro_batch_size=1)
    t_even = predict(model, even, 32, [fast, slow]).step_time_s
    t_uneven = predict(model, even.with_(pipeline_layout=(6, 2)), 32, [fast, slow]).step_time_s
    t_wrong = predict(model, even.with_(pipeline_layout=(2, 6)), 32, [fast, slow]).step_time_s
    assert t_uneven < t_even < t_wrong
    assert predict(model, even, 32, [fast, fast]).step_time_s < t_even


def test_cluster_file_errors_name_the_group_and_key():
    with pytest.raises(ClusterError, match="group 'x'.*memory_gib is missing"):
        parse_cluster({"groups": [{"name": "x", "nodes": 1, "devices_per_node": 8, "peak_tflops": 100,
                                   "intra_node_gbps": 100, "inter_node_gbps": 10}]})
    with pytest.raises(ClusterError, match="device='tpu'"):
        parse_cluster({"groups": [{"name": "x", "nodes": 1, "devices_per_node": 8, "device": "tpu"}]})
    with pytest.raises(ClusterError, match="nodes=0"):
        parse_cluster({"groups": [{"name": "x", "nodes": 0, "devices_per_node": 8, "device": "h100"}]})
    with pytest.raises(ClusterError, match="unknown key"):
        parse_cluster({"groups": [{"name": "x", "nodes": 1, "devices_per_node": 8, "device": "h100", "gpus": 8}]})
    g = parse_cluster({"groups": [{"name": "x", "nodes": 1, "devices_per_node": 8, "device": "h100",
                                   "peak_tflops": 500, "inter_node_gbps": 25}]}).groups[0]
    assert g.peak_tflops == 500 and g.profile.collectives["inter_node"]["all_reduce"]["gbps"] == 25
    assert gemm_efficiency(g.profile, 8192, 8192, 8192) == gemm_efficiency(DEVICES["h100"]["profile"], 8192, 8192, 8192)
