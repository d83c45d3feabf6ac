"""The estimator's per-stage figures for stages of different widths against a real run: three gloo ranks on CPU
train the tiny LLaMA with stage widths [tp2, tp1] (fp32), and each rank's tensors are counted while it builds
and steps (the rehearsal's byte count, megand/tools/rehearse.py's ``LiveBytes``, on real tensors and real
communication: a one-width pipeline's sent activations are released as their sends complete here, and the
hand-off's are kept). Each rank's parameters, gradients and optimizer states are within 10% of its stage's
estimate at its own width, as in tests/distributed/test_estimate_measured.py; its peak over the step within
1.0x-1.35x of the stage's total (the rehearsal's forward-backward tolerance, tests/unit/test_rehearse.py)."""

import os

import pytest

from megand.tools.spawn import run_distributed

OVERRIDES = ["+experiment=tiny_llama", "train.global_batch_size=8", "train.micro_batch_size=2", "train.iters=1",
             "parallel.pp=2", "parallel.pipeline_layout=[{layers:3,tp:2},{layers:1,tp:1}]"]
WORLD = 3


def _measure(run_dir):
    import torch.distributed as dist

    import megand.training.peak as peak
    from megand.tools.rehearse import LiveBytes
    from megand.training.config import compose
    from megand.training.pretrain import Trainer
    from tests.distributed.test_estimate_measured import _storages, _tensors_reachable

    peak.measure_matmul_flops = lambda *a, **k: 1e9  # MFU is not under test: skip the matmul timing
    cfg = compose(OVERRIDES + [f"run_dir={run_dir}"])
    tracker = LiveBytes()
    with tracker:
        trainer = Trainer(cfg)
        tracker.reset_peak()
        trainer.step()
    params = _storages(trainer.params)
    grads = _storages([g for p in trainer.params for g in (p.grad, getattr(p, "main_grad", None)) if g is not None])
    grads = {k: v for k, v in grads.items() if k not in params}
    optim = _storages(_tensors_reachable(trainer.optimizer))
    optim = {k: v for k, v in optim.items() if k not in params and k not in grads}
    result = {"rank": dist.get_rank(), "stage": trainer.topo.layout.stage_of(dist.get_rank()),
              "params_count": sum(p.numel() for p in trainer.params), "params": sum(params.values()),
              "grads": sum(grads.values()), "optimizer": sum(optim.values()), "peak": tracker.peak,
              "model": dict(cfg.model), "parallel": dict(cfg.parallel), "train": dict(cfg.train),
              "optim": dict(cfg.optim)}
    trainer.writer.close()
    return result


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    return run_distributed(_measure, WORLD, str(tmp_path_factory.mktemp("stage_widths")))


@pytest.mark.parametrize("rank", [0, 2])  # a rank of the tp2 stage, the tp1 stage
def test_each_stage_at_its_width_matches_its_measured_tensors(measured, rank):
    from omegaconf import OmegaConf

    from megand.tools.estimate_memory import Layout, estimate_memory

    m = measured[rank]
    model = OmegaConf.to_container(OmegaConf.create(m["model"]), resolve=True)
    layout = Layout.from_config(m["parallel"], m["train"], m["optim"], world_size=WORLD)
    st = estimate_memory(model, layout, [m["stage"]]).stages[0]
    predicted = {"params": st.param_bytes, "grads": st.grad_bytes, "optimizer": st.optimizer_bytes,
                 "peak": st.total_bytes}
    errors = {k: (predicted[k] - m[k]) / m[k] for k in predicted}
    report = f"rank {rank} (stage {m['stage']}, tp {st.tp}): " + ", ".join(
        f"{k} predicted {predicted[k]:,.0f} B, measured {m[k]:,.0f} B ({errors[k]:+.1%})" for k in predicted)
    print("\n" + report)
    assert st.tp == (2 if rank < 2 else 1) and st.params == m["params_count"], report
    for key in ("params", "grads", "optimizer"):
        assert abs(errors[key]) < 0.10, report
    assert 1.0 <= m["peak"] / st.total_bytes <= 1.35, report
