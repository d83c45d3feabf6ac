"""The example clusters whose best plan is not a box: the planner finds stages of different widths on
examples/cluster_mixed_widths.yaml and replicas of different speeds on examples/cluster_replica_speeds.yaml,
reports why and how to launch them; tools/launch.py takes the world size of nodes of different sizes."""

import os

import pytest

from megand.tools import launch
from megand.tools.plan import format_table, launch_commands, pinned_keys
from megand.tools.planner.cluster import load_cluster, parse_cluster
from megand.tools.planner.search import Planner, config_validator
from megand.tools.planner.shares import is_replica_plan
from megand.training.config import compose

EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "..", "examples")


def _planner(overrides, cluster):
    cfg = compose(overrides)
    return Planner(cfg, pinned_keys(overrides), cluster, validate_fn=config_validator(cfg))


@pytest.mark.slow  # the whole search (a minute on a loaded 2-core machine)
def test_mixed_widths_example_runs_each_group_at_its_own_tp():
    overrides = ["model=llama_70b", "model.seq_length=4096", "train.global_batch_size=32"]
    best = _planner(overrides, load_cluster(os.path.join(EXAMPLES, "cluster_mixed_widths.yaml"))).plan(3)[0]
    widths = {g.name: best.candidate.of_rank(r).tp for r, g in enumerate(best.stage_groups)}
    assert best.candidate.stage_widths is not None and widths["h200"] < widths["h100"]


def test_mixed_widths_are_found_reported_and_launched():
    """The same example with the choices the search makes there pinned (seconds, not a minute)."""
    overrides = ["model=llama_70b", "model.seq_length=4096", "train.global_batch_size=32", "parallel.cp=1",
                 "parallel.vpp=2", "parallel.pp_schedule=zbv", "train.micro_batch_size=1",
                 "optim.sharding=optim_grads", "train.recompute=full"]
    planner = _planner(overrides, load_cluster(os.path.join(EXAMPLES, "cluster_mixed_widths.yaml")))
    plans = planner.plan(3)
    best = plans[0]
    c = best.candidate
    assert c.stage_widths is not None and not is_replica_plan(best)
    widths = {g.name: c.of_rank(r).tp for r, g in enumerate(best.stage_groups)}
    assert widths["h200"] < widths["h100"]  # the 141 GB cards hold their layers at a narrower tp
    assert best.world_size == sum(c.stage_sizes) <= 16
    # the per-stage form of the layout, one entry per virtual stage with its rank's width
    layout = [o for o in best.overrides() if o.startswith("parallel.pipeline_layout=")][0]
    entries = c.layout_setting()
    assert len(entries) == c.pp * 2 and sum(e["layers"] for e in entries) == 80
    assert layout.startswith("parallel.pipeline_layout=[{layers:") and "tp:" in layout and "sp:" in layout
    # why: each group's stages, widths and layers, and the speed-ups (neither group holds the model alone)
    table = format_table(plans)
    assert "h200:" in table and f"at tp={widths['h200']}" in table and f"at tp={widths['h100']}" in table
    assert best.as_dict()["stage_widths"][0]["tp"] == c.stage_widths[0][0]
    # one command per node, with the node's own process count
    lines = launch_commands(overrides, best)
    assert [ln.split(": ", 1)[0] for ln in lines] == best.launch()["nodes"]
    assert sum(best.launch()["nproc_per_node"]) == best.world_size


def test_replica_speeds_example_gives_the_faster_group_more_micro_batches():
    overrides = ["model=llama_1b", "model.seq_length=2048", "train.global_batch_size=128", "parallel.cp=1",
                 "train.micro_batch_size=4"]
    planner = _planner(overrides, load_cluster(os.path.join(EXAMPLES, "cluster_replica_speeds.yaml")))
    best = planner.plan(2)[0]
    assert is_replica_plan(best)
    shares = dict(zip((g.name for g in best.replica_groups), best.shares))
    assert shares["h100"] > shares["a100"]
    s = best.speedups()
    assert s["even_split"] > 1 and s["fastest_group_alone"] > 1


def test_nodes_of_different_sizes_launch_with_their_own_process_counts():
    """A group of 4-GPU nodes next to 8-GPU nodes: the launch commands go through tools/launch.py with the
    world size, each node with its own --nproc-per-node."""
    from megand.tools.planner.layout import Candidate, place

    cluster = parse_cluster({"groups": [
        {"name": "big", "nodes": 1, "devices_per_node": 8, "device": "h100"},
        {"name": "small", "nodes": 1, "devices_per_node": 4, "device": "a100"}]})
    big, small = cluster.groups
    c = Candidate.of(tp=8, pp=2, dp=1, pipeline_layout=(2, 2)).with_(stage_widths=((8, True), (4, True)))
    from megand.tools.planner.search import Plan

    plan = Plan(candidate=c, stage_groups=(big, small), prediction=None)
    assert plan.launch()["nproc_per_node"] == [8, 4] and c.world_size == 12
    lines = launch_commands(["model=llama_tiny"], plan)
    assert all("python tools/launch.py --world-size=12" in ln for ln in lines)
    assert "--nproc-per-node=8" in lines[0] and "--nproc-per-node=4" in lines[1]
    assert place(c, [big, small]).node_of == tuple([("big", 0)] * 8 + [("small", 0)] * 4)


def test_launch_world_size_is_taken_out_before_torchrun_and_checked():
    world, rest = launch.split_world_size(["--world-size=12", "--nnodes=2", "--nproc-per-node=4", "pretrain_gpt.py",
                                           "--world-size=3"])
    assert world == 12 and rest == ["--nnodes=2", "--nproc-per-node=4", "pretrain_gpt.py", "--world-size=3"]
    world, rest = launch.split_world_size(["--world-size", "6", "--nnodes=1", "x.py"])
    assert world == 6 and rest == ["--nnodes=1", "x.py"]
    with pytest.raises(launch.LaunchError, match="--world-size=0 must be a positive"):
        launch.split_world_size(["--world-size=0", "pretrain_gpt.py"])
    from torch.distributed.run import parse_args

    args = parse_args(["--nnodes=2", "--nproc-per-node=4", "pretrain_gpt.py"])
    args.world_size = 12
    assert launch.launch_world_sizes(args) == [12]
    args.world_size = None
    assert launch.launch_world_sizes(args) == [8]
