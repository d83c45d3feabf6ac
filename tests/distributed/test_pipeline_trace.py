"""The planner's replay and the executor run the same actions (one 2-rank gloo launch, pp=2, m=4).

The executor's trace is recorded from outside it: which chunk and micro-batch each ``forward_step``
call gets, which of those outputs each ``torch.autograd.backward`` starts from, and how many p2p sends
and receives it posts. The replay's trace is the order in which ``simulate`` runs each rank's
operations (sorted by start time). Both must be the rank's action list, for 1F1B and interleaved 1F1B,
and the chunk forwards the executor holds at once must be the count the memory estimator uses.
"""

import pytest
import torch
import torch.distributed as dist

from megand.core.pipeline_parallel.actions import interleaved_placement, peak_live_chunks, schedule_actions
from megand.tools.planner.simulate import simulate
from megand.tools.spawn import run_distributed

M, PP = 4, 2


def _executor_traces(run_dir):
    from megand.core.pipeline_parallel import ScheduleStats, get_schedule
    from megand.training.batches import rank_microbatches
    from megand.training.config import compose
    from megand.training.pretrain import Trainer

    traces = {}
    for vpp in (1, 2):
        overrides = ["+experiment=tiny_gpt", f"run_dir={run_dir}", f"parallel.pp={PP}", f"train.global_batch_size={2 * M}"]
        trainer = Trainer(compose(overrides + (["parallel.vpp=2", "model.num_layers=4"] if vpp > 1 else [])))
        topo, chunks = trainer.topo, trainer.chunks
        microbatches = rank_microbatches(trainer.train_data, 0, 2 * M, 2, topo)
        assert len(microbatches) == M
        trace, roots, posted = [], {}, {"send": 0, "recv": 0}
        real_batch, real_backward = dist.batch_isend_irecv, torch.autograd.backward

        def forward_step(model, microbatch, hidden):
            chunk = next(c for c, held in enumerate(chunks) if held is model)
            index = next(i for i, mb in enumerate(microbatches) if mb is microbatch)
            stage = chunk * PP + topo.pp_rank
            output = trainer.forward_step(model, microbatch, hidden)
            trace.append(("F", stage, index))
            roots[id(output)] = (stage, index)
            return output

        def backward(tensors, grad_tensors=None, **kwargs):
            trace.append(("B", *roots.pop(id(tensors))))
            return real_backward(tensors, grad_tensors=grad_tensors, **kwargs)

        def batch_isend_irecv(ops):
            for op in ops:
                posted["send" if op.op is dist.isend else "recv"] += 1
            return real_batch(ops)

        trainer.ddp.zero_grad()
        stats = ScheduleStats()
        dist.batch_isend_irecv, torch.autograd.backward = batch_isend_irecv, backward
        try:
            get_schedule(topo)(chunks, microbatches, forward_step, topo, stats=stats)
        finally:
            dist.batch_isend_irecv, torch.autograd.backward = real_batch, real_backward
        traces[vpp] = dict(trace=trace, peak_live=stats.peak_live, **posted)
    return traces


@pytest.fixture(scope="module")
def executor_traces(tmp_path_factory):
    return run_distributed(_executor_traces, PP, str(tmp_path_factory.mktemp("trace")))


def _replay_trace(vpp, rank):
    """The order in which the planner's replay runs ``rank``'s operations (equal stage times)."""
    stages = PP * vpp
    timeline = simulate(PP, vpp if vpp > 1 else None, M, [1.0] * stages, [2.0] * stages)
    placement = interleaved_placement(PP, vpp)
    own = [(times, key) for key, times in timeline.ops.items() if placement.location(key[1])[0] == rank]
    return [key for _, key in sorted(own)]


@pytest.mark.parametrize("vpp", [1, 2], ids=["1f1b", "interleaved"])
def test_replay_and_executor_run_the_same_actions(executor_traces, vpp):
    for rank, traces in enumerate(executor_traces):
        actions = schedule_actions(PP, vpp, M, rank)
        executed = traces[vpp]
        assert executed["trace"] == _replay_trace(vpp, rank) == [a.key for a in actions], (rank, executed["trace"])
        # every send and receive of the action list is posted, and no other
        assert executed["send"] == sum(a.send_to is not None for a in actions), (rank, executed)
        assert executed["recv"] == sum(a.recv_from is not None for a in actions), (rank, executed)
        assert executed["peak_live"] == peak_live_chunks(PP, vpp, M, rank), (rank, executed)
