"""Fewer key/value heads than tensor-parallel ranks (multi-query attention): each key/value head is replicated
over the tp ranks whose query heads use it, its gradient summed over exactly those ranks, counted once in the
grad norm and written once to checkpoints, which load at any other tp. Every layout equals the one-process run
(tests/harness.py tolerances), per tensor too: AdamW's first moment after step 1, ``(1 - beta1) g``, from the
checkpoints, within the protocol's 5e-6."""

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader

from megand.core.checkpointing.files import resolve
from megand.core.checkpointing.offline import load_full_tensors
from tests.harness import assert_parity, read_metrics, run_pretrain

MQA = ("model.num_query_groups=1",)  # tiny_llama: 4 query heads
TP2_SP = ("parallel.tp=2", "parallel.sequence_parallel=true")
CASES = {  # name: (processes, model overrides, run overrides)
    "mqa_tp2_sp": (2, MQA, TP2_SP),
    "mqa_tp4": (4, MQA, ("parallel.tp=4",)),
    "groups2_tp4_sp": (4, ("model.num_query_groups=2",), ("parallel.tp=4", "parallel.sequence_parallel=true")),
    "mqa_qkv_bias_qk_norm_tp2": (2, (*MQA, "model.qkv_bias=true", "model.qk_norm=true"), ("parallel.tp=2",)),
    "mqa_tp2_cp2": (4, MQA, ("parallel.tp=2", "parallel.cp=2")),
    "mqa_tp2_pp2_zero3": (4, MQA, ("parallel.tp=2", "parallel.pp=2", "optim.sharding=optim_grads_params")),
    "mqa_tp2_dp2_zero2": (4, MQA, ("parallel.tp=2", "optim.sharding=optim_grads")),
}
DEFAULT = {"mqa_tp2_sp"}  # tp=4 in the default run: the ten steps and resume below


def _moments_after_one_step(run_dir, nproc, overrides):
    save = str(run_dir / "ckpt")
    run_pretrain(run_dir, ["+experiment=tiny_llama", "train.iters=1", "train.eval_iters=0", f"checkpoint.save={save}",
                           *overrides], nproc=nproc, reference=nproc == 1)
    return save, load_full_tensors(save, prefix="optim.")


def _chunk_elements(save, key):
    """Elements of the full tensor ``key`` over every chunk the checkpoint holds of it."""
    meta = FileSystemReader(resolve(save)).read_metadata().state_dict_metadata[key]
    return sum(torch.Size(c.sizes).numel() for c in meta.chunks)


@pytest.mark.parametrize("name", [pytest.param(n, marks=() if n in DEFAULT else pytest.mark.slow) for n in CASES])
def test_shared_kv_heads_match_one_process_per_tensor(tmp_path, name):
    nproc, model, overrides = CASES[name]
    _, ref = _moments_after_one_step(tmp_path / "one", 1, model)
    save, run = _moments_after_one_step(tmp_path / name, nproc, (*model, *overrides))
    moments = sorted(k for k in ref if k.endswith(".exp_avg"))
    assert any(".qkv.weight." in k for k in moments) and sorted(k for k in run if k.endswith(".exp_avg")) == moments
    for key in moments:
        diff = (run[key] - ref[key]).norm() / ref[key].norm().clamp_min(1e-30)
        assert diff <= 5e-6, f"{key}: relative difference {diff:.2e}"
    qkv = next(k for k in moments if ".qkv.weight." in k).removesuffix(".exp_avg")
    for key in (f"model.{qkv}", f"optim.{qkv}.exp_avg"):  # the replicated key/value rows written once
        assert _chunk_elements(save, key) == ref[f"{qkv}.exp_avg"].numel(), key
    assert_parity(read_metrics(tmp_path / "one"), read_metrics(tmp_path / name), steps=1)


def test_shared_kv_heads_ten_steps_and_resume_at_other_tp(reference, tmp_path):
    """Ten steps at tp=2 equal one process (the grad norm counts each key/value head once); a checkpoint of
    step 5 at tp=4 resumes at tp=2 x dp=2 (the replicated rows read by every replica), still equal."""
    ref = reference("tiny_llama", *MQA)
    save = str(tmp_path / "ckpt")
    common = ["+experiment=tiny_llama", *MQA, f"checkpoint.save={save}", "train.eval_iters=0"]
    run_pretrain(tmp_path / "run", [*common, "parallel.tp=4", "train.exit_interval=5"], nproc=4)
    run_pretrain(tmp_path / "run", [*common, "parallel.tp=2", f"checkpoint.load={save}"], nproc=4)
    assert_parity(ref, read_metrics(tmp_path / "run"))
