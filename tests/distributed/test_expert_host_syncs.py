"""Expert parallelism adds exactly one host read per MoE layer and micro-batch: the all-to-all's split
sizes (``all_to_all_single`` takes them as host integers), read once in the dispatch; the combine and
the backward reuse them. Everything else stays at the step's one read."""

from megand.tools.spawn import run_distributed


def _count_reads(run_dir):
    from megand.training.config import compose
    from megand.training.pretrain import Trainer
    from tests.unit.test_host_syncs import HostReads

    trainer = Trainer(compose(["+experiment=tiny_llama", "model=moe_tiny", f"run_dir={run_dir}", "model.num_layers=2",
                               "train.iters=8", "train.log_interval=4", "train.eval_iters=0",
                               "train.global_batch_size=8", "train.micro_batch_size=2", "parallel.ep=2"]))
    trainer.step()
    counters = [x.step for x in trainer.optimizer.pieces if x.step.device.type == "cpu"]  # host tensors by design
    per_step = []
    for _ in range(2):
        with HostReads(host_tensors=counters) as counter:
            trainer.step()
        per_step.append(counter.reads)
    return per_step


def test_one_read_per_moe_layer_and_microbatch_plus_the_step_read(tmp_path):
    layers, microbatches = 2, 2  # 8 samples / (2 per micro-batch x dp 2)
    for rank, per_step in enumerate(run_distributed(_count_reads, 2, str(tmp_path))):
        for reads in per_step:
            assert reads == ["tolist"] * (layers * microbatches + 1), (rank, reads)
