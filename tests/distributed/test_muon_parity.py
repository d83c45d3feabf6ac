"""Muon layouts equal the one-process Muon run (fp32, tests/harness.py tolerances): every matrix split over
tp or over the ZeRO/HSDP shard group is orthogonalised whole, by one owner rank, so the layout changes where
the work is done, never the arithmetic. Also a resume at another layout (its momentum resharded), and
multi-token prediction at pp > 1, whose last stage holds a copy of the word embedding: AdamW's, as the
original's."""

import pytest

from tests.harness import assert_parity, read_metrics, run_pretrain

MUON = ("optim.name=muon", "optim.lr=0.02", "optim.bucket_size=4000")  # small buckets: pieces split matrices
ZERO3 = "optim.sharding=optim_grads_params"
TP2_SP = ("parallel.tp=2", "parallel.sequence_parallel=true")
MOE = ("model=moe_tiny", "train.global_batch_size=4")
MTP = ("model.mtp_layers=2",)

CASES = {  # name: (processes, reference overrides, run overrides)
    "tp2_sp_dp2_zero3": (4, (), (*TP2_SP, ZERO3)),
    "tp2_sp": (2, (), TP2_SP),
    "pp2": (2, (), ("parallel.pp=2",)),
    "pp2_vpp2": (2, (), ("parallel.pp=2", "parallel.vpp=2")),
    "dp2_none": (2, (), ("optim.sharding=none",)),
    "dp2_zero1": (2, (), ("optim.sharding=optim",)),
    "dp2_zero2": (2, (), ("optim.sharding=optim_grads", "optim.overlap_grad_reduce=true")),
    "dp2_zero3": (2, (), (ZERO3,)),
    "hsdp_dp4_shard2": (4, (), (ZERO3, "parallel.dp_shard=2")),
    # experts [E, f, h] per expert, split over ep; one micro-batch per rank (the balancing losses' batches)
    "moe_ep2_dp2": (2, (*MOE, "train.micro_batch_size=4"), (*MOE, "train.micro_batch_size=2", "parallel.ep=2")),
    "moe_tp2_sp_etp1": (2, MOE, (*MOE, *TP2_SP, "parallel.etp=1")),  # whole experts on every tp rank
    "moe_ep2_tp2_sp_zero1": (4, (*MOE, "train.micro_batch_size=4"),
                             (*MOE, "train.micro_batch_size=2", "parallel.ep=2", *TP2_SP, "optim.sharding=optim")),
    "mtp_pp2": (2, MTP, (*MTP, "parallel.pp=2")),  # the last stage's own copy of the word embedding
    "mtp_pp2_tied": (2, (*MTP, "model.tie_embeddings=true"), (*MTP, "model.tie_embeddings=true", "parallel.pp=2")),
}
DEFAULT = set()  # Muon at pp2 runs in the default run (test_muon_with_mtp_resumed_at_pp2); its layout matrix is slow


@pytest.mark.parametrize("name", [pytest.param(n, marks=() if n in DEFAULT else pytest.mark.slow) for n in CASES])
def test_muon_layout_matches_one_process(reference, tmp_path, name):
    nproc, ref_overrides, overrides = CASES[name]
    ref = reference("tiny_llama", *MUON, *ref_overrides)
    run_pretrain(tmp_path / name, ["+experiment=tiny_llama", *MUON, *overrides], nproc=nproc)
    assert_parity(ref, read_metrics(tmp_path / name))


@pytest.mark.slow
def test_muon_resumed_at_another_layout(reference, tmp_path):
    """Stopped at step 5 on tp=2 x dp=2 ZeRO-1, resumed on dp=2 ZeRO-3: the momentum pieces reshard."""
    save = str(tmp_path / "ckpt")
    common = ["+experiment=tiny_llama", *MUON, f"checkpoint.save={save}", "train.eval_iters=0"]
    run_pretrain(tmp_path / "run", [*common, "parallel.tp=2", "optim.sharding=optim", "train.exit_interval=5"], nproc=4)
    run_pretrain(tmp_path / "run", [*common, ZERO3, f"checkpoint.load={save}"], nproc=2)
    assert_parity(reference("tiny_llama", *MUON), read_metrics(tmp_path / "run"))


def test_muon_with_mtp_resumed_at_pp2(reference, tmp_path):
    """One process for 5 steps, then pp=2, whose last stage's copy of the word embedding reads the first
    stage's AdamW moments from the checkpoint and keeps being updated as the original is."""
    save = str(tmp_path / "ckpt")
    common = ["+experiment=tiny_llama", *MUON, *MTP, f"checkpoint.save={save}", "train.eval_iters=0"]
    run_pretrain(tmp_path / "run", [*common, "train.exit_interval=5"])
    run_pretrain(tmp_path / "run", [*common, "parallel.pp=2", f"checkpoint.load={save}"], nproc=2)
    assert_parity(reference("tiny_llama", *MUON, *MTP), read_metrics(tmp_path / "run"))


def test_resuming_with_another_optimizer_is_one_clear_error(tmp_path):
    save = str(tmp_path / "ckpt")
    common = ["+experiment=tiny_llama", f"checkpoint.save={save}", "train.eval_iters=0"]
    run_pretrain(tmp_path / "a", [*common, "train.iters=1"])
    proc = run_pretrain(tmp_path / "b", [*common, "train.iters=2", f"checkpoint.load={save}", "optim.name=muon"],
                        check=False)
    assert proc.returncode != 0 and "holds the state of another optimizer" in proc.stdout + proc.stderr
