"""The planner's replay and the executor run the same actions (one 2-rank gloo launch, pp=2, m=4).

The executor's trace is recorded from outside it: which chunk and micro-batch each ``forward_step``
call gets, which of those outputs each ``torch.autograd.backward`` starts from (an ``I`` where it runs
with the weight-gradient products deferred, a ``B`` otherwise), which of those deferrals each
weight-gradient run (``W``) empties, and how many p2p sends and receives it posts. The replay's trace is the order in which ``simulate`` runs each rank's
operations (sorted by start time). Both must be the rank's action list, for 1F1B and interleaved 1F1B,
zero bubble (zb1p) and the V schedules (zbv, dualpipev: the executor hands the activation and its
gradient over on the rank at the V's turn), and the chunk forwards the executor holds at once must be the count the memory
estimator uses.
"""

import pytest
import torch
import torch.distributed as dist

from megand.core.pipeline_parallel.actions import peak_live_chunks, placement_for, schedule_actions
from megand.core.tensor_parallel import wgrad
from megand.tools.planner.simulate import simulate
from megand.tools.spawn import run_distributed

M, PP = 4, 2
LAYOUTS = {"1f1b": (1, "1f1b"), "interleaved": (2, "1f1b"), "zb1p": (1, "zb1p"), "zbv": (2, "zbv"),
           "dualpipev": (2, "dualpipev")}  # name: (vpp, pp_schedule)


def _executor_traces(run_dir):
    from megand.core.pipeline_parallel import ScheduleStats, get_schedule
    from megand.training.batches import rank_microbatches
    from megand.training.config import compose
    from megand.training.pretrain import Trainer

    traces = {}
    for name, (vpp, schedule) in LAYOUTS.items():
        overrides = ["+experiment=tiny_gpt", f"run_dir={run_dir}", f"parallel.pp={PP}", f"train.global_batch_size={2 * M}",
                     f"parallel.pp_schedule={schedule}"]
        trainer = Trainer(compose(overrides + (["parallel.vpp=2", "model.num_layers=4"] if vpp > 1 else [])))
        topo, chunks = trainer.topo, trainer.chunks
        microbatches = rank_microbatches(trainer.train_data, 0, 2 * M, 2, topo)
        assert len(microbatches) == M
        trace, roots, posted, deferrals = [], {}, {"send": 0, "recv": 0}, {}
        real_batch, real_backward, real_run = dist.batch_isend_irecv, torch.autograd.backward, wgrad.DeferredWeightGrads.run

        def forward_step(model, microbatch, hidden):
            chunk = next(c for c, held in enumerate(chunks) if held is model)
            index = next(i for i, mb in enumerate(microbatches) if mb is microbatch)
            stage = placement_for(PP, vpp, schedule).stage(topo.pp_rank, chunk)
            output = trainer.forward_step(model, microbatch, hidden)
            trace.append(("F", stage, index))
            roots[id(output)] = (stage, index)
            return output

        def backward(tensors, grad_tensors=None, **kwargs):
            key = roots.pop(id(tensors))
            queue = trainer.ddp.weight_grads.queue
            if queue is not None:  # the weight-gradient products of this backward are queued: an I
                deferrals[id(queue)] = key
            trace.append(("I" if queue is not None else "B", *key))
            return real_backward(tensors, grad_tensors=grad_tensors, **kwargs)

        def run(deferred):
            trace.append(("W", *deferrals.pop(id(deferred))))
            return real_run(deferred)

        def batch_isend_irecv(ops):
            for op in ops:
                posted["send" if op.op is dist.isend else "recv"] += 1
            return real_batch(ops)

        trainer.ddp.zero_grad()
        stats = ScheduleStats()
        dist.batch_isend_irecv, torch.autograd.backward, wgrad.DeferredWeightGrads.run = batch_isend_irecv, backward, run
        try:
            get_schedule(topo, schedule=schedule)(chunks, microbatches, forward_step, topo, stats=stats,
                                                  grad_sync=trainer.ddp)
        finally:
            dist.batch_isend_irecv, torch.autograd.backward, wgrad.DeferredWeightGrads.run = real_batch, real_backward, real_run
        trainer.ddp.finish_grad_sync()
        traces[name] = dict(trace=trace, peak_live=stats.peak_live, weight_grad_passes=stats.weight_grad_passes,
                            **posted)
        trainer.close()
    return traces


@pytest.fixture(scope="module")
def executor_traces(tmp_path_factory):
    return run_distributed(_executor_traces, PP, str(tmp_path_factory.mktemp("trace")))


def _replay_trace(vpp, schedule, rank):
    """The order in which the planner's replay runs ``rank``'s operations (equal stage times)."""
    stages = PP * vpp
    timeline = simulate(PP, vpp if vpp > 1 else None, M, [1.0] * stages, [2.0] * stages, schedule=schedule)
    placement = placement_for(PP, vpp, schedule)
    own = [(times, key) for key, times in timeline.ops.items() if placement.location(key[1])[0] == rank]
    return [key for _, key in sorted(own)]


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_replay_and_executor_run_the_same_actions(executor_traces, name):
    vpp, schedule = LAYOUTS[name]
    for rank, traces in enumerate(executor_traces):
        actions = schedule_actions(PP, vpp, M, rank, schedule=schedule)
        executed = traces[name]
        assert executed["trace"] == _replay_trace(vpp, schedule, rank) == [a.key for a in actions], (rank, executed["trace"])
        # a split backward defers the weight gradients of the parallel linear layers (4 per layer here)
        assert (executed["weight_grad_passes"] > 0) == (schedule != "1f1b"), (rank, executed)
        # every send and receive of the action list to another rank is posted, and no other
        assert executed["send"] == sum(a.send_to not in (None, rank) for a in actions), (rank, executed)
        assert executed["recv"] == sum(a.recv_from not in (None, rank) for a in actions), (rank, executed)
        assert executed["peak_live"] == peak_live_chunks(PP, vpp, M, rank, schedule), (rank, executed)
