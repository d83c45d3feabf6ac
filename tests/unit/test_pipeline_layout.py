"""Stage construction and the pipeline's configuration errors (no processes)."""

from types import SimpleNamespace

import pytest
import torch

from megand.core.pipeline_parallel.layout import pipeline_layout
from megand.training.config import ConfigError, compose, validate
from megand.core.pipeline_parallel import (
    forward_backward_no_pipelining,
    forward_backward_pipelining_with_interleaving,
    forward_backward_pipelining_without_interleaving,
    get_schedule,
)
from megand.core.pipeline_parallel.layout import chunk_specs
from megand.core.pipeline_parallel.p2p import tensor_shape

def test_even_and_uneven_layouts():
    assert pipeline_layout(8, 4, None, None) == [2, 2, 2, 2]
    assert pipeline_layout(8, 2, 2, None) == [2, 2, 2, 2]
    assert pipeline_layout(4, 2, None, [3, 1]) == [3, 1]


def test_chunks_of_interleaved_and_uneven_layouts():
    # virtual stage c*pp + r lives on rank r as chunk c
    rank0, rank1 = chunk_specs([1, 1, 1, 1], 2, 0), chunk_specs([1, 1, 1, 1], 2, 1)
    assert [c.layer_ids for c in rank0] == [[0], [2]] and [c.layer_ids for c in rank1] == [[1], [3]]
    assert [(c.pre_process, c.post_process) for c in rank0] == [(True, False), (False, False)]
    assert [(c.pre_process, c.post_process) for c in rank1] == [(False, False), (False, True)]
    first, last = chunk_specs([3, 1], 2, 0), chunk_specs([3, 1], 2, 1)
    assert first[0].layer_ids == [0, 1, 2] and last[0].layer_ids == [3] and last[0].post_process
    (empty_last,) = chunk_specs([2, 1, 1, 0], 2, 1)[1:]
    assert empty_last.layer_ids == [] and empty_last.post_process


@pytest.mark.parametrize("overrides, world_size, message", [
    (["parallel.pp=3"], 3, r"model.num_layers=4 cannot be split evenly over parallel.pp=3 x parallel.vpp=1 = 3"),
    (["parallel.pp=2", "parallel.vpp=4"], 2, r"cannot be split evenly over parallel.pp=2 x parallel.vpp=4 = 8 stages"),
    (["parallel.pp=2", "parallel.pipeline_layout=[3,2]"], 2,
     r"parallel.pipeline_layout=\[3, 2\] must have pp\*vpp = 2 non-negative entries summing to model.num_layers=4"
     r" \(it has 2 summing to 5\)"),
    (["parallel.pp=2", "parallel.vpp=2", "parallel.pipeline_layout=[3,1]"], 2,
     r"must have pp\*vpp = 4 .*\(it has 2 summing to 4\)"),
    (["parallel.pp=2", "parallel.vpp=2", "train.global_batch_size=6"], 2,
     r"interleaved pipelining needs the number of micro-batches \(3 = .*\) to be a multiple of parallel.pp=2"),
    (["parallel.pp=2", "parallel.vpp=2", "train.global_batch_size=12", "parallel.dp=2"], 4,
     r"micro-batches \(3 = global batch 12 / \(micro batch 2 x dp 2\)\) to be a multiple of parallel.pp=2"),
    (["parallel.vpp=2"], 1, r"parallel.vpp=2 needs parallel.pp >= 2"),
])
def test_pipeline_errors_name_the_values(overrides, world_size, message):
    with pytest.raises(ConfigError, match=message):
        validate(compose(["+experiment=tiny_gpt", *overrides]), world_size)


def test_valid_pipeline_layouts_pass():
    validate(compose(["+experiment=tiny_gpt", "parallel.pp=4"]), 4)
    validate(compose(["+experiment=tiny_gpt", "parallel.pp=2", "parallel.vpp=2", "parallel.pipeline_layout=[2,1,1,0]"]), 2)


def test_interleaved_schedule_rejects_micro_batches_not_a_multiple_of_pp():
    topo = SimpleNamespace(pp_size=2, pp_rank=0)
    with pytest.raises(ValueError, match=r"number of micro-batches \(3\) to be a multiple of pp=2"):
        forward_backward_pipelining_with_interleaving([None, None], [None] * 3, None, topo)


def test_schedule_choice_and_link_shape():
    def topo(pp, vpp=None, tp=1):
        return SimpleNamespace(pp_size=pp, vpp=vpp, tp_size=tp)

    assert get_schedule(topo(1)) is forward_backward_no_pipelining
    assert get_schedule(topo(2)) is forward_backward_pipelining_without_interleaving
    assert get_schedule(topo(2, vpp=1)) is forward_backward_pipelining_without_interleaving
    assert get_schedule(topo(2, vpp=2)) is forward_backward_pipelining_with_interleaving
    microbatch = SimpleNamespace(batch_size=2, positions=torch.arange(32))
    cfg = SimpleNamespace(sequence_parallel=True, hidden_size=64, pipeline_width=64)
    assert tensor_shape(cfg, microbatch, topo(2, tp=4)) == (8, 2, 64)  # bsh/tp per link
    cfg.sequence_parallel = False
    assert tensor_shape(cfg, microbatch, topo(2, tp=4)) == (32, 2, 64)
