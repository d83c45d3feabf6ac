"""Sharded checkpoints cost what this rank's shard costs: bf16 at dp=4 (ZeRO-1 and ZeRO-3), the peak of tensor
bytes during a save and during a load stays within 1.2x of the steady-state training peak; and the
shards saved at dp=4 load into any other layout and sharding level (tp=2 x dp=2 with vocab padding, ZeRO-3, one
plain process). Under ZeRO-3 nothing is gathered: each rank writes and reads its slices of the weights.

What is measured (per rank, CPU): the persistent state the engine and optimizer hold (parameter and
gradient buffers, fp32 main params and Adam moments: counted from those tensors), plus the peak of
bytes allocated by torch's CPU allocator and still live, during the phase, as the profiler's memory
tracking reports them (``profile_memory=True``: every allocation and free made inside the window,
whoever makes it: autograd, the optimizer, torch.distributed.checkpoint, ``torch.load``).
steady peak = persistent + peak of one training step; save/load peak = persistent + peak of the phase.
"""

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from megand.core.checkpointing.offline import load_full_tensors
from megand.tools.spawn import run_distributed
from tests.distributed.dp_helpers import build_trainer, step

# state dominates the activations, as in a real model: ~3.1M parameters, one sample per rank
MODEL = ["model.hidden_size=256", "model.ffn_hidden_size=704", "model.seq_length=32", "train.global_batch_size=4",
         "train.micro_batch_size=1", "train.precision=bf16", "optim.sharding=optim", "optim.bucket_size=200000"]


ZERO3 = "optim.sharding=optim_grads_params"


def peak_allocated_bytes(fn) -> int:
    """The peak of CPU bytes allocated inside ``fn`` and live at that moment."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    live = peak = 0
    for e in events:
        live += e.nbytes()  # negative for a free
        peak = max(peak, live)
    return peak


def weights(t):
    """The parameter values this rank holds: its slices of them under ZeRO-3, else the whole parameters."""
    return [data for _, _, _, data in t.ddp.param_shards()] if t.ddp.shard_params else [p.detach() for p in t.params]


def _worker(save_dir, overrides=()):
    t = build_trainer([*MODEL, *overrides, f"checkpoint.save={save_dir}"])
    for _ in range(2):  # warm up: allocations of the first steps are not steady state
        step(t)
    persistent = sum(t.nbytes for buf in t.ddp.buffers for t in (buf.param_data, buf.grad_data))
    persistent += sum(x.nbytes for x in t.optimizer.state_tensors())
    train = peak_allocated_bytes(lambda: step(t))
    gathered_before = dict(t.ddp.traffic)
    save = peak_allocated_bytes(t.save_checkpoint)
    before = [v.clone() for s in t.optimizer.sharded_state_dict() for v in s.tensors.values()]
    params = [w.clone() for w in weights(t)]
    with torch.no_grad():  # so the load has something to restore
        for s in t.optimizer.sharded_state_dict():
            for v in s.tensors.values():
                v.zero_()
        for w in weights(t):
            w.zero_()
    load = peak_allocated_bytes(lambda: t.checkpointer.load(save_dir))
    restored = all(torch.equal(a, b) for a, b in zip(
        before, [v for s in t.optimizer.sharded_state_dict() for v in s.tensors.values()])) and all(
        torch.equal(a, b) for a, b in zip(params, weights(t), strict=True))
    n = sum(p.numel() for p in t.params)
    shard_bytes = sum(v.nbytes for s in t.optimizer.sharded_state_dict() for v in s.tensors.values())
    # engine collectives during the save and the load (a ZeRO-3 gather would count here)
    moved = sum(t.ddp.traffic[k] - gathered_before[k] for k in gathered_before)
    return persistent, train, save, load, restored, shard_bytes / n, moved, n


def check_peaks(results, persistent_per_param):
    for rank, (persistent, train, save, load, restored, bytes_per_param, moved, n) in enumerate(results):
        steady = persistent + train
        report = (f"rank {rank}: persistent {persistent / 2**20:.1f} MiB, step +{train / 2**20:.1f}, "
                  f"save +{save / 2**20:.1f}, load +{load / 2**20:.1f} MiB; state dict {bytes_per_param:.2f} B/param")
        print(report)
        assert restored, report
        assert abs(bytes_per_param - 3.0) <= 0.3, report  # 12 / dp: this rank's shard, not the full state
        assert abs(persistent / n - persistent_per_param) <= 0.1 * persistent_per_param, report
        assert persistent + save <= 1.2 * steady, report
        assert persistent + load <= 1.2 * steady, report
        # nor a copy of the rank's share: a synchronous save writes views, a load reads in place
        assert max(save, load) < 0.1 * persistent, report
        assert moved == 0, report  # nothing gathered


@pytest.fixture(scope="module")
def saved_at_dp4(tmp_path_factory):
    save_dir = str(tmp_path_factory.mktemp("dp4"))
    return save_dir, run_distributed(_worker, 4, save_dir)


@pytest.mark.slow
def test_save_and_load_peaks_stay_near_the_training_peak_at_dp4(saved_at_dp4):
    _, results = saved_at_dp4
    check_peaks(results, 6 + 12 / 4)  # bf16 weights 2 + fp32 grads 4 whole, fp32 main and Adam 12 / dp


@pytest.fixture(scope="module")
def saved_zero3_at_dp4(tmp_path_factory):
    save_dir = str(tmp_path_factory.mktemp("zero3_dp4"))
    return save_dir, run_distributed(_worker, 4, save_dir, [ZERO3])


def test_zero3_save_and_load_peaks_stay_near_the_training_peak_at_dp4(saved_zero3_at_dp4):
    """ZeRO-3: each rank writes and reads its slices of the weights (never gathered) with its optimizer shard."""
    _, results = saved_zero3_at_dp4
    check_peaks(results, 18 / 4)  # everything sharded


def _load_worker(save_dir, overrides):
    """This rank's shards and weights after loading ``save_dir`` into the layout of ``overrides``."""
    t = build_trainer([*MODEL, *overrides, f"checkpoint.load={save_dir}"])
    # as numpy arrays: tensors would travel back through shared memory of a process that has exited
    shards = [(s.name, s.lo, s.hi, {k: v.numpy().copy() for k, v in s.tensors.items()})
              for s in t.optimizer.sharded_state_dict()]
    name_of = {p: n for n, p in t.named_params}
    ranges = t.ddp.param_shards() if t.ddp.shard_params else [(p, 0, p.numel(), p.detach().reshape(-1))
                                                               for p in t.params]
    weights = [(name_of[p], lo, hi, data.float().numpy().copy(), str(data.dtype)) for p, lo, hi, data in ranges]
    return shards, weights, {n: (tuple(p.shape), p.meta) for n, p in t.named_params}


