"""GPT-OSS's block variants reproduce the one-process run (the parity tolerances of tests/harness.py): attention
sinks (split over tp with the heads; over cp a finishing step after the blocks are merged, or on each rank's
heads after Ulysses' all-to-all), biases on every attention projection, sliding-window and full layers
alternating, a router with a bias and routed experts with biases and the clamped SwiGLU (a small limit: the
clamps act). The default suite runs the ring (the log-sum-exp's gradient through the ring's backward) with tp=2;
the matrix over tp+sp, pp, each cp path, ep, ZeRO-3 and recompute is slow."""

import pytest

from tests.harness import assert_parity

GPT_OSS = ["model=moe_tiny", "model.attention_sinks=true", "model.qkv_bias=true", "model.attention_out_bias=true",
           "model.moe_bias=true", "model.swiglu_limit=0.05", "model.sliding_window=[8,null,8,null]"]
LAYOUTS = {
    "tp2_cp2": (4, ["parallel.tp=2", "parallel.cp=2"]),
    "tp2_sp": (2, ["parallel.tp=2", "parallel.sequence_parallel=true"]),
    "tp4_shared_kv": (4, ["parallel.tp=4"]),  # 2 key/value heads over 4 ranks
    "pp2": (2, ["parallel.pp=2"]),
    "cp2_all_gather": (2, ["parallel.cp=2", "parallel.cp_comm=all_gather"]),
    "cp2_a2a": (2, ["parallel.cp=2", "parallel.cp_comm=a2a"]),
    "ep2": (2, ["parallel.ep=2"]),  # dp=2: see DP_REFERENCE
    "dp2_zero3": (2, ["optim.sharding=optim_grads_params"]),
    "tp2_sp_recompute_selective": (2, ["parallel.tp=2", "parallel.sequence_parallel=true",
                                       "train.recompute=selective"]),
    "cp2_recompute_full": (2, ["parallel.cp=2", "train.recompute=full"]),
}
FIRST = "tp2_cp2"
# the balancing losses are over each micro-batch's global tokens (every dp rank's micro-batch of that index): the
# reference of dp=2 ranks running micro-batches of 2 runs micro-batches of 4
DP_REFERENCE = {"ep2": ["train.micro_batch_size=4"], "dp2_zero3": ["train.micro_batch_size=4"]}


def _check(reference, launch, layout):
    nproc, overrides = LAYOUTS[layout]
    assert_parity(reference("tiny_llama", *GPT_OSS, *DP_REFERENCE.get(layout, [])),
                  launch("tiny_llama", nproc, *GPT_OSS, *overrides))


def test_gpt_oss_matches_one_process(reference, launch):
    _check(reference, launch, FIRST)


@pytest.mark.slow
@pytest.mark.parametrize("layout", [name for name in LAYOUTS if name != FIRST])
def test_gpt_oss_matrix_matches_one_process(reference, launch, layout):
    _check(reference, launch, layout)
