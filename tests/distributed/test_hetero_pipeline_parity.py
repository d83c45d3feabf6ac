"""Pipeline stages of different tensor-parallel widths (the per-stage ``parallel.pipeline_layout``) train
exactly the one-process run (fp32, the parity tolerances of tests/harness.py), tensor by tensor too
(AdamW's first moment after step 1 is ``(1-beta1) g``, from the checkpoints, within 5e-6): the hand-off
between stages of different widths (megand/core/pipeline_parallel/hand_off.py) under 1F1B, zb1p and
interleaving, with and without sequence parallelism on either side; and a run resumes exactly from such a
layout to a homogeneous one and back."""

import pytest

from tests.distributed.test_batch_shares_parity import _first_moments, assert_same_moments
from tests.harness import assert_parity, read_metrics, run_pretrain


def stages(*entries) -> str:
    """``parallel.pipeline_layout`` of per-stage entries ``(layers, tp, sp)``."""
    return "parallel.pipeline_layout=[" + ",".join(f"{{layers:{n},tp:{tp},sp:{str(sp).lower()}}}"
                                                    for n, tp, sp in entries) + "]"


CASES = {  # name: (processes, overrides)
    "tp2_tp1": (3, ("parallel.pp=2", stages((2, 2, False), (2, 1, False)))),
    "tp1_tp2_zb1p": (3, ("parallel.pp=2", "parallel.pp_schedule=zb1p", stages((1, 1, False), (3, 2, False)))),
    # interleaved: one entry per virtual stage; pipeline rank 0 holds virtual stages 0 and 2
    "tp2sp_tp1_vpp2": (3, ("parallel.pp=2", "parallel.vpp=2",
                           stages((1, 2, True), (1, 1, False), (1, 2, True), (1, 1, False)))),
    "tp1_tp2sp_dp2_zero1": (6, ("parallel.pp=2", "optim.sharding=optim",
                                stages((2, 1, False), (2, 2, True)))),
    # a V: pipeline rank 0 holds virtual stages 0 and 3 (the loss), rank 1 stages 1 and 2
    "tp2sp_tp1_zbv": (3, ("parallel.pp=2", "parallel.vpp=2", "parallel.pp_schedule=zbv",
                          stages((1, 2, True), (1, 1, False), (1, 1, False), (1, 2, True)))),
    # both heterogeneous features at once: stages of different widths, replicas that take different shares
    "tp1_tp2sp_shares_3_1_zero1": (6, ("parallel.pp=2", "optim.sharding=optim", "parallel.dp_microbatches=[3,1]",
                                       stages((2, 1, False), (2, 2, True)))),
    # a middle stage wider than both neighbours
    "tp1_tp2sp_tp1_pp3": (4, ("parallel.pp=3",
                              stages((2, 1, False), (1, 2, True), (1, 1, False)))),
}
DEFAULT = {"tp2_tp1"}


@pytest.mark.parametrize("name", [pytest.param(n, marks=() if n in DEFAULT else pytest.mark.slow) for n in CASES])
def test_stage_widths_ten_steps(tmp_path, reference, name):
    nproc, overrides = CASES[name]
    run_pretrain(tmp_path, ["+experiment=tiny_llama", *overrides], nproc=nproc)
    assert_parity(reference("tiny_llama"), read_metrics(tmp_path))


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_stage_widths_step_one_per_tensor(tmp_path, name):
    nproc, overrides = CASES[name]
    ref = _first_moments(tmp_path / "one", 1, ())
    assert_same_moments(_first_moments(tmp_path / name, nproc, overrides), ref)


@pytest.mark.slow
def test_resume_from_stage_widths_to_one_width_and_back(tmp_path, reference):
    """Stopped at step 4 with stage widths [tp2, tp1] (ZeRO-1), resumed at one width (tp2 x pp2) until step 7,
    then at [tp1, tp2+sp]: the ten steps equal the one-process run's (the checkpoints' shards, saved per
    stage at each stage's own width, load at every other layout)."""
    save = str(tmp_path / "ckpt")
    common = ["+experiment=tiny_llama", f"checkpoint.save={save}", f"checkpoint.load={save}", "train.eval_iters=0",
              "parallel.pp=2", "optim.sharding=optim"]
    run_pretrain(tmp_path / "run", [*common, stages((2, 2, False), (2, 1, False)), "train.exit_interval=4"], nproc=3)
    run_pretrain(tmp_path / "run", [*common, "parallel.tp=2", "train.exit_interval=7"], nproc=4)
    run_pretrain(tmp_path / "run", [*common, stages((2, 1, False), (2, 2, True))], nproc=3)
    steps = read_metrics(tmp_path / "run")
    assert [r["iter"] for r in steps] == list(range(1, 11))  # each run went on from the last one's checkpoint
    assert_parity(reference("tiny_llama"), steps)
