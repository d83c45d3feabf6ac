"""The data-parallel engine and the distributed optimizer, in-process (spawned gloo ranks): memory,
overlap order, fp16 skipping, the checkpoint interface, bf16 tracking fp32."""

import math

import pytest
import torch

from megand.tools.spawn import run_distributed
from tests.distributed.dp_helpers import build_trainer, same, snapshot_params, snapshot_state, state_bytes, step


# -- memory: the distributed optimizer holds 1/dp of the state -------------------------------------------
def _memory_worker():
    out = {}
    for precision in ("bf16",):  # fp32 (8 bytes/element, the param is its own main copy): benchmarks/bench_optimizer.py
        for distributed in (False, True):
            t = build_trainer([f"train.precision={precision}", f"optim.sharding={'optim' if distributed else 'none'}"])
            out[(precision, distributed)] = (state_bytes(t), sum(p.numel() for p in t.params))
    return out


@pytest.mark.slow  # per-level state bytes at dp4 run in the default suite in test_sharding_memory
def test_distributed_optimizer_state_is_a_quarter_at_dp4():
    for rank_out in run_distributed(_memory_worker, 4):
        for precision, per_elem in (("bf16", 12),):  # fp32 main params, Adam m and v
            full, n = rank_out[(precision, False)]
            sharded, _ = rank_out[(precision, True)]
            assert full == per_elem * n, (precision, full, n)
            assert abs(sharded / full - 0.25) <= 0.1 * 0.25, (precision, sharded, full)


# -- overlap: the first bucket is reduced while backward is still running ----------------------------------
def _overlap_worker():
    results = {}
    for overlap in (True, False):
        t = build_trainer(["optim.sharding=optim", f"optim.overlap_grad_reduce={str(overlap).lower()}",
                           "optim.overlap_param_gather=true", "optim.bucket_size=4000"])
        events = []
        launch = t.ddp._reduce

        def recording_reduce(bucket, launch=launch, events=events):
            events.append(("reduce", bucket.index))
            launch(bucket)

        t.ddp._reduce = recording_reduce
        embedding = dict(t.named_params)["embedding.word.weight"]  # used first in forward: its gradient comes last
        embedding.register_post_accumulate_grad_hook(
            lambda p, t=t, events=events: events.append(("embedding grad", t.ddp._final)))
        losses = []
        for _ in range(3):
            events.clear()
            losses.append(step(t)[0])
        results[overlap] = (losses, list(events), len(t.ddp.buckets))
    return results


def test_overlapped_reduction_starts_during_backward_and_matches():
    for rank_out in run_distributed(_overlap_worker, 2):
        losses_on, events, buckets = rank_out[True]
        assert buckets >= 3, buckets
        last_backward_end = events.index(("embedding grad", True))
        reduced_before = [e for e in events[:last_backward_end] if e[0] == "reduce"]
        assert reduced_before and reduced_before[0] == ("reduce", 0), events
        assert len(reduced_before) >= buckets - 1, events  # all but the embedding's bucket overlap backward
        losses_off, events_off, _ = rank_out[False]
        assert events_off.index(("embedding grad", True)) < events_off.index(("reduce", 0)), events_off
        assert losses_on == losses_off, (losses_on, losses_off)


# -- fp16: an inf gradient skips the step on every rank ----------------------------------------------------
def _fp16_worker():
    t = build_trainer(["train.precision=fp16", "optim.sharding=optim", "optim.overlap_grad_reduce=true",
                       "optim.overlap_param_gather=true", "optim.bucket_size=4000", "optim.initial_loss_scale=4096",
                       "optim.hysteresis=1"])
    assert t.params[0].dtype == torch.float16
    log = [step(t)]
    scale, params, state = t.optimizer.loss_scale, snapshot_params(t), snapshot_state(t)
    handle = None
    if torch.distributed.get_rank() == 0:  # poison one gradient on one rank only
        # a norm weight: the linear layers' weight gradients bypass autograd (added straight into main_grad)
        handle = dict(t.named_params)["layers.1.post_attention_norm.weight"].register_hook(lambda g: g * math.inf)
    log.append(step(t))
    if handle is not None:
        handle.remove()
    after_skip = snapshot_params(t), snapshot_state(t), t.optimizer.loss_scale, t.optimizer.steps
    log.append(step(t))
    changed = not same(list(params.values()), list(snapshot_params(t).values()))
    return ([(loss, r.skipped, r.loss_scale) for loss, r in log], scale,
            same(list(params.values()), list(after_skip[0].values())), same(state, after_skip[1]),
            after_skip[2], after_skip[3], changed)


