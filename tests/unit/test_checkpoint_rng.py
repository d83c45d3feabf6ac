"""A checkpoint's RNG files: loaded without running pickled code, and portable between CPU and GPU runs."""

import json
import os
import random

import numpy as np
import pytest
import torch
import torch.distributed as dist

from megand.core.checkpointing import CheckpointConfig, Checkpointer, CheckpointError, files, offline, rng
from megand.core.checkpointing.checkpointer import write_torch
from megand.core.tensor_parallel import TensorParallelRNG
from megand.models import full
from megand.core.optimizer import Optimizer, OptimizerConfig
from megand.tools import convert_checkpoint

MODEL = dict(arch="gpt", num_layers=2, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4, num_query_groups=None,
             seq_length=16, vocab_size=51, norm="layernorm", activation="gelu", position_embedding="learned",
             rope_theta=10000.0, tie_embeddings=True, init_std=0.02, hidden_dropout=0.1, attention_dropout=0.1)
OPTIM = OptimizerConfig(lr=1e-3, min_lr=1e-4, warmup_iters=1, decay_iters=10)
RNG_FILE = os.path.join("iter_0000002", "rng", "rank_00000.pt")


@pytest.fixture(scope="module")
def topo():
    topo = offline.single_process_topology()
    yield topo
    dist.destroy_process_group()


def make(topo, save_dir):
    model = full.build_full_model(MODEL, topo=topo).train()
    named = list(model.named_parameters())
    opt = Optimizer(named, OPTIM, topo)
    return model, Checkpointer(CheckpointConfig(save=str(save_dir)), topo, named, opt, [model], "model: {}\n", dict(MODEL))


def replace_rng_file(save_dir, obj):
    """Write ``obj`` as rank 0's RNG file, with its checksum in the manifest (as a whole shared checkpoint
    made by someone else would be: consistent)."""
    path = os.path.join(save_dir, RNG_FILE)
    write_torch(obj, path)
    manifest = os.path.join(save_dir, "iter_0000002", files.MANIFEST)
    crcs = json.load(open(manifest))
    crcs["crc32"][os.path.join("rng", "rank_00000.pt")] = files.file_crc(path)
    json.dump(crcs, open(manifest, "w"))
    return path


class WritesAMarker:
    """Unpickling this object opens (creates) a file: what a crafted checkpoint would do, harmlessly."""

    marker = None

    def __reduce__(self):
        return open, (self.marker, "w")


def test_rng_file_holding_a_malicious_pickle_runs_nothing(topo, tmp_path):
    _, ckpt = make(topo, tmp_path / "ckpt")
    ckpt.save(2, 16)
    marker = tmp_path / "code_ran"
    WritesAMarker.marker = str(marker)
    path = replace_rng_file(tmp_path / "ckpt", {"format": rng.FORMAT, "payload": WritesAMarker()})
    with pytest.raises(CheckpointError) as e:
        ckpt.load(str(tmp_path / "ckpt"))
    assert not marker.exists()
    message = str(e.value)
    assert path in message and "refused" in message and "io.open" in message and "\n" not in message, message


def format1_state(rngs):
    """The RNG file an earlier megand wrote: Python's and numpy's state objects pickled as they are."""
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
            "tp": [r.state.clone() for r in rngs]}


def test_older_rng_file_is_refused_then_upgraded_by_the_converter(topo, tmp_path):
    model, ckpt = make(topo, tmp_path / "ckpt")
    ckpt.save(2, 16)
    random.seed(5)
    np.random.seed(6)
    old = format1_state(ckpt.rngs)
    expected = (random.random(), np.random.rand(), torch.rand(()))
    path = replace_rng_file(tmp_path / "ckpt", old)
    with pytest.raises(CheckpointError, match="upgrade-rng"):
        ckpt.load(str(tmp_path / "ckpt"))
    assert convert_checkpoint.main(["upgrade-rng", "--load", str(tmp_path / "ckpt")]) == 0
    assert rng.read(path)["device"] == "cpu"
    random.seed(0)
    np.random.seed(0)
    loaded = ckpt.load(str(tmp_path / "ckpt"))  # the manifest's checksum was rewritten too
    assert loaded.rng_restored
    assert (random.random(), np.random.rand(), torch.rand(())) == expected


