"""Checkpoints stay layout-free under sharding: ZeRO-3 and HSDP runs resume bit-identically on their own
layout and load into other layouts and sharding levels (fp32 on gloo, against the saved run's own
continuation within the parity tolerances: step-1 loss and grad norm 1e-5 relative, 10 steps' losses
1e-4). Saved runs train 10 steps and save at step 5 (asynchronously) and 10."""

import pytest

from tests.harness import assert_parity, read_metrics, run_pretrain

MODEL = ["+experiment=tiny_llama", "train.iters=10", "optim.bucket_size=4000"]
ZERO3 = "optim.sharding=optim_grads_params"
SAVED_LAYOUTS = {  # name: overrides of a 4-rank run that saves at steps 5 and 10
    "zero3_dp4": [ZERO3],
    "hsdp_dp4_shard2": [ZERO3, "parallel.dp_shard=2"],
    "tp2_dp2_zero1": ["parallel.tp=2", "optim.sharding=optim"],
}


@pytest.fixture(scope="module")
def saved_runs(tmp_path_factory):
    cache = {}

    def get(name):
        if name not in cache:
            root = tmp_path_factory.mktemp(f"ckpt_{name}")
            run_dir = str(root / "run")
            run_pretrain(run_dir, [*MODEL, *SAVED_LAYOUTS[name], f"checkpoint.save={root}/ckpt",
                                   "checkpoint.interval=5", "checkpoint.async_save=true"], nproc=4)
            cache[name] = (str(root), read_metrics(run_dir))
        return cache[name]

    return get


def continue_from_step5(saved, tmp_path, overrides, nproc=4):
    root, ref = saved
    run_dir = str(tmp_path / "run")
    proc = run_pretrain(run_dir, [*MODEL, *overrides, f"checkpoint.load={root}/ckpt/iter_0000005"], nproc=nproc)
    run = read_metrics(run_dir)
    assert [r["iter"] for r in run] == [6, 7, 8, 9, 10]
    return proc, ref[5:], run


@pytest.mark.slow
def test_zero3_exact_resume_same_layout(saved_runs, tmp_path):
    proc, ref, run = continue_from_step5(saved_runs("zero3_dp4"), tmp_path, SAVED_LAYOUTS["zero3_dp4"])
    assert "optimizer state: yes" in proc.stdout
    for key in ("loss", "grad_norm", "lr"):
        assert [r[key] for r in run] == [r[key] for r in ref], key  # bit-identical


def test_zero3_dp4_to_tp2_pp2(saved_runs, tmp_path):
    _, ref, run = continue_from_step5(saved_runs("zero3_dp4"), tmp_path,
                                      ["parallel.tp=2", "parallel.pp=2", "optim.sharding=none"])
    assert_parity(ref, run, steps=5)


@pytest.mark.slow
def test_hsdp_to_zero1_dp2(saved_runs, tmp_path):
    _, ref, run = continue_from_step5(saved_runs("hsdp_dp4_shard2"), tmp_path, ["optim.sharding=optim"], nproc=2)
    assert_parity(ref, run, steps=5)


@pytest.mark.slow
def test_tp2_dp2_zero1_to_zero3_dp4(saved_runs, tmp_path):
    _, ref, run = continue_from_step5(saved_runs("tp2_dp2_zero1"), tmp_path, [ZERO3])
    assert_parity(ref, run, steps=5)
