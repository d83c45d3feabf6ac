"""Parameter all-gathers are issued in the order the forward pass needs them (recorded events, spawned
gloo ranks): after the optimizer step with ``optim.overlap_param_gather`` (ZeRO-1) and before each
module's forward under ZeRO-3, with and without interleaved pipeline chunks. One communicator runs its
collectives in the order they are issued, so a gather issued late delays every forward that waits."""

import pytest
import torch

from megand.tools.spawn import run_distributed
from tests.distributed.dp_helpers import build_trainer

# small buckets: every Linear's weight and bias fall into separate buckets, so a module reads several
BUCKET = "optim.bucket_size=100"


def _bucket_index(ddp, out):
    for b in ddp.buckets:
        data = b.data
        if data.numel() == out.numel() and data.untyped_storage().size() and data.data_ptr() == out.data_ptr():
            return b.index
    raise AssertionError("an all-gather into no parameter bucket")


def _record(experiment, overrides, zero3):
    from megand.core.distributed import data_parallel, param_gather

    t = build_trainer([BUCKET, *overrides], experiment=experiment)
    ddp, events = t.ddp, []
    real_gather, real_backward = data_parallel.all_gather_flat, torch.autograd.backward

    def gather(out, shard, **kwargs):
        events.append(("gather", _bucket_index(ddp, out)))
        return real_gather(out, shard, **kwargs)

    def backward(*args, **kwargs):
        events.append(("backward",))
        return real_backward(*args, **kwargs)

    for chunk in t.chunks:  # registered after the engine's hooks: runs once the module's gathers are issued
        for module in chunk.modules():
            # ZeRO-3 gathers a borrowed parameter (the tied word embedding) for the borrowing module's forward
            used = list(module.parameters(recurse=False))
            if zero3 and callable(getattr(module, "borrowed_parameters", None)):
                used += list(module.borrowed_parameters())
            needs = sorted({ddp.bucket_of[p].index for p in used if p in ddp.bucket_of})
            if needs:
                module.register_forward_pre_hook(lambda m, args, needs=needs: events.append(("need", needs)))
    data_parallel.all_gather_flat = param_gather.all_gather_flat = gather
    torch.autograd.backward = backward
    try:
        steps = []
        for _ in range(2):
            events.clear()
            t.step()
            steps.append(list(events))
    finally:
        data_parallel.all_gather_flat = param_gather.all_gather_flat = real_gather
        torch.autograd.backward = real_backward
    return {"steps": steps, "buckets": len(ddp.buckets)}


def _next_need(events, gathers_until):
    """For each gather among ``events[:gathers_until]``: ``(bucket, position of the first later module
    forward that reads the bucket)``."""
    out = []
    for k, e in enumerate(events[:gathers_until]):
        if e[0] == "gather":
            need = next((j for j in range(k + 1, len(events)) if events[j][0] == "need" and e[1] in events[j][1]), None)
            out.append((e[1], need))
    return out


@pytest.mark.parametrize("experiment, layout", [pytest.param("tiny_gpt", [], marks=pytest.mark.slow), ("tiny_llama", []),
                                                pytest.param("tiny_gpt", ["parallel.pp=2", "parallel.vpp=2"],
                                                             marks=pytest.mark.slow)],
                         ids=["gpt-dp2", "llama-dp2", "gpt-pp2-vpp2-dp2"])
def test_param_gathers_are_issued_in_forward_order(experiment, layout):
    world = 2 if not layout else 4
    zero1 = ["optim.sharding=optim", "optim.overlap_param_gather=true", *layout]
    zero3 = ["optim.sharding=optim_grads_params", *layout]
    for kind, overrides in (("zero3", zero3), ("zero1", zero1)):
        for rank, out in enumerate(run_distributed(_record, world, experiment, overrides, kind == "zero3")):
            step1, step2 = out["steps"]
            if kind == "zero1":  # the optimizer step of step 1 gathers what step 2's forward reads
                events = step1 + step2
                gathers = _next_need(events, len(step1))
            else:  # ZeRO-3: what the forwards gather before the first backward
                events = step2
                gathers = _next_need(events, events.index(("backward",)))
            buckets = [b for b, _ in gathers]
            assert set(buckets) == set(range(out["buckets"])), (buckets, kind, rank)
            when = [need for _, need in gathers]
            assert None not in when and when == sorted(when), (
                f"{kind} rank {rank}: gathers of buckets {buckets} issued for the forwards at events {when}", events)
