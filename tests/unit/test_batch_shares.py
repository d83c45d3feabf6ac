"""Per-replica batch shares (megand/core/batch_shares.py): which samples each replica reads, and the layouts
refused in one line before any work."""

import pytest

from megand.core.batch_shares import lockstep_microbatches, replica_rows, step_microbatches
from megand.core.parallel_layout import LayoutError, ParallelLayout
from megand.training.batches import microbatch_rows
from megand.training.config import ConfigError, compose, validate


def test_replicas_read_contiguous_slices_of_their_shares():
    assert [replica_rows((5, 3), 2, r, 16) for r in range(2)] == [(0, 10), (10, 6)]
    assert [replica_rows((1, 2, 1), 3, r, 8) for r in range(3)] == [(0, 2), (2, 4), (6, 2)]
    assert [replica_rows(None, 2, r, 8) for r in range(2)] == [(0, 4), (4, 4)]
    # every sample of the global batch once, whatever the shares
    for shares in [(3, 1), (1, 2, 1), (2, 2), (1, 1, 1, 5)]:
        rows = [i for r in range(len(shares)) for i in range(*(lambda a, n: (a, a + n))(
            *replica_rows(shares, len(shares), r, 2 * sum(shares))))]
        assert rows == list(range(2 * sum(shares)))
    assert len(microbatch_rows(replica_rows((5, 3), 2, 0, 16)[1], 2)) == 5


def test_step_averages_over_every_replicas_microbatches_only_when_uneven():
    assert step_microbatches((3, 1), 3) == 4 and step_microbatches((2, 2), 2) == 2 and step_microbatches(None, 2) == 2


def test_shard_groups_run_the_largest_share_in_lockstep():
    assert lockstep_microbatches((3, 1), 1) == 3 and lockstep_microbatches((1, 2, 1), 2) == 2
    assert lockstep_microbatches((2, 2), 2) == 2 and lockstep_microbatches(None, 4) == 4


def test_layout_checks_the_shares():
    assert ParallelLayout(dp=2, dp_microbatches=[3, 1]).uneven_shares
    assert not ParallelLayout(dp=2, dp_microbatches=[2, 2]).uneven_shares
    with pytest.raises(LayoutError, match=r"parallel.dp_microbatches=\[3, 1, 1\] must list one positive number of "
                                          r"micro-batches per data-parallel replica \(dp=2\)"):
        ParallelLayout(dp=2, dp_microbatches=[3, 1, 1])
    with pytest.raises(LayoutError, match="dp_microbatches=\\[3, 0\\]"):
        ParallelLayout(dp=2, dp_microbatches=[3, 0])


