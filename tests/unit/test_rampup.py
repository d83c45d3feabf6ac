"""Batch-size ramp-up: Megatron's rule (written here independently), the values checked per layout."""

import pytest

from megand.training.config import ConfigError, compose, validate
from megand.training.rampup import BatchRamp


def megatron_batch(consumed, start, increment, ramp_samples, final):
    if consumed > ramp_samples:
        return final
    per_increment = ramp_samples / ((final - start) / increment)
    return start + int(consumed / per_increment) * increment


@pytest.mark.parametrize("start,increment,samples,final", [(2, 2, 12, 8), (32, 32, 1000, 256), (16, 16, 30, 64),
                                                            (8, 8, 5, 16), (4, 12, 100, 40)])
def test_batch_size_follows_megatrons_rule(start, increment, samples, final):
    ramp = BatchRamp(start, increment, samples, final)
    for consumed in range(0, samples + 3 * final):
        assert ramp.batch_size(consumed) == megatron_batch(consumed, start, increment, samples, final), consumed
    consumed, seen = 0, []
    while consumed <= samples + final:  # what a run takes: consumed grows by each step's batch
        seen.append(ramp.batch_size(consumed))
        consumed += seen[-1]
    assert seen[0] == start and seen[-1] == final and seen == sorted(seen)


@pytest.mark.parametrize("overrides,message", [
    (["train.rampup_batch_size=[2,2]"], r"train.rampup_batch_size=\[2, 2\] must be three integers"),
    (["train.rampup_batch_size=[0,2,10]"], "must be positive"),
    (["train.rampup_batch_size=[3,2,10]"], "train.global_batch_size=8 minus start 3"),
    (["train.rampup_batch_size=[2,2,10]", "train.micro_batch_size=4"], "global batch of 2, not divisible by .* = 4"),
    (["train.rampup_batch_size=[2,2,10]", "train.micro_batch_size=2", "parallel.dp=2"], "global batch of 2, .* dp = 4"),
])
def test_bad_ramp_values_are_named(overrides, message):
    with pytest.raises(ConfigError, match=message):
        validate(compose(["+experiment=tiny_gpt", *overrides]), 2 if "parallel.dp=2" in overrides else 1)


def test_interleaved_ramp_needs_micro_batches_per_stage():
    cfg = compose(["+experiment=tiny_gpt", "model.num_layers=4", "parallel.pp=2", "parallel.vpp=2",
                   "train.micro_batch_size=1", "train.rampup_batch_size=[2,1,10]"])
    with pytest.raises(ConfigError, match="3 micro-batches, not a multiple of parallel.pp=2"):
        validate(cfg, 2)


def test_estimator_uses_the_final_batch_and_says_so(capsys):
    from megand.tools.estimate import main

    assert main(["+experiment=tiny_gpt", "train.rampup_batch_size=[2,2,12]", "--world-size", "1"]) == 0
    assert "estimated at the final global batch 8" in capsys.readouterr().err


def _v_ramp(schedule, ramp):
    return compose(["+experiment=tiny_gpt", "model.num_layers=4", "parallel.pp=2", "parallel.vpp=2",
                    f"parallel.pp_schedule={schedule}", "train.micro_batch_size=1", f"train.rampup_batch_size={ramp}"])


def test_dualpipev_ramp_is_checked_at_every_batch_size():
    """dualpipev needs 2*pp micro-batches at every step: a ramp starting below that is refused before any
    work (it passed, checked at the final batch only, and stopped at step 1 in the executor)."""
    with pytest.raises(ConfigError, match=r"reaches a global batch of 2: 2 micro-batches, fewer than the 2\*pp = 4 "
                                          r"that parallel.pp_schedule=dualpipev needs"):
        validate(_v_ramp("dualpipev", "[2,2,10]"), 2)
    validate(_v_ramp("dualpipev", "[4,2,10]"), 2)


@pytest.mark.parametrize("schedule", ["zbv", "dualpipev"])
def test_v_schedule_ramp_is_not_held_to_the_interleaved_rule(schedule):
    """A V runs any micro-batch count its record allows (odd ones too): its ramp is not refused as if it
    interleaved, and every step of it has an action list."""
    from megand.core.pipeline_parallel.actions import schedule_actions
    from megand.training.rampup import batch_ramp

    cfg = _v_ramp(schedule, "[5,1,10]" if schedule == "dualpipev" else "[3,1,10]")
    validate(cfg, 2)
    for size in batch_ramp(cfg.train).sizes():
        for rank in range(2):
            assert schedule_actions(2, 2, size, rank, schedule=schedule)