def local_flat(full, name, shape, meta):
    """The flattened local (tp shard, padded) tensor of ``full[name]``: padding rows (vocab over tp) zero."""
    want = torch.zeros(shape)
    piece = full[name][meta.local_slice()]
    want[tuple(slice(0, n) for n in piece.shape)] = piece
    return want.reshape(-1)


@pytest.mark.parametrize("saved, overrides, nproc", [
    pytest.param("zero1", ["parallel.tp=2"], 4, marks=pytest.mark.slow), ("zero1", ["optim.sharding=none"], 1),
    ("zero1", ["parallel.tp=2", ZERO3], 4), ("zero3", ["optim.sharding=none"], 1)],
    ids=["zero1_to_tp2_dp2", "zero1_to_one_plain_process", "zero1_to_zero3_tp2_dp2", "zero3_to_one_plain_process"])
def test_shards_saved_at_dp4_load_into_another_layout(request, saved, overrides, nproc):
    save_dir, _ = request.getfixturevalue({"zero1": "saved_at_dp4", "zero3": "saved_zero3_at_dp4"}[saved])
    full = {k: v for k, v in load_full_tensors(save_dir, prefix="").items()}  # the reference, read in one process
    held = set()  # the weights some rank holds (a ZeRO-3 rank holds slices of only some parameters)
    for shards, weights, params in run_distributed(_load_worker, nproc, save_dir, overrides):
        for name, lo, hi, tensors in shards:
            shape, meta = params[name]
            assert set(tensors) == {"main", "exp_avg", "exp_avg_sq"}
            for kind, got in tensors.items():
                want = local_flat(full, f"optim.{name}.{kind}", shape, meta)[lo:hi]
                assert torch.equal(torch.from_numpy(got), want), (name, kind, lo, hi)
        for name, lo, hi, got, dtype in weights:  # the bf16 weights: the saved master weights, rounded
            assert dtype == "torch.bfloat16"
            shape, meta = params[name]
            want = local_flat(full, f"optim.{name}.main", shape, meta)[lo:hi].bfloat16().float()
            assert torch.equal(torch.from_numpy(got), want), (name, lo, hi)
        held |= {n for n, *_ in weights}
    assert held == set(params)
