"""Batch-size ramp-up in real runs: the batch of every step, consumed_samples and lr follow the rule, and a
run stopped mid-ramp at dp=2 and resumed at dp=1 equals the uninterrupted run (same batches, same losses)."""

import pytest

from megand.core.optimizer import LRSchedule
from tests.harness import assert_parity, read_metrics, run_pretrain

RAMP = ["+experiment=tiny_gpt", "train.eval_iters=0", "train.micro_batch_size=1", "train.batch_checksum=true",
        "train.rampup_batch_size=[2,2,12]", "train.iters=6", "optim.warmup_iters=2"]
BATCHES = [2, 2, 4, 6, 8, 8]  # 3 increments of 2, one every 12 / 3 = 4 samples; > 12 consumed: the final 8


def test_ramp_resumed_mid_ramp_at_another_dp_equals_the_uninterrupted_run(tmp_path):
    run_pretrain(str(tmp_path / "whole"), RAMP)
    whole = read_metrics(str(tmp_path / "whole"))
    assert [r["global_batch_size"] for r in whole] == BATCHES
    consumed = [sum(BATCHES[: i + 1]) for i in range(6)]
    assert [r["consumed_samples"] for r in whole] == consumed
    schedule = LRSchedule(1e-3, 3e-5, 2, 6)  # tiny_gpt's; position = samples / final batch
    assert [r["lr"] for r in whole] == pytest.approx([schedule(c / 8) for c in consumed], rel=1e-12)
    save = str(tmp_path / "ckpt")
    run_pretrain(str(tmp_path / "split"), [*RAMP, "parallel.dp=2", f"checkpoint.save={save}", "train.exit_interval=3"],
                 nproc=2)  # stops after step 3: 8 samples consumed, inside the ramp
    run_pretrain(str(tmp_path / "split"), [*RAMP, f"checkpoint.save={save}", f"checkpoint.load={save}"])
    split = read_metrics(str(tmp_path / "split"))
    assert [r["iter"] for r in split] == [1, 2, 3, 4, 5, 6]
    for key in ("global_batch_size", "consumed_samples", "batch_checksum", "lr"):
        assert [r[key] for r in split] == [r[key] for r in whole], key
    assert_parity(whole, split, steps=6)


@pytest.mark.slow
@pytest.mark.parametrize("schedule, ramp, batches", [
    ("zbv", "[3,1,15]", [3, 4, 5, 7, 8, 8]),  # odd micro-batch counts: not held to the interleaved rule
    ("dualpipev", "[4,2,8]", [4, 6, 8, 8, 8, 8]),  # never below its 2*pp micro-batches
])
def test_v_schedule_ramp_runs_and_equals_the_one_process_run(tmp_path, schedule, ramp, batches):
    """A ramp-up under a V schedule: every step runs the schedule's own micro-batch rule (zbv took odd
    counts refused as interleaved; dualpipev was checked at the final batch only) and equals one process."""
    common = ["+experiment=tiny_gpt", "train.eval_iters=0", "train.micro_batch_size=1", "model.num_layers=4",
              f"train.rampup_batch_size={ramp}", "train.iters=6", "optim.warmup_iters=2"]
    run_pretrain(str(tmp_path / "one"), common)
    run_pretrain(str(tmp_path / "v"), [*common, "parallel.pp=2", "parallel.vpp=2", f"parallel.pp_schedule={schedule}"],
                 nproc=2)
    one, v = read_metrics(str(tmp_path / "one")), read_metrics(str(tmp_path / "v"))
    assert [r["global_batch_size"] for r in v] == batches
    assert_parity(one, v, steps=6)