def test_round_trip_restores_every_stream(topo, tmp_path):
    model, ckpt = make(topo, tmp_path / "ckpt")
    ckpt.save(2, 16)
    saved = rng.read(os.path.join(tmp_path / "ckpt", RNG_FILE))
    assert saved["device"] == "cpu"
    tp = ckpt.rngs[0]
    after = (random.random(), np.random.rand(), torch.rand(()), tp.state.clone())
    random.seed(1)
    np.random.seed(1)
    torch.manual_seed(1)
    tp.state = torch.Generator().manual_seed(1).get_state()
    loaded = ckpt.load(str(tmp_path / "ckpt"))
    assert loaded.rng_restored and loaded.rng_notice is None
    assert (random.random(), np.random.rand(), torch.rand(())) == after[:3]
    assert torch.equal(tp.state, after[3])


def cuda_generator_state(seed: int) -> torch.Tensor:
    """A CUDA (Philox) generator's state as torch.cuda.get_rng_state returns it: seed and offset, 16 bytes."""
    return torch.tensor([seed, 0], dtype=torch.int64).view(torch.uint8)


def test_checkpoint_from_a_gpu_resumes_on_the_cpu_with_reseeded_device_streams(topo, tmp_path):
    model, ckpt = make(topo, tmp_path / "ckpt")
    ckpt.save(2, 16)
    # what a GPU rank writes: its CUDA generator and a CUDA-generator tensor-parallel stream
    gpu_state = rng.capture([], torch.device("cpu"))
    gpu_state.update(device="cuda", cuda=cuda_generator_state(7), tp=[cuda_generator_state(9)])
    replace_rng_file(tmp_path / "ckpt", gpu_state)
    seeded = ckpt.rngs[0].state.clone()
    loaded = ckpt.load(str(tmp_path / "ckpt"))
    assert not loaded.rng_restored and "written on cuda, resumed on cpu" in loaded.rng_notice
    assert torch.equal(ckpt.rngs[0].state, seeded)  # the start-up seeding kept
    assert torch.equal(torch.get_rng_state(), gpu_state["torch"])  # the CPU generator restored
    with ckpt.rngs[0].fork():  # layer 0's dropout under the tensor-parallel stream runs
        torch.nn.functional.dropout(torch.ones(8), 0.5)


def test_checkpoint_from_the_cpu_never_puts_a_cpu_generator_state_into_a_cuda_generator(monkeypatch):
    """On a GPU: the CUDA runtime's RNG calls stand-ins that, like the real ones, take only a 16-byte state."""
    cuda_states = []

    def set_cuda_state(state, device=None):
        if state.numel() != 16:
            raise RuntimeError(f"RNG state is wrong size: {state.numel()} bytes")
        cuda_states.append(state)

    monkeypatch.setattr(torch.cuda, "set_rng_state", set_cuda_state)
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device=None: cuda_generator_state(3))
    cpu_stream = TensorParallelRNG(1234, 0, torch.device("cpu"))
    written_on_cpu = rng.capture([cpu_stream], torch.device("cpu"))
    gpu_stream = TensorParallelRNG.__new__(TensorParallelRNG)  # as built on cuda:0
    gpu_stream.device, gpu_stream.state = torch.device("cuda", 0), cuda_generator_state(5)
    notice = rng.restore(written_on_cpu, [gpu_stream], torch.device("cuda", 0))
    assert "written on cpu, resumed on cuda" in notice
    assert torch.equal(gpu_stream.state, cuda_generator_state(5)) and cuda_states == []
    # and on a GPU, a GPU's checkpoint restores the CUDA generator and the stream
    written_on_gpu = rng.capture([gpu_stream], torch.device("cuda", 0))
    gpu_stream.state = cuda_generator_state(6)
    assert rng.restore(written_on_gpu, [gpu_stream], torch.device("cuda", 0)) is None
    assert torch.equal(gpu_stream.state, cuda_generator_state(5)) and torch.equal(cuda_states[0], cuda_generator_state(3))
