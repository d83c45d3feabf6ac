"""Tensor, sequence and data parallelism reproduce the one-process run (the parity tolerances of tests/harness.py)."""

import pytest

from tests.harness import assert_parity

LAYOUTS = {
    "tp2": (2, ["parallel.tp=2"]),
    "dp2": (2, []),
    "tp2_sp": (2, ["parallel.tp=2", "parallel.sequence_parallel=true"]),
    "tp2_dp2_sp": (4, ["parallel.tp=2", "parallel.sequence_parallel=true"]),
}


# the default run: every layout once, on one of the two models (both models run tp in it); the rest slow
# (plain dp2 runs in the default suite in test_dp_parity)
DEFAULT = {("tp2", "tiny_gpt"), ("tp2_dp2_sp", "tiny_llama")}


@pytest.mark.parametrize("layout, experiment", [
    pytest.param(layout, exp, id=f"{layout}-{exp}", marks=() if (layout, exp) in DEFAULT else pytest.mark.slow)
    for layout in LAYOUTS for exp in ("tiny_gpt", "tiny_llama")])
def test_layout_matches_one_process(reference, launch, experiment, layout):
    nproc, overrides = LAYOUTS[layout]
    assert_parity(reference(experiment), launch(experiment, nproc, *overrides))


@pytest.mark.slow
def test_qkv_bias_matches_one_process(reference, launch):
    """``model.qkv_bias`` (Qwen2's biases on q/k/v only): the bias follows the fused QKV rows over tp."""
    bias = "model.qkv_bias=true"
    assert_parity(reference("tiny_llama", bias),
                  launch("tiny_llama", 2, bias, "parallel.tp=2", "parallel.sequence_parallel=true"))
