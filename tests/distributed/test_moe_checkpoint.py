"""MoE checkpoints: exact resume on the same layout and resharding tp=2 -> one process, with the sigmoid
router, whose auxiliary-loss-free balancing bias (a buffer, not a parameter) is state that must be saved."""

import pytest

from tests.harness import assert_parity, read_metrics, run_pretrain

MODEL = ["+experiment=tiny_llama", "model=moe_tiny", "model.moe_router=sigmoid", "model.moe_bias_update_rate=0.01",
         "model.moe_shared_experts=1", "train.iters=10", "train.eval_iters=0"]
SAVED = ["parallel.tp=2", "parallel.sequence_parallel=true"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe_ckpt")
    run_pretrain(str(root / "run"), [*MODEL, *SAVED, f"checkpoint.save={root}/ckpt", "checkpoint.interval=5"], nproc=2)
    return str(root), read_metrics(str(root / "run"))


def continue_from_step5(saved, tmp_path, overrides, nproc):
    root, ref = saved
    proc = run_pretrain(str(tmp_path / "run"), [*MODEL, *overrides, f"checkpoint.load={root}/ckpt/iter_0000005"],
                        nproc=nproc)
    run = read_metrics(str(tmp_path / "run"))
    assert [r["iter"] for r in run] == [6, 7, 8, 9, 10]
    return proc, ref[5:], run


def test_expert_bias_is_saved(saved):
    from torch.distributed.checkpoint import FileSystemReader

    root, _ = saved
    keys = FileSystemReader(f"{root}/ckpt/iter_0000005").read_metadata().state_dict_metadata
    assert "model.layers.0.mlp.router.expert_bias" in keys
    assert "model.layers.3.mlp.experts.fc2.weight" in keys and keys["model.layers.3.mlp.experts.fc2.weight"].size == (
        4, 64, 64)


def test_exact_resume_same_layout(saved, tmp_path):
    proc, ref, run = continue_from_step5(saved, tmp_path, SAVED, 2)
    assert "RNG state: yes" in proc.stdout
    for key in ("loss", "grad_norm", "aux_loss", "expert_load_max_over_mean"):
        assert [r[key] for r in run] == [r[key] for r in ref], key  # bit-identical


def test_reshard_tp2_to_one_process(saved, tmp_path):
    proc, ref, run = continue_from_step5(saved, tmp_path, [], 1)
    assert "RNG state: no, layout changed" in proc.stdout
    assert_parity(ref, run, steps=5)


def test_one_process_model_loads_the_expert_bias(saved):
    """The tools' one-process model (generation, export) reads the balancing bias too."""
    import torch.distributed as dist

    from megand.core.checkpointing.offline import load_tensors
    from megand.models.full import load_model

    root, _ = saved
    path = f"{root}/ckpt/iter_0000005"
    try:
        model, _ = load_model(path)
        key = "layers.2.mlp.router.expert_bias"
        stored = load_tensors(path, [key])[key]
        assert stored.abs().sum() > 0  # five steps of balancing moved it
        assert model.layers["2"].mlp.router.expert_bias.tolist() == stored.tolist()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
