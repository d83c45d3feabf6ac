"""Initialisation by tiles: each rank draws only the tiles of the full tensor its shard overlaps, and
every layout gets the same values. Ranks are played one at a time on torch's fake process group."""

import contextlib

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from megand.core.parallel_state import init_fake_distributed
from megand.core.sharding import ParamMeta, draw_region, full_init
from megand.training.config import compose
from megand.training.core_configs import core_configs
from megand.training.pretrain import build_model_and_engine, build_topology


@contextlib.contextmanager
def fake_rank(rank, world_size):
    device = init_fake_distributed(rank, world_size)
    try:
        yield device
    finally:
        dist.destroy_process_group()


def build_rank(overrides, rank, world_size):
    cfg = compose(["+experiment=tiny_llama", "run_dir=/tmp/unused", *overrides])
    with fake_rank(rank, world_size) as device:
        configs = core_configs(cfg, device, world_size)
        topo = build_topology(configs, device)
        chunks, ddp = build_model_and_engine(configs, topo)
    return chunks, ddp


@pytest.mark.parametrize("shape", [(600, 300), (1000, 257), (70000,)])
def test_every_tp_slice_is_the_slice_of_the_full_tensor(shape):
    full = full_init(ParamMeta(shape), 7, "w")
    assert abs(full.std().item() - 0.02) < 2e-3
    for split_dim in range(len(shape)):
        for tp in (2, 3, 8):
            for rank in range(tp):
                meta = ParamMeta(shape, split_dim, rank, tp)
                region = meta.local_slice()
                out = torch.empty(full[region].shape)
                draw_region(meta, 7, "w", region, out)
                assert torch.equal(out, full[region]), (split_dim, tp, rank)


def test_tiles_differ_by_name_and_seed():
    meta = ParamMeta((300, 300))
    a = full_init(meta, 1, "a")
    assert not torch.equal(a, full_init(meta, 1, "b"))
    assert not torch.equal(a, full_init(meta, 2, "a"))
    assert not torch.equal(a[:256, :256], a[:256, 256:].reshape(-1)[:1].expand(256, 256))  # tiles are not copies


WIDE = ["model.hidden_size=1024", "model.ffn_hidden_size=2048", "model.num_attention_heads=8",
        "model.num_query_groups=8", "model.vocab_size=1024", "model.num_layers=2"]


def test_a_tp_rank_draws_only_its_shard(monkeypatch):
    """At tp=4, rank 0 draws exactly its quarter of every sharded matrix (dimensions are multiples of the
    tile), not the full tensors."""
    drawn = []
    original = torch.Tensor.normal_

    def counting_normal_(self, *args, **kwargs):
        drawn.append(self.numel())
        return original(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "normal_", counting_normal_)
    chunks, _ = build_rank([*WIDE, "parallel.tp=4"], rank=0, world_size=4)
    local_random = sum(p.numel() for c in chunks for p in c.parameters() if p.meta.init == "normal")
    full_random = sum(torch.Size(p.meta.full_shape).numel() for c in chunks for p in c.parameters()
                      if p.meta.init == "normal")
    assert local_random * 4 == full_random
    assert sum(drawn) == local_random, f"rank 0 of tp=4 drew {sum(drawn)} elements, its shard holds {local_random}"


def test_shards_equal_the_one_process_model_and_live_in_the_engine_buffers():
    chunks, _ = build_rank(["train.precision=bf16"], rank=0, world_size=1)
    full = {n: p.detach().clone() for c in chunks for n, p in c.named_parameters()}
    for rank in range(2):
        chunks, ddp = build_rank(["train.precision=bf16", "parallel.tp=2"], rank=rank, world_size=2)
        (buf,) = ddp.buffers
        lo, hi = buf.param_data.data_ptr(), buf.param_data.data_ptr() + buf.param_data.nbytes
        for name, p in chunks[0].named_parameters():
            assert not p.is_meta and p.dtype == torch.bfloat16 and hasattr(p, "meta")
            assert lo <= p.data_ptr() < hi, f"{name} is not a view into the engine's buffer"
            region = p.meta.local_slice()
            expected = full[name][region]
            assert torch.equal(p[tuple(slice(0, n) for n in expected.shape)], expected), (rank, name)


class _DeviceCopies(TorchDispatchMode):
    """Counts copies from the host into a tensor that is not on the host."""

    def __init__(self):
        super().__init__()
        self.copies = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.copy_.default and args[0].device.type != "cpu" and args[1].device.type == "cpu":
            self.copies += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("shape, region, bands", [
    ((1024, 1000), (slice(0, 1024), slice(0, 1000)), 4),  # 16 tiles in 4 rows of tiles
    ((1024, 1000), (slice(300, 700), slice(None)), 2),  # rows 256-511 and 512-767 of tiles
    ((4, 512, 300), (slice(0, 2), slice(None), slice(None)), 4),  # experts: 2 x 2 rows of tiles
    ((70000,), (slice(None),), 1),
])
def test_a_device_shard_is_copied_once_per_row_of_tiles(shape, region, bands):
    """Drawing into a device tensor (meta here: any device other than the host) copies each row of tiles
    in one piece, not each tile; drawn through the host staging on the CPU, the values are bit-identical."""
    meta = ParamMeta(shape)
    out = torch.empty(full_init(meta, 3, "w")[region].shape, device="meta")
    with _DeviceCopies() as copies:
        draw_region(meta, 3, "w", region, out)
    assert copies.copies == bands
    staged = torch.empty(out.shape)
    draw_region(meta, 3, "w", region, staged, staged=True)
    assert torch.equal(staged, full_init(meta, 3, "w")[region])
