"""Gemma 4's attention shapes reproduce the one-process run at every layout, per tensor: full layers with a head
width (32) and one key/value head of their own (replicated over the tp ranks whose queries use it), their keys
as values, and the last two layers attending over the keys and values of layers 3 and 2 (whose gradients then
gather both layers' contributions), those two with an MLP twice as wide. AdamW's first moment after step 1, ``(1 - beta1) g``, from the checkpoints,
within the protocol's 5e-6, and the step's loss and grad norm within 1e-5 (tests/harness.py)."""

import pytest

from megand.core.checkpointing.offline import load_full_tensors
from tests.harness import assert_parity, read_metrics, run_pretrain

MODEL = ("model.num_layers=6", "model.sliding_window=[8,8,null,8,8,null]", "model.global_head_dim=32",
         "model.num_global_query_groups=1", "model.global_k_eq_v=true", "model.num_kv_shared_layers=2",
         "model.double_wide_mlp=true", "model.qk_norm=true", "model.v_norm=true", "model.rope_local_theta=1000.0")
CASES = {  # name: (processes, run overrides); the sources (layers 2, 3) beside their readers (4, 5)
    "tp2_sp": (2, ("parallel.tp=2", "parallel.sequence_parallel=true")),
    "tp4": (4, ("parallel.tp=4",)),
    "tp2_pp2": (4, ("parallel.tp=2", "parallel.pp=2", "parallel.pipeline_layout=[2,4]")),
    "pp2_vpp2": (2, ("parallel.pp=2", "parallel.vpp=2", "parallel.pipeline_layout=[1,1,0,4]")),
    "cp2": (2, ("parallel.cp=2",)),
    "tp2_recompute_full_zero3": (2, ("parallel.tp=2", "train.recompute=full", "optim.sharding=optim_grads_params")),
    "dp2_recompute_selective": (2, ("train.recompute=selective",)),
}
DEFAULT = {"tp2_sp"}


def _moments_after_one_step(run_dir, nproc, overrides):
    save = str(run_dir / "ckpt")
    run_pretrain(run_dir, ["+experiment=tiny_llama", "train.iters=1", "train.eval_iters=0", f"checkpoint.save={save}",
                           *MODEL, *overrides], nproc=nproc, reference=nproc == 1)
    return load_full_tensors(save, prefix="optim.")


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("gemma4_attention_one")
    return run_dir, _moments_after_one_step(run_dir, 1, ())


@pytest.mark.parametrize("name", [pytest.param(n, marks=() if n in DEFAULT else pytest.mark.slow) for n in CASES])
def test_matches_one_process_per_tensor(one_process, tmp_path, name):
    ref_dir, ref = one_process
    nproc, overrides = CASES[name]
    run = _moments_after_one_step(tmp_path, nproc, overrides)
    moments = sorted(k for k in ref if k.endswith(".exp_avg"))
    assert "layers.5.attention.qkv.weight.exp_avg" in moments and "layers.5.attention.k_norm.weight.exp_avg" not in moments
    assert sorted(k for k in run if k.endswith(".exp_avg")) == moments
    for key in moments:
        diff = (run[key] - ref[key]).norm() / ref[key].norm().clamp_min(1e-30)
        assert diff <= 5e-6, f"{key}: relative difference {diff:.2e}"
    assert_parity(read_metrics(ref_dir), read_metrics(tmp_path), steps=1)
