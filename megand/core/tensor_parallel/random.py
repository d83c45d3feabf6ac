"""Model-parallel RNG: a second random stream for regions whose values differ across tensor-parallel ranks.

Dropout on activations that are replicated across tp (hidden states without sequence parallelism) must
draw the same mask on every tp rank: it uses the default generator, seeded alike on all tp ranks.
Dropout on activations that are sharded across tp (attention heads, sequence shards) must draw
different masks: it runs inside :meth:`TensorParallelRNG.fork`, a stream seeded per tp rank.
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


def seed_default_generator(seed: int, pp_rank: int, cp_rank: int) -> None:
    # Same on tp and dp peers (their replicated activations must see the same dropout masks),
    # different across pipeline stages and context shards, which hold different layers/tokens.
    torch.manual_seed(seed + 100 * pp_rank + 10 * cp_rank)


class TensorParallelRNG:
    """The tp-rank-specific random stream, swapped into the device's default generator on demand."""

    def __init__(self, seed: int, tp_rank: int, device: torch.device):
        self.device = device
        saved = _get_state(device)
        torch.manual_seed(seed + 2718 + tp_rank)
        self.state = _get_state(device)
        _set_state(saved, device)

    @contextmanager
    def fork(self):
        saved = _get_state(self.device)
        _set_state(self.state, self.device)
        try:
            yield
        finally:
            self.state = _get_state(self.device)
            _set_state(saved, self.device)


def checkpoint(fn, *args, rng: TensorParallelRNG | None = None):
    """Activation recompute that also replays the tensor-parallel stream, so recomputed dropout masks
    equal the original ones (torch's checkpoint only replays the default generator)."""
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
