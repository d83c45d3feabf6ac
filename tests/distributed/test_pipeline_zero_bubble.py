"""Zero-bubble pipeline schedules (``parallel.pp_schedule``) match the one-process reference (the parity
tolerances of tests/harness.py), fp32: each backward split into its input-gradient pass and a deferred
weight-gradient pass, the data-parallel engine counting each parameter's gradients; ZB-V and DualPipeV on
the V placement (the loss on pipeline rank 0, which holds both copies of a tied embedding).

One case per schedule runs by default; the matrix (pp=4, tp=2 with sequence parallelism, dp=2 under
ZeRO-1 and ZeRO-3, MoE, recompute, an uneven layout) is marked slow.
"""

import pytest

from tests.harness import assert_parity, read_metrics, run_pretrain

PP2, PP4, V = ["parallel.pp=2"], ["parallel.pp=4"], ["parallel.vpp=2"]
ZB1P, ZBV, DUALPIPEV = ["parallel.pp_schedule=zb1p"], ["parallel.pp_schedule=zbv"], ["parallel.pp_schedule=dualpipev"]
TP2_SP = ["parallel.tp=2", "parallel.sequence_parallel=true"]
DP2 = ["parallel.dp=2", "optim.overlap_grad_reduce=true"]
ZERO1, ZERO3 = ["optim.sharding=optim"], ["optim.sharding=optim_grads_params"]
MOE = ["model.num_experts=4", "model.moe_ffn_hidden_size=64", "model.moe_shared_experts=1",
       "model.moe_aux_loss_coeff=0.01"]
EIGHT_LAYERS = ["model.num_layers=8"]  # pp=4 x vpp=2: one layer per virtual stage
MBS1 = ["train.micro_batch_size=1"]  # 8 micro-batches: dualpipev needs 2*pp of them

# name: (arch, processes, overrides, what the one-process reference shares: model and batch keys)
CASES = {
    "zb1p_pp2_dp2_zero3": ("llama", 4, ZB1P + PP2 + DP2 + ZERO3, []),
    "zbv_pp2": ("gpt", 2, ZBV + PP2 + V, []),
    "dualpipev_pp2_dp2_zero1": ("llama", 4, DUALPIPEV + PP2 + V + DP2 + ZERO1 + MBS1, MBS1),
    "zb1p_pp2": ("gpt", 2, ZB1P + PP2, []),
    "zb1p_pp4": ("gpt", 4, ZB1P + PP4, []),
    "zb1p_pp2_tp2_sp": ("llama", 4, ZB1P + PP2 + TP2_SP, []),
    "zb1p_pp2_dp2_zero1": ("gpt", 4, ZB1P + PP2 + DP2 + ZERO1, []),
    "zb1p_pp2_dp2": ("llama", 4, ZB1P + PP2 + DP2, []),
    "zb1p_pp2_recompute_full": ("llama", 2, ZB1P + PP2 + ["train.recompute=full"], []),
    "zb1p_pp2_uneven_3_1": ("gpt", 2, ZB1P + PP2 + ["parallel.pipeline_layout=[3,1]"], []),
    "zb1p_pp2_moe": ("gpt", 2, ZB1P + PP2 + MOE, MOE),
    # 2 micro-batches of 2 per dp rank: the balancing losses' reference has micro-batches of dp x 2
    "zb1p_pp2_moe_ep2": ("gpt", 4, ZB1P + PP2 + MOE + ["parallel.dp=2", "parallel.ep=2"],
                         MOE + ["train.micro_batch_size=4"]),
    "zbv_pp4": ("gpt", 4, ZBV + PP4 + V + EIGHT_LAYERS, EIGHT_LAYERS),
    "zbv_pp2_llama": ("llama", 2, ZBV + PP2 + V, []),
    "zbv_pp2_tp2_sp": ("llama", 4, ZBV + PP2 + V + TP2_SP, []),
    "zbv_pp2_dp2_zero1": ("gpt", 4, ZBV + PP2 + V + DP2 + ZERO1, []),
    "zbv_pp2_dp2_zero3": ("gpt", 4, ZBV + PP2 + V + DP2 + ZERO3, []),
    "zbv_pp2_moe": ("gpt", 2, ZBV + PP2 + V + MOE, MOE),
    "zbv_pp2_recompute_full": ("gpt", 2, ZBV + PP2 + V + ["train.recompute=full"], []),
    "zbv_pp2_uneven": ("gpt", 2, ZBV + PP2 + V + ["parallel.pipeline_layout=[2,1,1,0]"], []),
    "dualpipev_pp2": ("gpt", 2, DUALPIPEV + PP2 + V, []),
    "dualpipev_pp4": ("gpt", 4, DUALPIPEV + PP4 + V + EIGHT_LAYERS + MBS1, EIGHT_LAYERS + MBS1),
    "dualpipev_pp2_tp2_sp": ("llama", 4, DUALPIPEV + PP2 + V + TP2_SP, []),
    "dualpipev_pp2_dp2_zero3": ("gpt", 4, DUALPIPEV + PP2 + V + DP2 + ZERO3 + MBS1, MBS1),
    "dualpipev_pp2_moe": ("gpt", 2, DUALPIPEV + PP2 + V + MOE, MOE),
    "dualpipev_pp2_recompute_selective": ("llama", 2, DUALPIPEV + PP2 + V + ["train.recompute=selective"], []),
    "dualpipev_pp2_uneven": ("gpt", 2, DUALPIPEV + PP2 + V + ["parallel.pipeline_layout=[1,2,0,1]"], []),
}
DEFAULT = {"zb1p_pp2_dp2_zero3", "zbv_pp2", "dualpipev_pp2"}
PARAMS = [pytest.param(name, id=name, marks=() if name in DEFAULT else pytest.mark.slow) for name in CASES]


@pytest.mark.parametrize("name", PARAMS)
def test_zero_bubble_matches_reference(name, reference_dir, tmp_path):
    arch, nproc, overrides, shared = CASES[name]
    reference = reference_dir(f"tiny_{arch}", *shared)
    run_pretrain(tmp_path, [f"+experiment=tiny_{arch}", *overrides], nproc=nproc)
    assert_parity(read_metrics(reference), read_metrics(tmp_path))

