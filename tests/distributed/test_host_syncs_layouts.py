"""One host read per training step between log lines also on multi-rank layouts (data parallel with the
distributed optimizer and overlapped reduction; a pipeline; tensor parallel with sequence parallelism, dense
and MoE)."""

import pytest

from megand.tools.spawn import run_distributed

LAYOUTS = {
    "dp2-distributed-overlap": ["optim.sharding=optim", "optim.overlap_grad_reduce=true",
                                "optim.overlap_param_gather=true"],
    "pp2": ["parallel.pp=2"],
    "tp2-sp": ["parallel.tp=2", "parallel.sequence_parallel=true"],
    # MoE: balancing statistics all-reduced and accumulated on the device, capacity, the bias update
    "moe-tp2-sp": ["model=moe_tiny", "model.moe_router=sigmoid", "model.moe_capacity_factor=1.0", "parallel.tp=2",
                   "parallel.sequence_parallel=true"],
}


def _count_reads(run_dir, overrides):
    from megand.training.config import compose
    from megand.training.pretrain import Trainer
    from tests.unit.test_host_syncs import HostReads

    trainer = Trainer(compose(["+experiment=tiny_llama", f"run_dir={run_dir}", "model.num_layers=2", "train.iters=8",
                               "train.log_interval=4", "train.eval_iters=0", "train.global_batch_size=8",
                               "train.micro_batch_size=2", *overrides]))
    trainer.step()
    counters = [x.step for x in trainer.optimizer.pieces if x.step.device.type == "cpu"]  # host tensors by design
    per_step = []
    for _ in range(2):
        with HostReads(host_tensors=counters) as counter:
            trainer.step()
        per_step.append(counter.reads)
    return per_step


@pytest.mark.parametrize("layout", LAYOUTS)
def test_one_host_read_per_step_on_every_rank(tmp_path, layout):
    for rank, per_step in enumerate(run_distributed(_count_reads, 2, str(tmp_path), LAYOUTS[layout])):
        assert per_step == [["tolist"], ["tolist"]], (rank, per_step)
