"""``train.compile=true`` (each transformer layer compiled) reproduces the one-process eager run within the
parity tolerances, composed with the parallel layouts and recomputation, and reports its compile time.
Compiling on CPU takes a minute or more per process: two default cases (tp with sp, and a zero-bubble
schedule whose deferred weight-gradient passes leave the compiled backward), the rest marked slow."""

import pytest

from tests.harness import assert_parity, read_metrics, run_pretrain

CASES = {  # name: (experiment, processes, overrides)
    "llama-tp2-sp": ("tiny_llama", 2, ["parallel.tp=2", "parallel.sequence_parallel=true"]),
    "gpt-tp2-sp": ("tiny_gpt", 2, ["parallel.tp=2", "parallel.sequence_parallel=true"]),
    "gpt-pp2": ("tiny_gpt", 2, ["parallel.pp=2"]),
    "llama-pp2": ("tiny_llama", 2, ["parallel.pp=2"]),
    # zero-bubble: the weight-gradient GEMMs deferred out of the compiled layers' backward into W
    "llama-pp2-zb1p": ("tiny_llama", 2, ["parallel.pp=2", "parallel.pp_schedule=zb1p"]),
    "llama-pp2-zbv": ("tiny_llama", 2, ["parallel.pp=2", "parallel.vpp=2", "parallel.pp_schedule=zbv"]),
    "llama-cp2": ("tiny_llama", 2, ["parallel.cp=2"]),
    "llama-recompute-full": ("tiny_llama", 1, ["train.recompute=full"]),
    "gpt-recompute-selective-tp2": ("tiny_gpt", 2, ["parallel.tp=2", "train.recompute=selective"]),
    "llama-dp2-distributed-optimizer": ("tiny_llama", 2, ["optim.sharding=optim"]),
}
DEFAULT = {"llama-pp2-zb1p"}  # compiled layers under tp + sp: slow (the compiled W pass is the riskier path)
PARAMS = [pytest.param(name, id=name, marks=() if name in DEFAULT else pytest.mark.slow) for name in CASES]


@pytest.mark.parametrize("name", PARAMS)
def test_compiled_layers_match_reference(name, reference, tmp_path):
    experiment, nproc, overrides = CASES[name]
    proc = run_pretrain(tmp_path, [f"+experiment={experiment}", "train.compile=true", *overrides], nproc=nproc)
    assert "train.compile: transformer layers compiled in" in proc.stdout
    assert_parity(reference(experiment), read_metrics(tmp_path))
