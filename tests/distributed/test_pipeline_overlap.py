"""Pipeline p2p overlaps compute (recorded events, one 2-rank launch, pp=2): sends stay in flight while
the stage runs its next forward or backward, receives are posted before the forward or backward that
precedes the one needing them, and a sent activation's memory is released before its backward (which
needs only its shape)."""

import pytest
import torch
import torch.distributed as dist

from megand.tools.spawn import run_distributed

M = 4


class _Request:
    def __init__(self, request, index, events, kind="wait"):
        self.request, self.index, self.events, self.kind = request, index, events, kind

    def wait(self):
        out = self.request.wait()
        self.events.append((self.kind, self.index))
        return out

    def is_completed(self):
        return self.request.is_completed()


def _record(run_dir, vpp):
    from megand.core.pipeline_parallel import get_schedule
    from megand.training.batches import rank_microbatches
    from megand.training.config import compose
    from megand.training.pretrain import Trainer

    overrides = ["+experiment=tiny_gpt", f"run_dir={run_dir}", "parallel.pp=2", f"train.global_batch_size={2 * M}"]
    trainer = Trainer(compose(overrides + ([f"parallel.vpp={vpp}", "model.num_layers=4"] if vpp > 1 else [])))
    topo, chunks = trainer.topo, trainer.chunks
    microbatches = rank_microbatches(trainer.train_data, 0, 2 * M, 2, topo)
    events, sends, recvs = [], 0, 0
    real_batch, real_backward = dist.batch_isend_irecv, torch.autograd.backward

    def batch_isend_irecv(ops):
        nonlocal sends, recvs
        wrapped = []
        for op, request in zip(ops, real_batch(ops)):
            if op.op is dist.isend:
                events.append(("post send", sends))
                wrapped.append(_Request(request, sends, events))
                sends += 1
            else:
                events.append(("post recv", recvs))
                wrapped.append(_Request(request, recvs, events, "wait recv"))
                recvs += 1
        return wrapped

    def forward_step(model, microbatch, hidden):
        events.append(("compute", "forward"))
        return trainer.forward_step(model, microbatch, hidden)

    root_bytes = []  # memory of each non-loss backward root when its backward starts

    def backward(tensors, grad_tensors=None, **kwargs):
        events.append(("compute", "backward"))
        if grad_tensors is not None:
            root_bytes.append(tensors.untyped_storage().nbytes())
        return real_backward(tensors, grad_tensors=grad_tensors, **kwargs)

    dist.batch_isend_irecv, torch.autograd.backward = batch_isend_irecv, backward
    try:
        get_schedule(topo)(chunks, microbatches, forward_step, topo)
    finally:
        dist.batch_isend_irecv, torch.autograd.backward = real_batch, real_backward
    return dict(events=events, root_bytes=root_bytes, first=topo.is_first_stage)


def _overlapped(events, post, wait):
    """Requests (by index) with a compute event between their posting and their wait, and all indices."""
    posted = {e[1]: i for i, e in enumerate(events) if e[0] == post}
    waited = {e[1]: i for i, e in enumerate(events) if e[0] == wait}
    assert posted and set(waited) == set(posted), events  # every request waited on before the schedule returned
    return [n for n in posted if any(e[0] == "compute" for e in events[posted[n] + 1: waited[n]])], list(posted)


@pytest.mark.parametrize("vpp", [pytest.param(1, marks=pytest.mark.slow), 2])  # interleaved: the harder case
def test_receives_are_outstanding_while_the_stage_computes(tmp_path, vpp):
    for out in run_distributed(_record, 2, str(tmp_path), vpp):
        overlapped, received = _overlapped(out["events"], "post recv", "wait recv")
        # all but the first activation (and on the last stage with vpp=1 the first gradient it never
        # receives) arrive while the stage computes: posted before the compute preceding their use
        assert len(overlapped) >= len(received) - 1, out["events"]


@pytest.mark.parametrize("vpp", [pytest.param(1, marks=pytest.mark.slow), 2])  # interleaved: the harder case
def test_sends_are_in_flight_while_the_stage_computes(tmp_path, vpp):
    for out in run_distributed(_record, 2, str(tmp_path), vpp):
        events = out["events"]
        posted = {e[1]: i for i, e in enumerate(events) if e[0] == "post send"}
        waited = {e[1]: i for i, e in enumerate(events) if e[0] == "wait"}
        assert posted and set(waited) == set(posted)  # every send waited on before the schedule returned
        overlapped = [n for n in posted
                      if any(e[0] == "compute" for e in events[posted[n] + 1: waited[n]])]
        assert len(overlapped) >= len(posted) - 1, events  # all but the schedule's last send
        if out["first"] and vpp == 1:  # stage 0 sends every activation it computes on
            assert len(out["root_bytes"]) == M and set(out["root_bytes"]) == {0}, out["root_bytes"]
