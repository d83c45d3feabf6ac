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
