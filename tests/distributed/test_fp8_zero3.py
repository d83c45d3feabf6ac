"""ZeRO-3 parameter all-gathers in FP8: the FP8 operands a layer's GEMMs receive from the gather are the
bytes and scales the one-process run quantises from the whole weight (scales computed on the shards and
agreed), and the gathers of FP8 layers' weights move one byte per element (plus scales), not two."""

import pytest
import torch
import torch.distributed as dist

from megand.tools.spawn import run_distributed
from tests.distributed.dp_helpers import build_trainer


def _full_weights(trainer):
    """Every parameter's whole (tp-local) value, from the ranks' ZeRO-3 slices."""
    full = {p: torch.zeros(p.numel(), dtype=torch.float32) for p in trainer.params}
    for p, lo, hi, data in trainer.ddp.param_shards():
        full[p][lo:hi] = data.float()
    for p, t in full.items():
        dist.all_reduce(t, group=trainer.ddp.group)  # the slices are disjoint: the sum is the whole
    return full


def _operands_worker(recipe, extra=(), bucket_size=20000):
    from megand.core.tensor_parallel.fp8 import E4M3, Fp8Policy

    trainer = build_trainer(["train.precision=bf16", f"train.fp8={recipe}", "train.fp8_bf16_layers=0",
                             "train.eval_iters=0", "optim.sharding=optim_grads_params", f"optim.bucket_size={bucket_size}",
                             *extra])
    full = _full_weights(trainer)
    bucket_of = trainer.ddp.bucket_of  # the weights gathered in FP8 (MX: those of whole 32-blocks rows)
    weight_of = {id(m.gemm): m.weight for chunk in trainer.chunks for m in chunk.modules()
                 if isinstance(getattr(m, "gemm", None), Fp8Policy) and bucket_of[m.weight].fp8 is not None}
    checked, missed, mismatched = {0: 0, 1: 0}, {0: 0, 1: 0}, []
    original = Fp8Policy._weight_q

    def checking(policy, weight, dim, contraction, part=0, parts=1):
        q = original(policy, weight, dim, contraction, part, parts)
        param = weight_of.get(id(policy))
        if param is None:
            return q
        # the same rows of the whole weight, quantised as the one-process run does
        whole = full[param].to(param.dtype).view(param.shape)
        view = whole.view(-1, parts, whole.shape[-1])[:, part]
        expected = policy._q(view, E4M3, dim, "nk", contraction)
        gathered = any(v is q for v in policy.gathered.values())
        if not (torch.equal(q.data.view(torch.uint8), expected.data.view(torch.uint8))
                and torch.equal(q.scale, expected.scale)):
            mismatched.append((tuple(weight.shape), dim))
        checked[dim] += gathered
        missed[dim] += not gathered
        return q

    count, fp8_bytes = trainer.ddp.count, []

    def counting(kind, full, ranks):
        if kind == "all_gather" and full.dtype == torch.uint8:
            fp8_bytes.append(full.numel() * (ranks - 1) // ranks)
        count(kind, full, ranks)

    Fp8Policy._weight_q, trainer.ddp.count = checking, counting
    try:
        trainer.ddp.traffic.update(dict.fromkeys(trainer.ddp.traffic, 0))
        loss = trainer.step()
    finally:
        Fp8Policy._weight_q = original
    fp8_elements = sum(b.numel for b in trainer.ddp.buckets if b.fp8 is not None)
    return {"checked": checked, "missed": missed, "mismatched": mismatched, "loss": loss, "fp8_elements": fp8_elements,
            "fp8_bytes": sum(fp8_bytes),
            "traffic": dict(trainer.ddp.traffic)}


def test_zero3_gathers_tensorwise_fp8_operands_equal_to_the_whole_weights():
    # one bucket per buffer (the default size): norms between the FP8 linears live in another bucket
    for out in run_distributed(_operands_worker, 2, "tensorwise", (), 40_000_000):
        assert not out["mismatched"], out["mismatched"]
        # forward and backward operands of every FP8 layer came from the FP8 gathers
        assert out["checked"][1] > 0 and out["checked"][0] > 0 and out["missed"] == {0: 0, 1: 0}, out
        # one byte per element, each bucket gathered once for forward and once for backward per micro-batch
        # (2 here); a norm between FP8 linears once prefetched their finished bucket again
        assert out["fp8_elements"] > 0 and out["fp8_bytes"] == 2 * 2 * out["fp8_elements"] // 2, out


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["rowwise", "mxfp8"])
def test_zero3_gathers_fp8_forward_operands_equal_to_the_whole_weights(recipe):
    for out in run_distributed(_operands_worker, 2, recipe):
        assert not out["mismatched"], out["mismatched"]
        # forward: gathered; backward: quantised from the bf16 weight gathered for it
        assert out["checked"][1] > 0 and out["missed"][1] == 0 and out["checked"][0] == 0, out


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "mxfp8"])
def test_zero3_fp8_gathers_under_recompute_and_kept_buckets(recipe):
    """A forward recomputed inside backward, and buckets kept from forward to backward, still read the
    operands the one-process run quantises."""
    for extra in (["train.recompute=full"], ["optim.reshard_after_forward=false"]):
        for out in run_distributed(_operands_worker, 2, recipe, extra):
            assert not out["mismatched"], (extra, out["mismatched"])
            assert out["checked"][1] > 0, (extra, out)
            if recipe == "tensorwise":
                assert out["missed"] == {0: 0, 1: 0}, (extra, out)


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_zero3_fp8_gathers_agree_scales_over_tensor_parallelism_too(recipe):
    """tp=2 x dp=2: a tensorwise scale of a split weight, a rowwise one of a row-parallel layer, are agreed
    over tp as well, as the one-process run's scales of the whole weight are."""
    for out in run_distributed(_operands_worker, 4, recipe, ["parallel.tp=2", "parallel.sequence_parallel=true"]):
        assert not out["mismatched"], out["mismatched"]
        assert out["checked"][1] > 0 and out["missed"][1] == 0, out


@pytest.mark.slow
def test_zero3_checkpoints_cross_fp8_and_bf16_buffer_layouts(tmp_path):
    """FP8 gathers give the FP8 weights buffers of their own (MX: 32-aligned): a ZeRO-3 checkpoint still
    resumes across mxfp8, bf16 and tensorwise runs (it holds each parameter's slices, not the buffers)."""
    from tests.harness import read_metrics, run_pretrain

    ckpt = tmp_path / "ckpt"
    common = ["+experiment=tiny_llama", "train.precision=bf16", "train.eval_iters=0", f"checkpoint.save={ckpt}",
              f"checkpoint.load={ckpt}", "checkpoint.interval=2", "optim.sharding=optim_grads_params"]
    run_pretrain(tmp_path / "a", [*common, "train.fp8=mxfp8", "train.iters=2"], nproc=2)
    run_pretrain(tmp_path / "b", [*common, "train.iters=4"], nproc=2)
    run_pretrain(tmp_path / "c", [*common, "train.fp8=tensorwise", "train.iters=6"], nproc=2)
    assert [m["iter"] for m in read_metrics(tmp_path / "b")] == [3, 4]
    assert [m["iter"] for m in read_metrics(tmp_path / "c")] == [5, 6]
