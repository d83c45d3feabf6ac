"""Forward/backward schedules over the micro-batches of one step.

A schedule calls ``forward_step(chunk, microbatch, hidden)``, which returns the chunk's output: hidden
states, or on the last stage the micro-batch's loss already divided by the global batch's token count
(so summing micro-batches and data-parallel replicas gives the global mean). It returns the summed
loss (detached) on the last stage, ``None`` elsewhere.

``grad_sync`` (the data-parallel engine, or None) must see the last backward of the step for each chunk
run inside ``last_backward(grad_sync)``: see megand/core/distributed/data_parallel.py.
"""

import torch

from megand.core.distributed import last_backward


def forward_backward_no_pipelining(chunks, microbatches, forward_step, topo, forward_only=False, grad_sync=None):
    """Gradient accumulation: forward and backward of each micro-batch in turn (pp == 1)."""
    (model,) = chunks
    total = torch.zeros((), dtype=torch.float32, device=topo.device)
    for i, microbatch in enumerate(microbatches):
        loss = forward_step(model, microbatch, None)
        if not forward_only:
            if i == len(microbatches) - 1:
                with last_backward(grad_sync):
                    loss.backward()
            else:
                loss.backward()
        total += loss.detach().float()
    return total


def get_schedule(topo):
    if topo.pp_size == 1:
        return forward_backward_no_pipelining
    raise NotImplementedError("pipeline parallelism is not built yet")
