"""Model-parallel RNG: a second random stream for regions whose values differ across tensor-parallel ranks.

Dropout on activations that are replicated across tp (hidden states and the embedding output without
sequence parallelism) must draw the same mask on every tp rank: it uses the default generator, seeded
alike on all tp ranks. Dropout on activations that are sharded across tp (attention heads, sequence
shards under sequence parallelism) must draw different masks: it runs inside
:meth:`TensorParallelRNG.fork`, a stream seeded per tp rank.

Both streams also differ across pipeline stages (other layers), context-parallel ranks (other tokens)
and data-parallel replicas (other samples): :func:`seed_random_streams` seeds them as Megatron does
(default ``seed + 100 * pp_rank``, tensor-parallel ``that + 2718 + tp_rank``), with the cp and dp
coordinates folded into the stage index so that no two ranks share a stream they should not.
"""

from contextlib import contextmanager

import torch
import torch.utils.checkpoint


def _get_state(device):
    return torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()


def _set_state(state, device):
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)


TP_OFFSET = 2718  # Megatron's offset of the tensor-parallel stream from the default one


def default_seed(seed: int, topo) -> int:
    """The default generator's seed on this rank: equal on tp peers, different for every (pp, cp, dp).

    ``seed + 100 * pp_rank`` when cp = dp = 1 (Megatron's rule); otherwise the stage index runs over
    (pp, cp, dp) in mixed radix, so distinct coordinates never share a seed. The tensor-parallel seeds
    ``default_seed + 2718 + tp_rank`` never meet another rank's default seed while tp < 82."""
    index = topo.pp_rank + topo.pp_size * (topo.cp_rank + topo.cp_size * topo.dp_rank)
    return seed + 100 * index


class TensorParallelRNG:
    """The tp-rank-specific random stream, swapped into the device's default generator on demand.

    ``seed`` is this rank's default seed (:func:`default_seed`); the stream is seeded with
    ``seed + 2718 + tp_rank``. Building it leaves every global generator untouched."""

    def __init__(self, seed: int, tp_rank: int, device: torch.device):
        self.device = device
        stream_device = device if device.type == "cuda" else torch.device("cpu")  # meta-built models too
        self.state = torch.Generator(device=stream_device).manual_seed(seed + TP_OFFSET + tp_rank).get_state()

    @contextmanager
    def fork(self):
        saved = _get_state(self.device)
        _set_state(self.state, self.device)
        try:
            yield
        finally:
            self.state = _get_state(self.device)
            _set_state(saved, self.device)


def seed_random_streams(seed: int, topo) -> TensorParallelRNG:
    """Seed this rank's default generator (every device) and return its tensor-parallel stream."""
    rank_seed = default_seed(seed, topo)
    torch.manual_seed(rank_seed)
    return TensorParallelRNG(rank_seed, topo.tp_rank, topo.device)


def checkpoint(fn, *args, rng: TensorParallelRNG | None = None):
    """Activation recompute that also replays the tensor-parallel stream, so recomputed dropout masks
    equal the original ones (torch's checkpoint only replays the default generator). torch.compile cannot
    trace its ``context_fn``: a compiled caller calls it through ``torch.compiler.disable`` (see
    ``keep_eager`` of the attention blocks)."""
    if rng is None:
        return torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False)
    stash = {}

    @contextmanager
    def on_forward():
        stash["state"] = rng.state
        yield

    @contextmanager
    def on_recompute():
        current, rng.state = rng.state, stash["state"]
        try:
            yield
        finally:
            rng.state = current

    return torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False, context_fn=lambda: (on_forward(), on_recompute()))
