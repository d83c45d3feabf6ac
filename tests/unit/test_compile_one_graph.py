"""``train.compile=true`` compiles one graph that every transformer layer runs: nothing per layer (a GEMM
policy's identity, a layer index) is baked into the compiled code as a guarded constant, which made each
layer recompile until torch's recompile limit (8) left the rest of the layers eager; nor the first layer's
input strides (a micro-batch of one left the embedding's output with its transposed strides: two graphs)."""

import pytest
import torch
import torch.distributed as dist

from megand.training.config import compose

DIST_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")


@pytest.fixture
def one_process_world(tmp_path, monkeypatch):
    for name in DIST_ENV:  # init_distributed sets these for a one-process world: restore them afterwards
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    yield tmp_path
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.mark.parametrize("micro_batch_size", [2, 1])
def test_sixteen_layers_compile_one_graph(one_process_world, micro_batch_size):
    from torch._dynamo.utils import counters

    from megand.training.pretrain import Trainer

    torch._dynamo.reset()
    counters.clear()
    cfg = compose(["model=llama_tiny", "model.num_layers=16", "model.hidden_size=16", "model.ffn_hidden_size=32",
                   "model.num_attention_heads=2", "model.num_query_groups=1", "model.vocab_size=64",
                   "model.seq_length=8", "train.iters=1", "train.global_batch_size=2",
                   f"train.micro_batch_size={micro_batch_size}",
                   "train.eval_iters=0", "train.compile=true", f"run_dir={one_process_world / 'run'}"])
    trainer = Trainer(cfg)
    try:
        trainer.run()
    finally:
        trainer.close()
    assert trainer.iteration == 1
    # one frame compiled (the layer's forward, then its backward), reused by the 16 layers
    assert (counters["frames"]["ok"], counters["stats"]["unique_graphs"]) == (1, 1), \
        (dict(counters["frames"]), dict(counters["stats"]))