def test_fp16_inf_gradient_skips_the_step_everywhere():
    for log, scale, params_kept, state_kept, scale_after, steps_after, changed in run_distributed(_fp16_worker, 2):
        (l1, s1, _), (l2, s2, ls2), (l3, s3, ls3) = log
        assert not s1 and s2 and not s3, log
        assert params_kept and state_kept
        assert scale_after == ls2 == scale / 2 and ls3 == scale / 2, (scale, log)
        assert steps_after == 1
        assert math.isfinite(l3) and changed  # training goes on


# -- checkpoint interface: each rank's own shard as views, round trip ------------------------------------
def _shard_bytes(trainer):
    return sum(t.numel() * t.element_size() for s in trainer.optimizer.sharded_state_dict() for t in s.tensors.values())


def _checkpoint_worker():
    def states(t):
        return t.optimizer.sharded_state_dict()

    base = ["train.precision=bf16", "optim.bucket_size=4000"]
    plain = build_trainer(base + ["optim.sharding=none"])
    sharded = build_trainer(base + ["optim.sharding=optim", "optim.overlap_grad_reduce=true",
                                    "optim.overlap_param_gather=true"])
    for _ in range(2):
        step(plain), step(sharded)
    sd_plain = {s.name: s for s in states(plain)}
    sd_sharded = states(sharded)
    params = dict(sharded.named_params)
    shapes_ok = all(set(s.tensors) == {"main", "exp_avg", "exp_avg_sq"} and 0 <= s.lo < s.hi <= params[s.name].numel()
                    and all(v.shape == (s.hi - s.lo,) and v.dtype == torch.float32 for v in s.tensors.values())
                    for s in sd_sharded)
    # each shard is the plain optimizer's state of the same elements
    worst = max((a - b).abs().max().item() / max(b.abs().max().item(), 1e-30)
                for s in sd_sharded for k, a in s.tensors.items()
                for b in (sd_plain[s.name].tensors[k][s.lo: s.hi],))
    n = sum(p.numel() for p in sharded.params)
    bytes_per_param = (_shard_bytes(plain) / n, _shard_bytes(sharded) / n)
    # a fresh sharded optimizer loaded from those states (in place, through the views) continues exactly
    fresh = build_trainer(base + ["optim.sharding=optim"])
    with torch.no_grad():
        for (_, p), (_, q) in zip(fresh.named_params, sharded.named_params):
            p.copy_(q)
        for a, b in zip(states(fresh), sd_sharded, strict=True):
            for k, t in b.tensors.items():
                a.tensors[k].copy_(t)
    fresh.optimizer.load_scalar_state(sharded.optimizer.scalar_state())
    fresh.iteration, fresh.consumed_samples = sharded.iteration, sharded.consumed_samples  # what a checkpoint restores
    reloaded_equal = all(torch.equal(a.tensors[k], v) for a, b in zip(states(fresh), sd_sharded)
                         for k, v in b.tensors.items())
    continued = step(sharded)[0] == step(fresh)[0] and same(list(snapshot_params(sharded).values()),
                                                            list(snapshot_params(fresh).values()))
    fp32 = build_trainer(["optim.sharding=optim"])
    fp32_has_no_main = all("main" not in s.tensors for s in states(fp32))
    return shapes_ok, worst, bytes_per_param, reloaded_equal, continued, fp32_has_no_main, fresh.optimizer.scalar_state()


def test_checkpoint_interface_round_trip():
    for shapes_ok, worst, (plain_b, sharded_b), reloaded_equal, continued, fp32_has_no_main, scalar in \
            run_distributed(_checkpoint_worker, 2):
        assert shapes_ok
        assert worst <= 1e-5, worst  # the shards == the unsharded optimizer's states of the same elements
        assert plain_b == 12.0 and abs(sharded_b - 6.0) <= 0.6, (plain_b, sharded_b)  # 12/dp bytes per parameter
        assert reloaded_equal and continued and fp32_has_no_main
        assert scalar["step"] == 3 and scalar["loss_scaler"]["scale"] == 1.0
