"""Expert tensors are pieces of the whole [E, ...] tensor: dim 0 split over ep, another dim over etp."""

import torch

from megand.core.sharding import ParamMeta, full_init, init_parameters, tag


def test_expert_slice_combines_ep_on_dim0_and_tp_on_its_dim():
    full = (8, 6, 4)
    meta = ParamMeta(full, 1, tp_rank=1, tp_size=2, expert=True, ep_rank=3, ep_size=4)
    assert meta.local_slice() == (slice(6, 8), slice(3, 6), slice(None))
    whole = ParamMeta(full, None, expert=True, ep_rank=1, ep_size=2)
    assert whole.local_slice() == (slice(4, 8), slice(None), slice(None))


def test_every_ep_tp_piece_initialises_to_its_slice_of_the_full_tensor():
    full = (4, 6, 4)
    for ep in (1, 2, 4):
        for tp in (1, 2):
            for er in range(ep):
                for tr in range(tp):
                    meta = ParamMeta(full, 1, tr, tp, expert=True, ep_rank=er, ep_size=ep)
                    m = torch.nn.Module()
                    m.register_parameter("weight", tag(torch.nn.Parameter(torch.empty(4 // ep, 6 // tp, 4)), meta))
                    init_parameters(torch.nn.ModuleDict({"fc1": m}), seed=5)  # named "fc1.weight"
                    expected = full_init(ParamMeta(full), seed=5, name="fc1.weight")[meta.local_slice()]
                    assert torch.equal(m.weight.detach(), expected), (ep, tp, er, tr)
