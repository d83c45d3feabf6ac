"""Every learning-rate schedule and decay shape against its formula, written here independently, at every
step; and ``lr`` in metrics.jsonl of real runs (WSD, its extension by a longer run, a cooldown)."""

import math

import pytest

from megand.core.optimizer import LRSchedule
from megand.training.config import ConfigError, compose, validate
from tests.harness import read_metrics, run_pretrain

PEAK, LOW = 1e-3, 1e-4


def expected(step, kind, warmup, total, shape="1-sqrt", fraction=0.2, start=None):
    """The documented formula, spelt out per phase."""
    if warmup > 0 and step <= warmup:
        return PEAK * step / warmup
    if kind == "constant":
        return PEAK
    if kind == "wsd":
        begin = start if start is not None else total - round(fraction * total)
    else:
        begin, shape = warmup, kind
    if step <= begin:
        return PEAK
    p = (step - begin) / max(1, total - begin)
    if p >= 1:
        return LOW
    f = {"linear": 1 - p, "cosine": (1 + math.cos(math.pi * p)) / 2, "1-sqrt": 1 - p ** 0.5}[shape]
    return LOW + (PEAK - LOW) * f


KINDS = [("cosine", None), ("linear", None), ("constant", None), ("wsd", "linear"), ("wsd", "cosine"),
         ("wsd", "1-sqrt")]
PLANS = [(3, 20, 0.2, None), (0, 17, 0.5, None), (4, 30, 0.2, 10), (2, 9, 0.0, None), (0, 9, 1.0, None)]


@pytest.mark.parametrize("kind,shape", KINDS)
@pytest.mark.parametrize("warmup,total,fraction,start", PLANS)
def test_every_schedule_follows_its_formula(kind, shape, warmup, total, fraction, start):
    schedule = LRSchedule(PEAK, LOW, warmup, total, kind, shape or "1-sqrt", fraction, start)
    for step in range(1, total + 6):  # also past the end: min_lr (constant: the peak)
        assert schedule(step) == pytest.approx(expected(step, kind, warmup, total, shape, fraction, start),
                                               rel=1e-12, abs=0), step


def test_wsd_phases_by_hand():
    schedule = LRSchedule(1.0, 0.0, 2, 10, "wsd", "linear", 0.4)  # decay over the last 4 steps
    assert [schedule(s) for s in range(1, 11)] == pytest.approx([0.5, 1, 1, 1, 1, 1, 0.75, 0.5, 0.25, 0])


@pytest.mark.parametrize("overrides,message", [
    (["optim.schedule=wsd", "optim.decay_fraction=1.5"], "optim.decay_fraction=1.5"),
    (["optim.schedule=wsd", "optim.decay_start=50", "train.iters=20"], "optim.decay_start=50"),
    (["optim.schedule=wsd", "optim.decay_fraction=1.0", "optim.warmup_iters=5"], "inside the warm-up"),
    (["optim.schedule=wsd", "optim.decay_style=exp"], "optim.decay_style='exp'"),
])
def test_bad_wsd_values_are_named(overrides, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[")):
        validate(compose(["+experiment=tiny_gpt", *overrides]), 1)


def test_wsd_run_extended_then_cooled_down(tmp_path):
    """metrics.jsonl's lr follows the formula; a longer run resumed from a stable checkpoint stays at the peak
    (the decay moves with train.iters), and decay_start = the loaded iteration cools down from there."""
    save = str(tmp_path / "ckpt")
    common = ["+experiment=tiny_gpt", "train.eval_iters=0", "optim.schedule=wsd", "optim.warmup_iters=2",
              f"optim.lr={PEAK}", f"optim.min_lr={LOW}", "optim.decay_fraction=0.5", f"checkpoint.save={save}",
              "checkpoint.interval=2"]
    run_pretrain(str(tmp_path / "a"), [*common, "train.iters=4", "train.exit_interval=2"])  # stops at 2 of 4
    run_pretrain(str(tmp_path / "a"), [*common, "train.iters=8", f"checkpoint.load={save}"])  # extended to 8
    lrs = {r["iter"]: r["lr"] for r in read_metrics(str(tmp_path / "a"))}
    assert sorted(lrs) == list(range(1, 9))
    for step, lr in lrs.items():  # steps 1-2 under the 4-step plan, 3-8 under the 8-step one: the same curve
        assert lr == pytest.approx(expected(step, "wsd", 2, 8, "1-sqrt", 0.5), rel=1e-12), step
    assert lrs[3] == lrs[4] == PEAK  # the 4-step plan would have decayed here
    # cooldown: from the stable checkpoint of iteration 4, linear decay over 3 steps
    run_pretrain(str(tmp_path / "c"), [*common, "train.iters=7", f"checkpoint.load={save}/iter_0000004",
                                       "optim.decay_start=4", "optim.decay_style=linear", "checkpoint.save=null"])
    cooled = [(r["iter"], r["lr"]) for r in read_metrics(str(tmp_path / "c"))]
    assert [i for i, _ in cooled] == [5, 6, 7]
    for step, lr in cooled:
        assert lr == pytest.approx(expected(step, "wsd", 2, 7, "linear", start=4), rel=1e-12), step
    assert cooled[-1][1] == pytest.approx(LOW)
