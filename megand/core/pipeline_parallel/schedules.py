"""Forward/backward schedules over the micro-batches of one step.

A schedule calls ``forward_step(chunk, microbatch, hidden)``, which returns the chunk's output: hidden
states, or on the last stage the micro-batch's loss already divided by the global batch's token count
(so summing micro-batches and data-parallel replicas gives the global mean). It returns the summed
loss (detached) on the last stage, ``None`` elsewhere.
"""

import torch


def forward_backward_no_pipelining(chunks, microbatches, forward_step, topo, forward_only=False):
    """Gradient accumulation: forward and backward of each micro-batch in turn (pp == 1)."""
    (model,) = chunks
    total = torch.zeros((), dtype=torch.float32, device=topo.device)
    for microbatch in microbatches:
        loss = forward_step(model, microbatch, None)
        if not forward_only:
            loss.backward()
        total += loss.detach().float()
    return total


def get_schedule(topo):
    if topo.pp_size == 1:
        return forward_backward_no_pipelining
    raise NotImplementedError("pipeline parallelism is not built yet")
