"""What the schedules keep alive, and that they agree with one another (one 2-rank launch, pp=2, m=8).

Stored activations are counted directly: every tensor autograd saves for backward (parameters
excepted) is tracked until the graph releases it. 1F1B keeps at most pp micro-batches alive on stage 0;
the fill-drain (GPipe) schedule, which runs every forward before any backward, keeps all m. (The pp=1
no-pipelining schedule is gradient accumulation: one micro-batch at a time.)
"""

import weakref

import pytest
import torch

from megand.tools.spawn import run_distributed

M, PP = 8, 2


class SavedActivations:
    """Live bytes of the tensors autograd saves for backward, excluding parameters; and their peak."""

    def __init__(self, params):
        self.param_storages = {p.untyped_storage().data_ptr() for p in params}
        self.refs, self.live, self.peak = {}, 0, 0

    class _Held:
        def __init__(self, tensor):
            self.tensor = tensor

    def _pack(self, tensor):
        storage = tensor.untyped_storage()
        ptr, nbytes = storage.data_ptr(), storage.nbytes()
        if ptr in self.param_storages or nbytes == 0:
            return tensor
        if self.refs.get(ptr, 0) == 0:
            self.live += nbytes
            self.peak = max(self.peak, self.live)
        self.refs[ptr] = self.refs.get(ptr, 0) + 1
        held = self._Held(tensor)
        weakref.finalize(held, self._release, ptr, nbytes)
        return held

    def _release(self, ptr, nbytes):
        self.refs[ptr] -= 1
        if self.refs[ptr] == 0:
            self.live -= nbytes

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self._pack, lambda h: h.tensor if isinstance(h, self._Held) else h)


def _trainer(run_dir, overrides):
    from megand.training.config import compose

    from megand.training.pretrain import Trainer

    cfg = compose(["+experiment=tiny_gpt", f"run_dir={run_dir}", "parallel.pp=2", f"train.global_batch_size={2 * M}",
                   *overrides])
    return Trainer(cfg)


def _run_schedules(run_dir):
    from megand.core.pipeline_parallel import (
        ScheduleStats,
        forward_backward_fill_drain,
        forward_backward_pipelining_with_interleaving,
        forward_backward_pipelining_without_interleaving,
    )
    from megand.training.batches import rank_microbatches

    out = {}
    for label, overrides, schedules in [
        ("plain", [], {"1f1b": forward_backward_pipelining_without_interleaving, "fill_drain": forward_backward_fill_drain}),
        ("interleaved", ["parallel.vpp=2"], {"interleaved": forward_backward_pipelining_with_interleaving}),
    ]:
        trainer = _trainer(run_dir, overrides)
        topo, chunks = trainer.topo, trainer.chunks
        microbatches = rank_microbatches(trainer.train_data, 0, 2 * M, 2, topo)
        assert len(microbatches) == M
        for name, schedule in schedules.items():
            trainer.ddp.zero_grad()  # gradients accumulate into the engine's fp32 main_grad buffers
            stats, saved = ScheduleStats(), SavedActivations(trainer.params)
            with saved.hooks():
                loss = schedule(chunks, microbatches, trainer.forward_step, topo, stats=stats)
            with torch.no_grad():
                eval_loss = schedule(chunks, microbatches, trainer.forward_step, topo, forward_only=True)
            out[name] = dict(peak_live=stats.peak_live, end_live=stats.live, peak_bytes=saved.peak, end_bytes=saved.live,
                             loss=None if loss is None else loss.item(),
                             eval_loss=None if eval_loss is None else eval_loss.item(),
                             grads={n: p.main_grad.numpy().copy() for c in chunks for n, p in c.named_parameters()})  # numpy: pickled by value
        if label == "plain" and topo.is_first_stage:  # stored bytes of one micro-batch on this stage
            saved = SavedActivations(trainer.params)
            with saved.hooks():
                output = trainer.forward_step(chunks[0], microbatches[0], None)
            out["one_microbatch_bytes"] = saved.live
            del output
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_distributed(_run_schedules, PP, str(tmp_path_factory.mktemp("schedules")))


def test_1f1b_keeps_at_most_pp_microbatches_alive_on_stage_0_fill_drain_keeps_m(results):
    stage0 = results[0]
    one = stage0["one_microbatch_bytes"]
    assert one > 0
    assert stage0["1f1b"]["peak_live"] == PP
    assert stage0["fill_drain"]["peak_live"] == M
    # measured stored activations agree with the count
    assert stage0["1f1b"]["peak_bytes"] <= PP * one * 1.05, (stage0["1f1b"]["peak_bytes"], one)
    assert stage0["fill_drain"]["peak_bytes"] >= M * one * 0.95, (stage0["fill_drain"]["peak_bytes"], one)
    for name in ("1f1b", "fill_drain", "interleaved"):  # everything is released at the end of the step
        assert all(r[name]["end_live"] == 0 and r[name]["end_bytes"] == 0 for r in results), name
    # the last stage runs one forward then one backward: one micro-batch alive
    assert results[-1]["1f1b"]["peak_live"] == 1


def test_interleaved_warm_up_depth(results):
    # Megatron's interleaved schedule: rank r runs (pp-r-1)*2 + (v-1)*pp warm-up forwards of model chunks
    v = 2
    for rank, r in enumerate(results):
        assert r["interleaved"]["peak_live"] == min((PP - rank - 1) * 2 + (v - 1) * PP + 1, M * v)


def test_schedules_agree_on_loss_and_gradients(results):
    first, last = results[0], results[-1]
    assert first["1f1b"]["loss"] is None and last["1f1b"]["loss"] is not None
    loss = last["1f1b"]["loss"]
    for name in ("1f1b", "fill_drain", "interleaved"):
        assert last[name]["loss"] == pytest.approx(loss, rel=1e-6)
        assert last[name]["eval_loss"] == pytest.approx(loss, rel=1e-6)  # forward-only: same forward, same loss
    for r in results:
        for n, g in r["1f1b"]["grads"].items():
            torch.testing.assert_close(torch.from_numpy(r["fill_drain"]["grads"][n]), torch.from_numpy(g), rtol=1e-6, atol=1e-9)
    # interleaved chunks hold other layers per rank; compare by parameter name across ranks
    plain = {n: g for r in results for n, g in r["1f1b"]["grads"].items() if "output_layer" not in n}
    inter = {n: g for r in results for n, g in r["interleaved"]["grads"].items() if "output_layer" not in n}
    assert plain.keys() == inter.keys()
    for n in plain:
        torch.testing.assert_close(torch.from_numpy(inter[n]), torch.from_numpy(plain[n]), rtol=1e-5, atol=1e-8)
