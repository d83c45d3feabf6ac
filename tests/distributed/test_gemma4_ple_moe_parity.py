"""Gemma 4's per-layer input embeddings and MoE block reproduce the one-process run over ten steps (the parity
tolerances of tests/harness.py): each layer's table split by vocab rows over tp and held on its own stage, the
projected word embedding carried over the pipeline links (interleaved chunks too), per-token over cp, the routed
experts beside the dense MLP over ep, ZeRO-3 and full recompute. The default suite holds these features through
the transformers check of tests/distributed/test_hf_gemma4.py (its ple_moe model at tp=2 x pp=2 with sp); this
matrix is slow."""

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader

from megand.core.checkpointing.files import resolve
from megand.core.checkpointing.offline import load_full_tensors
from tests.harness import assert_parity, run_pretrain

GEMMA4_BLOCKS = ["model.activation=geglu", "model.norm_placement=sandwich", "model.embedding_scale=true",
                 "model.per_layer_input_size=8", "model.num_experts=4", "model.moe_top_k=2",
                 "model.moe_ffn_hidden_size=32", "model.moe_beside_mlp=true", "model.moe_aux_loss_coeff=0.01",
                 "model.tie_embeddings=true"]
LAYOUTS = {
    "tp2_sp": (2, ["parallel.tp=2", "parallel.sequence_parallel=true"]),
    "pp2": (2, ["parallel.pp=2"]),
    "pp2_vpp2": (2, ["parallel.pp=2", "parallel.vpp=2"]),
    "tp2_pp2_sp": (4, ["parallel.tp=2", "parallel.pp=2", "parallel.sequence_parallel=true"]),
    "cp2": (2, ["parallel.cp=2"]),
    "ep2": (2, ["parallel.ep=2"]),
    "tp2_sp_ep2": (4, ["parallel.tp=2", "parallel.sequence_parallel=true", "parallel.ep=2"]),
    "tp2_etp1": (2, ["parallel.tp=2", "parallel.etp=1"]),  # each tp rank routes its share of the tokens
    "dp2_zero3": (2, ["optim.sharding=optim_grads_params"]),
    "tp2_sp_recompute_full": (2, ["parallel.tp=2", "parallel.sequence_parallel=true", "train.recompute=full"]),
}
# the balancing losses are over each micro-batch's global tokens (every dp rank's micro-batch of that index): the
# reference of dp=2 ranks running micro-batches of 2 runs micro-batches of 4
DP_REFERENCE = {"ep2": ["train.micro_batch_size=4"], "tp2_sp_ep2": ["train.micro_batch_size=4"],
                "dp2_zero3": ["train.micro_batch_size=4"]}


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS)
def test_gemma4_blocks_match_one_process(reference, launch, layout):
    nproc, overrides = LAYOUTS[layout]
    assert_parity(reference("tiny_llama", *GEMMA4_BLOCKS, *DP_REFERENCE.get(layout, [])),
                  launch("tiny_llama", nproc, *GEMMA4_BLOCKS, *overrides))


def _moments_after_one_step(run_dir, nproc, overrides):
    save = str(run_dir / "ckpt")
    run_pretrain(run_dir, ["+experiment=tiny_llama", "train.iters=1", "train.eval_iters=0", f"checkpoint.save={save}",
                           *GEMMA4_BLOCKS, *overrides], nproc=nproc, reference=nproc == 1)
    return save, load_full_tensors(save, prefix="optim.")


@pytest.mark.slow
def test_gemma4_blocks_step_one_gradients_match_per_tensor(tmp_path):
    """tp=2 x pp=2 with sp: every tensor's step-1 gradient (AdamW's first moment) equals the one-process run's,
    each layer's table included (read back whole from the stages' vocab shards: layout-free, once each)."""
    _, ref = _moments_after_one_step(tmp_path / "one", 1, ())
    save, run = _moments_after_one_step(tmp_path / "tp2_pp2", 4, LAYOUTS["tp2_pp2_sp"][1])
    moments = sorted(k for k in ref if k.endswith(".exp_avg"))
    assert sorted(k for k in run if k.endswith(".exp_avg")) == moments
    assert {f"layers.{i}.per_layer_input.embedding.weight.exp_avg" for i in range(4)} <= set(moments)
    for key in moments:
        diff = (run[key] - ref[key]).norm() / ref[key].norm().clamp_min(1e-30)
        assert diff <= 5e-6, f"{key}: relative difference {diff:.2e}"
    meta = FileSystemReader(resolve(save)).read_metadata().state_dict_metadata
    for i in range(4):  # the vocab shards of the two tp ranks: the table once, no padding rows
        key = f"model.layers.{i}.per_layer_input.embedding.weight"
        assert sum(torch.Size(c.sizes).numel() for c in meta[key].chunks) == 251 * 8, key
