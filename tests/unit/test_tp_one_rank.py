"""At tp=1 the tensor-parallel mappings are free: no copy, no autograd node."""

import pytest
import torch
import torch.distributed as dist

from megand.core.checkpointing.offline import single_process_topology
from megand.core.tensor_parallel import copy_to_tp, reduce_from_tp


@pytest.fixture(scope="module")
def tp_group():
    topo = single_process_topology()
    yield topo.tp_group
    dist.destroy_process_group()


def test_reduce_from_tp_of_one_rank_returns_its_input(tp_group):
    x = torch.randn(4, 3, requires_grad=True)
    y = x * 2
    assert reduce_from_tp(y, tp_group) is y
    assert copy_to_tp(y, tp_group).data_ptr() == y.data_ptr()
