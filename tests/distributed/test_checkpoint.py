"""Exact resume and resharding , fp32 on gloo.

Saved runs (tp=2 x pp=2; tp=2 x dp=2 and dp=4 with the distributed optimizer) train 10 steps and save
at step 5 (asynchronously, so a resume also proves the background save wrote the state of step 5, not a
later one) and at step 10. Every other run loads step 5 at some layout and continues to step 10:
- same layout: losses and grad norms bit-identical to the saved run's steps 6-10;
- another layout: within the parity tolerances of the saved run's continuation.
GQA with 4 query groups so that tp=4 is valid; vocab 251 is uneven over tp=4 (63, 63, 63, 62 rows).
"""

import os

import pytest

from tests.harness import assert_parity, read_metrics, run_pretrain

MODEL = ["+experiment=tiny_llama", "model.num_attention_heads=8", "model.num_query_groups=4", "train.iters=10"]
SAVED_LAYOUTS = {  # name: overrides of a 4-rank run that saves at steps 5 (asynchronously) and 10
    "tp2_pp2": ["parallel.tp=2", "parallel.pp=2"],
    "tp2_dp2_distopt": ["parallel.tp=2", "optim.sharding=optim"],
    "dp4_distopt": ["optim.sharding=optim"],
}


@pytest.fixture(scope="module")
def saved_runs(tmp_path_factory):
    cache = {}

    def get(name):
        if name not in cache:
            root = tmp_path_factory.mktemp(f"ckpt_{name}")
            run_dir = str(root / "run")
            proc = run_pretrain(run_dir, [*MODEL, *SAVED_LAYOUTS[name], f"checkpoint.save={root}/ckpt",
                                          "checkpoint.interval=5", "checkpoint.async_save=true"], nproc=4)
            assert "saved checkpoint at iteration 5" in proc.stdout
            with open(f"{root}/ckpt/latest") as f:
                assert f.read().strip() == "10"
            assert sorted(n for n in os.listdir(f"{root}/ckpt") if n.startswith("iter_")) == [
                "iter_0000005", "iter_0000010"]
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


@pytest.mark.parametrize("saved", [pytest.param("tp2_dp2_distopt", marks=pytest.mark.slow), "tp2_pp2"])
def test_exact_resume_same_layout(saved_runs, tmp_path, saved):
    proc, ref, run = continue_from_step5(saved_runs(saved), tmp_path, SAVED_LAYOUTS[saved])
    assert "RNG state: yes" in proc.stdout
    for key in ("loss", "grad_norm", "lr"):
        assert [r[key] for r in run] == [r[key] for r in ref], key  # bit-identical


@pytest.mark.parametrize("saved, layout, nproc", [
    pytest.param("tp2_pp2", ["parallel.tp=1", "parallel.pp=1"], 4, marks=pytest.mark.slow),  # -> tp 1, pp 1, dp 4
    pytest.param("tp2_pp2", ["parallel.tp=4"], 4, marks=pytest.mark.slow),  # -> tp 4 (uneven vocab shards), pp 1
    ("tp2_pp2", ["parallel.tp=2", "parallel.cp=2"], 4),  # pp 2 -> cp 2
    ("tp2_dp2_distopt", ["parallel.pp=2", "parallel.vpp=2", "optim.sharding=none"], 2),  # -> interleaved pp
    # distributed optimizer: dp 4 -> dp 2 (slow: ZeRO-1 shards saved at dp4 load at other layouts in the
    # default run of test_checkpoint_memory)
    pytest.param("dp4_distopt", ["optim.sharding=optim"], 2, marks=pytest.mark.slow),
], ids=["tp2pp2_to_tp1dp4", "tp2pp2_to_tp4", "tp2pp2_to_tp2cp2", "tp2dp2_to_pp2vpp2", "dp4_to_dp2"])
def test_reshard(saved_runs, tmp_path, saved, layout, nproc):
    proc, ref, run = continue_from_step5(saved_runs(saved), tmp_path, layout, nproc)
    assert "RNG state: no, layout changed" in proc.stdout
    assert_parity(ref, run, steps=5)