@pytest.mark.parametrize("overrides, world_size, message", [
    (["parallel.dp_microbatches=[3,1,1]"], 2, r"parallel.dp_microbatches=\[3, 1, 1\] must list one positive number"),
    (["parallel.dp_microbatches=[3,2]"], 2, r"parallel.dp_microbatches=\[3, 2\] takes 5 micro-batches per step, but "
                                            r"train.global_batch_size=8 / train.micro_batch_size=2 is 4"),
    (["parallel.dp_microbatches=[3,1]", "train.rampup_batch_size=[4,4,64]"], 2, r"train.rampup_batch_size=\[4, 4, 64\]"
                                                                                r" changes the global batch"),
    (["parallel.dp_microbatches=[3,1]", "parallel.pp=2", "parallel.vpp=2", "train.global_batch_size=4",
      "train.micro_batch_size=1"], 4,
     r"3 = parallel.dp_microbatches\[0\].*multiple of parallel.pp=2"),
    # ZeRO-2/3 behind a pipeline: each stage's shard-group collectives follow its schedule (no phantoms)
    (["parallel.dp_microbatches=[3,1]", "parallel.pp=2", "optim.sharding=optim_grads_params"], 4,
     r"parallel.dp_microbatches=\[3, 1\]: the dp_shard group \[0, 1\] spans replicas with \[1, 3\] micro-batches, "
     r"but runs the ZeRO-2/3 .* in its pipeline schedule's order; keep it inside replicas of equal shares "
     r"\(optim.sharding=optim_grads_params with parallel.pp=2; at parallel.pp=1 phantom micro-batches join them, "
     r"and optim.sharding=optim meets once per step\)"),
    (["parallel.dp_microbatches=[3,1]", "parallel.pp=2", "optim.sharding=optim_grads"], 4,
     r"the dp_shard group \[0, 1\] spans.*optim.sharding=optim_grads with parallel.pp=2"),
    (["model=moe_tiny", "train.global_batch_size=4", "train.micro_batch_size=1", "parallel.dp_microbatches=[3,1]",
      "parallel.ep=2"], 2, r"the ep group \[0, 1\] spans replicas with \[1, 3\] micro-batches, but runs the expert"),
])
def test_bad_shares_are_refused_in_one_line(overrides, world_size, message):
    with pytest.raises(ConfigError, match=message) as e:
        validate(compose(["+experiment=tiny_llama", *overrides]), world_size)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("overrides, world_size", [
    (["parallel.dp_microbatches=[3,1]", "optim.sharding=optim"], 2),
    (["parallel.dp_microbatches=[3,1]", "parallel.cp=2", "parallel.dp_shard=2", "optim.sharding=optim_grads_params"], 4),
    (["model=moe_tiny", "train.global_batch_size=4", "train.micro_batch_size=1", "parallel.dp_microbatches=[3,1]",
      "parallel.cp=2", "parallel.ep=2"], 4),
    (["parallel.dp_microbatches=[1,2,1]"], 3),
    # pp=1: ZeRO-2/3 shard groups (and expert-dp groups) across shares, joined by phantom micro-batches
    (["parallel.dp_microbatches=[3,1]", "optim.sharding=optim_grads_params"], 2),
    (["parallel.dp_microbatches=[1,2,1]", "optim.sharding=optim_grads"], 3),
    (["model=moe_tiny", "train.global_batch_size=4", "train.micro_batch_size=1", "parallel.dp_microbatches=[3,1]",
      "parallel.cp=2", "parallel.ep=2", "optim.sharding=optim_grads_params"], 4),
])
def test_shares_that_keep_every_per_microbatch_group_inside_a_replica_pass(overrides, world_size):
    validate(compose(["+experiment=tiny_llama", *overrides]), world_size)


def test_replica_microbatches_are_its_slice_of_the_global_batch():
    """Shares [3,1] at micro-batches of 2: replica 0 reads samples 0-5 as 3 micro-batches, replica 1 samples 6-7."""
    from types import SimpleNamespace

    import numpy as np
    import torch

    from megand.training.batches import rank_microbatches

    data = [np.full(5, i) for i in range(40)]
    view = lambda r: SimpleNamespace(dp_rank=r, dp_size=2, cp_rank=0, cp_size=1, dp_microbatches=(3, 1),  # noqa: E731
                                     device=torch.device("cpu"))
    first, second = (rank_microbatches(data, 1, 8, 2, view(r)) for r in range(2))
    assert [sorted(mb.input_ids[:, 0].tolist()) for mb in first] == [[8, 11], [9, 12], [10, 13]]
    assert [sorted(mb.input_ids[:, 0].tolist()) for mb in second] == [[14, 15]]


def test_phantoms_stand_only_for_micro_batches_that_repeat_one_pattern():
    """The data-parallel engine's phantoms (megand/core/distributed/data_parallel.py) replay one real
    micro-batch's shard-group collectives: refused when the real ones do not repeat a pattern, or behind a
    pipeline (whose schedule orders them)."""
    from types import SimpleNamespace

    from megand.core.distributed import DataParallel

    engine = SimpleNamespace(buckets=[], gatherer=None, topo=SimpleNamespace(pp_size=1))
    one = [("all_gather", 1, "forward"), ("all_gather", 0, "forward"), ("reduce_scatter", 0, None)]
    assert DataParallel._one_microbatch(engine, one * 3, 3) == one
    assert DataParallel._one_microbatch(engine, [], 2) == []  # ZeRO-0/1: nothing per micro-batch
    with pytest.raises(RuntimeError, match="the 3 micro-batches of this step issued 7 shard-group collectives that do "
                                           "not repeat one micro-batch's"):
        DataParallel._one_microbatch(engine, one * 2 + one[:1], 3)
    with pytest.raises(RuntimeError, match=r"pp > 1"):
        behind_a_pipeline = SimpleNamespace(buckets=[], gatherer=None, topo=SimpleNamespace(pp_size=2))
        DataParallel._one_microbatch(behind_a_pipeline, one, 1)
