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
    # documents under context parallelism: the blocks to skip are planned from the host's document ids
    "cp2-ring-documents": ["parallel.cp=2", "data.reset_attention_mask=true"],
    "cp2-all-gather-documents": ["parallel.cp=2", "parallel.cp_comm=all_gather", "data.reset_attention_mask=true"],
}


def _count_reads(run_dir, overrides):
    from megand.training.config import compose
    from megand.training.pretrain import Trainer
    from tests.unit.test_host_syncs import HostReads

    trainer = Trainer(compose(["+experiment=tiny_llama", f"run_dir={run_dir}", "model.num_layers=2", "train.iters=8",
                               "train.log_interval=4", "train.eval_iters=0", "train.global_batch_size=8",
                               "train.micro_batch_size=2", *overrides]))
    from megand.core.transformer.documents import DocumentMask

    trainer.step()
    counters = [x.step for x in trainer.optimizer.pieces if x.step.device.type == "cpu"]  # host tensors by design
    per_step = []
    # the document ids the data pipeline built on the host (and left there) are host memory: the counter sees
    # them only once a micro-batch's DocumentMask receives them
    build_documents = DocumentMask.__init__

    def documents_seen_by(counter):
        def init(self, ids, **host):
            build_documents(self, ids, **host)
            if host.get("host_ids") is not None:
                counter.add_host_tensor(host["host_ids"])
        return init

    for _ in range(2):
        with HostReads(host_tensors=counters) as counter:
            DocumentMask.__init__ = documents_seen_by(counter)
            try:
                trainer.step()
            finally:
                DocumentMask.__init__ = build_documents
        per_step.append(counter.sites)
    from megand.core.transformer.moe import moe_layers

    microbatches = 8 // (2 * trainer.topo.dp_size)
    return per_step, len(moe_layers(trainer.chunks)) * microbatches  # the loop's split-size reads


# dp, pp and tp+sp also keep their one read per step in the CUDA rehearsal's default run
# (tests/unit/test_rehearse_cuda.py): here the MoE and document layouts, the rest slow
@pytest.mark.parametrize("layout", [pytest.param(n, marks=() if n.startswith(("moe", "cp2-ring")) else pytest.mark.slow)
                                    for n in LAYOUTS])
def test_one_host_read_per_step_on_every_rank(tmp_path, layout):
    from tests.unit.test_host_syncs import SPLIT_SIZE_READ

    for rank, (per_step, split_reads) in enumerate(run_distributed(_count_reads, 2, str(tmp_path), LAYOUTS[layout])):
        for sites in per_step:
            others = [kind for kind, where in sites if not where.startswith(SPLIT_SIZE_READ)]
            assert others == ["tolist"], (rank, sites)
            assert len(sites) - len(others) == split_reads, (rank, sites)
