"""Checkpoint save/load in one process: atomic layout, round trip, and every bad load failing up front
with a message that names the file or tensor."""

import os

import pytest
import torch
import torch.distributed as dist

from megand.core.checkpointing import CheckpointConfig, Checkpointer, CheckpointError, offline
from megand.core.checkpointing.sharded import unpadded
from megand.models import full
from megand.core.optimizer import Optimizer, OptimizerConfig

MODEL = dict(arch="gpt", num_layers=2, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4, num_query_groups=None,
             seq_length=16, vocab_size=51, norm="layernorm", activation="gelu", position_embedding="learned",
             rope_theta=10000.0, tie_embeddings=True, init_std=0.02, hidden_dropout=0.0, attention_dropout=0.0)
OPTIM = OptimizerConfig(lr=1e-3, min_lr=1e-4, warmup_iters=1, decay_iters=10)


@pytest.fixture(scope="module")
def topo():
    topo = offline.single_process_topology()
    yield topo
    dist.destroy_process_group()


def make(topo, save_dir, model_cfg=MODEL, steps=2):
    """A trained-for-``steps`` model with its optimizer and checkpointer."""
    model = full.build_full_model(model_cfg, topo=topo).train()
    named = list(model.named_parameters())
    opt = Optimizer(named, OPTIM, topo)
    ids = torch.randint(0, model_cfg["vocab_size"], (2, model_cfg["seq_length"] + 1), generator=torch.Generator().manual_seed(0))
    for _ in range(steps):
        opt.zero_grad()
        model(input_ids=ids[:, :-1], labels=ids[:, 1:]).mean().backward()
        opt.step()
    return model, opt, Checkpointer(CheckpointConfig(save=str(save_dir)), topo, named, opt, [model], "model: {}\n", dict(model_cfg))


def test_round_trip_and_atomic_layout(topo, tmp_path):
    model, opt, ckpt = make(topo, tmp_path)
    ckpt.save(2, 16)
    assert open(tmp_path / "latest").read().strip() == "2"
    assert not [n for n in os.listdir(tmp_path) if n.endswith(".tmp")]
    files = set(os.listdir(tmp_path / "iter_0000002"))
    assert {".metadata", "common.pt", "config.yaml", "manifest.json", "rng"} <= files
    fresh, fresh_opt, fresh_ckpt = make(topo, tmp_path, steps=0)
    loaded = fresh_ckpt.load(str(tmp_path))
    assert (loaded.iteration, loaded.consumed_samples, loaded.optimizer_loaded) == (2, 16, True)
    for (name, a), (_, b) in zip(model.named_parameters(), fresh.named_parameters()):
        assert torch.equal(a, b), name
    assert fresh_opt.steps == opt.steps == 2
    for a, b in zip(opt.sharded_state_dict(), fresh_opt.sharded_state_dict(), strict=True):
        assert (a.name, a.lo, a.hi) == (b.name, b.lo, b.hi) and a.tensors.keys() == b.tensors.keys()
        for kind, t in a.tensors.items():
            assert torch.equal(t, b.tensors[kind]), (a.name, kind)
    # a save of a later iteration replaces `latest`; the earlier one stays loadable
    ckpt.save(3, 24)
    assert open(tmp_path / "latest").read().strip() == "3"
    assert fresh_ckpt.load(str(tmp_path / "iter_0000002")).iteration == 2


def expect_error(ckpt, path, *fragments):
    with pytest.raises(CheckpointError) as e:
        ckpt.load(str(path))
    for fragment in fragments:
        assert fragment in str(e.value), (fragment, str(e.value))


def test_bad_loads_fail_with_a_named_problem(topo, tmp_path):
    _, _, ckpt = make(topo, tmp_path / "ok")
    ckpt.save(2, 16)
    good = tmp_path / "ok" / "iter_0000002"
    _, _, loader = make(topo, tmp_path / "unused", steps=0)

    expect_error(loader, tmp_path / "nowhere", "no such directory")
    # a save that never finished: the .tmp dir, or a dir without metadata
    partial = tmp_path / "partial"
    os.makedirs(partial / "iter_0000004.tmp")
    expect_error(loader, partial / "iter_0000004.tmp", "partial checkpoint")
    expect_error(loader, partial, "not a complete checkpoint", "iter_0000004.tmp")
    # `latest` naming a missing iteration
    (partial / "latest").write_text("4\n")
    expect_error(loader, partial, "iteration 4", "does not exist")

    def damaged(name, how):
        import shutil

        bad = tmp_path / name
        shutil.copytree(good, bad)
        how(bad)
        return bad

    def garbage_metadata(d):
        (d / ".metadata").write_bytes(b"not a pickle")

    def truncate_data(d):
        f = d / "__0_0.distcp"
        f.write_bytes(f.read_bytes()[:100])

    def flip_bytes(d):
        f = d / "__0_0.distcp"
        data = bytearray(f.read_bytes())
        data[len(data) // 2] ^= 0xFF
        f.write_bytes(bytes(data))

    expect_error(loader, damaged("meta", garbage_metadata), ".metadata", "corrupted")
    expect_error(loader, damaged("trunc", truncate_data), "__0_0.distcp", "truncated")
    expect_error(loader, damaged("flip", flip_bytes), "__0_0.distcp", "checksum")
    expect_error(loader, damaged("nocommon", lambda d: os.remove(d / "common.pt")), "common.pt", "missing")
    # a different model shape: named tensor, expected vs found
    _, _, wide = make(topo, tmp_path / "unused2", dict(MODEL, ffn_hidden_size=96), steps=0)
    expect_error(wide, good, "layers.0.mlp.fc1.weight", "expected shape (96, 32)", "checkpoint has (64, 32)")
    _, _, deep = make(topo, tmp_path / "unused3", dict(MODEL, num_layers=3), steps=0)
    expect_error(deep, good, "layers.2.", "missing")


def test_model_only_checkpoint_loads_without_optimizer(topo, tmp_path):
    model, _, _ = make(topo, tmp_path / "a")
    tensors = {n: unpadded(p.detach(), p.meta).clone() for n, p in model.named_parameters()}  # full tensors
    offline.save_full_model(str(tmp_path / "full"), tensors, "model: {}\n", dict(MODEL))
    fresh, fresh_opt, loader = make(topo, tmp_path / "b", steps=0)
    loaded = loader.load(str(tmp_path / "full"))
    assert (loaded.iteration, loaded.optimizer_loaded) == (0, False)
    assert all(torch.equal(unpadded(p, p.meta), tensors[n]) for n, p in fresh.named_parameters())
    back = offline.load_full_tensors(str(tmp_path / "full"))
    assert back.keys() == tensors.keys() and all(torch.equal(back[k], tensors[k]) for k in back)


def _loss(model, ids):
    with torch.no_grad():
        return model(input_ids=ids[:, :-1], labels=ids[:, 1:]).float().mean().item()


def test_model_only_checkpoint_continues_in_bf16_from_the_loaded_weights(topo, tmp_path):
    """The fp32 master copy of bf16 parameters must come from the loaded weights, not the random init."""
    ids = torch.randint(0, MODEL["vocab_size"], (2, MODEL["seq_length"] + 1), generator=torch.Generator().manual_seed(0))
    trained = full.build_full_model(MODEL, topo=topo).train()
    opt = Optimizer(list(trained.named_parameters()), OptimizerConfig(lr=1e-2, warmup_iters=0, schedule="constant"), topo)
    for _ in range(20):  # overfit one batch: the loaded model's loss is far below the untrained one
        opt.zero_grad()
        trained(input_ids=ids[:, :-1], labels=ids[:, 1:]).mean().backward()
        opt.step()
    tensors = {n: unpadded(p.detach(), p.meta).clone() for n, p in trained.named_parameters()}  # full tensors
    offline.save_full_model(str(tmp_path / "full"), tensors, "model: {}\n", dict(MODEL))

    bf16 = dict(MODEL, precision="bf16")
    model = full.build_full_model(bf16, topo=topo).train()
    untrained = _loss(model, ids)
    named = list(model.named_parameters())
    opt = Optimizer(named, OptimizerConfig(lr=1e-5, warmup_iters=0, schedule="constant"), topo)
    Checkpointer(CheckpointConfig(), topo, named, opt, [model], "model: {}\n", dict(bf16)).load(str(tmp_path / "full"))
    loaded = _loss(model, ids)
    assert loaded < untrained - 1.0, (loaded, untrained)
    opt.zero_grad()
    model(input_ids=ids[:, :-1], labels=ids[:, 1:]).float().mean().backward()
    assert not opt.step().skipped
    after = _loss(model, ids)
    assert abs(after - loaded) < 0.05, f"after one step at lr 1e-5: {after}, loaded {loaded}, untrained {untrained}"
    for name, p in named:  # one tiny step away from the loaded weights (bf16 rounding), not from the init
        torch.testing.assert_close(unpadded(p, p.meta).float(), tensors[name], rtol=2 ** -7, atol=1e-4, msg=name)


def test_fp32_run_resumed_from_bf16_takes_the_fp32_master_weights(topo, tmp_path):
    bf16 = dict(MODEL, precision="bf16")
    _, opt, ckpt = make(topo, tmp_path, bf16)
    ckpt.save(2, 16)
    masters = {s.name: s.tensors["main"].clone() for s in opt.sharded_state_dict()}
    fresh, fresh_opt, loader = make(topo, tmp_path / "unused", steps=0)
    assert loader.load(str(tmp_path)).optimizer_loaded
    for name, p in fresh.named_parameters():
        assert p.dtype == torch.float32 and torch.equal(p.reshape(-1), masters[name]), name  # not the bf16 rounding
    assert fresh_opt.steps == 2
