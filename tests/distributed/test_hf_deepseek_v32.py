"""DeepSeek-V3.2 end to end: a tiny random ``DeepseekV32ForCausalLM`` written by transformers' own
``save_pretrained`` (DeepSeek-V3's latent attention and sigmoid-router MoE, plus DeepSeek Sparse Attention:
each layer's lightning indexer selects 6 of up to 32 keys per query) is imported; its logits and greedy
generation (through the latent and indexer-key caches) equal transformers'; a training run that names no model
key has a first-step loss equal to transformers' loss on the same batch (1e-5 relative) on one process, at
cp=2 (each query's top-k over keys held by the other rank), at tp=2 x pp=2 and at ep=2; exported back, every
tensor equals the files'.

The indexer's score is a weighted sum of ReLUs: a pair whose every indexer head is negative scores exactly 0,
and transformers' ``topk`` breaks such ties as it likes (megand: towards the earlier key). The model has 16
indexer heads, so that no exact tie falls at a top-k boundary of these sequences."""

import pytest
import torch
import transformers

from megand.core.checkpointing import offline
from megand.models import full
from megand.tools import convert_checkpoint
from tests.distributed.test_hf_deepseek_v3 import SHAPE
from tests.harness import read_metrics, run_pretrain
from tests.hf_checks import (assert_generation_and_export_equal, first_step_loss_equals_transformers,
                             save_and_import)


def config(**changes):
    return transformers.DeepseekV32Config(**{**SHAPE, "index_topk": 6, "index_n_heads": 16, "index_head_dim": 16,
                                             **changes})


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    return save_and_import(lambda: transformers.DeepseekV32ForCausalLM(config()), tmp_path_factory.mktemp("deepseek_v32"))


def test_logits_generation_and_export_equal_transformers(imported, tmp_path, capsys):
    theirs, hf_dir, ckpt = imported
    ids = torch.randint(0, 251, (2, 24), generator=torch.Generator().manual_seed(1))
    ours, _ = full.load_model(ckpt, offline.single_process_topology())
    with torch.no_grad():
        torch.testing.assert_close(ours(input_ids=ids), theirs(ids).logits, rtol=1e-5, atol=1e-5)
        dense = transformers.DeepseekV32ForCausalLM(config(index_topk=32)).eval()
        dense.load_state_dict(theirs.state_dict())
        assert (dense(ids).logits - theirs(ids).logits).abs().max() > 1e-3  # the selection does change the model
    assert_generation_and_export_equal(theirs, hf_dir, ckpt, str(tmp_path / "back"), capsys,
                                       prompt=ids[0, :8].tolist())


@pytest.mark.parametrize("changes, needle", [({"mlp_bias": True}, "mlp_bias=true"),
                                             ({"mlp_layer_types": ["sparse"] * 4}, "mlp_layer_types=")])
def test_import_refuses_what_megand_cannot_express_in_one_line(changes, needle, tmp_path, capsys):
    transformers.DeepseekV32ForCausalLM(config(**changes)).save_pretrained(str(tmp_path / "hf"))
    capsys.readouterr()
    assert convert_checkpoint.main(["import", "--hf", str(tmp_path / "hf"), "--save", str(tmp_path / "ckpt")]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and needle in err[0], err


LAYOUTS = {"one": (1, []), "cp2": (2, ["parallel.cp=2"]), "cp2_tp2_sp": (4, ["parallel.cp=2", "parallel.tp=2",
                                                                               "parallel.sequence_parallel=true"]),
           "tp2_pp2": (4, ["parallel.tp=2", "parallel.pp=2"]), "ep2": (2, ["parallel.ep=2"])}


@pytest.mark.parametrize("layout", ["one", "cp2", pytest.param("cp2_tp2_sp", marks=pytest.mark.slow),
                                    pytest.param("tp2_pp2", marks=pytest.mark.slow),
                                    pytest.param("ep2", marks=pytest.mark.slow)])
def test_first_step_loss_equals_transformers(layout, imported, tmp_path):
    theirs, _, ckpt = imported
    nproc, overrides = LAYOUTS[layout]
    first_step_loss_equals_transformers(f"deepseek_v32 {layout}", theirs, ckpt, nproc, overrides, tmp_path)


# large enough that the indexer's gradients move the global norm by ~10%: its equality then checks them too
INDEXER_LOSS = ["model.dsa_indexer_loss_coeff=1000"]


@pytest.fixture(scope="module")
def indexer_loss_reference(imported, tmp_path_factory):
    """One process, the indexer loss on: the first step's record."""
    run_dir = str(tmp_path_factory.mktemp("indexer_loss_one") / "run")
    run_pretrain(run_dir, [f"checkpoint.load={imported[2]}", "train.iters=1", "train.eval_iters=0", *INDEXER_LOSS])
    return read_metrics(run_dir)[0]


@pytest.mark.parametrize("layout", ["cp2", pytest.param("cp2_tp2_sp", marks=pytest.mark.slow),
                                    pytest.param("tp2_pp2", marks=pytest.mark.slow)])
def test_indexer_loss_and_its_gradients_equal_one_process(layout, imported, indexer_loss_reference, tmp_path):
    """With the indexer loss on, the LM loss is unchanged (the indexer's inputs and the target are detached
    from the main model), and the indexer loss and the global gradient norm (the indexer's gradients come only
    from that loss) equal the one-process run's."""
    theirs, _, ckpt = imported
    nproc, overrides = LAYOUTS[layout]
    run_dir = str(tmp_path / "run")
    run_pretrain(run_dir, [f"checkpoint.load={ckpt}", "train.iters=1", "train.eval_iters=0", *INDEXER_LOSS,
                           *overrides], nproc=nproc)
    ours, one = read_metrics(run_dir)[0], indexer_loss_reference
    print(f"deepseek_v32 indexer loss {layout}: {ours['indexer_loss']:.8f} (one process {one['indexer_loss']:.8f}), "
          f"grad norm {ours['grad_norm']:.8f} ({one['grad_norm']:.8f})")
    assert one["indexer_loss"] > 0
    for key in ("loss", "indexer_loss", "grad_norm"):
        assert abs(ours[key] - one[key]) <= 1e-5 * abs(one[key]), (key, ours[key], one[key])


@pytest.mark.slow
def test_documents_restart_the_selection_at_cp2_with_selective_recompute(imported, tmp_path):
    """Documents (``data.reset_attention_mask``) restart each query's top-k; with selective recomputation and the
    indexer loss, two steps at cp=2 equal the one-process run (loss, indexer loss, grad norm)."""
    common = [f"checkpoint.load={imported[2]}", "train.iters=2", "train.eval_iters=0", "data.reset_attention_mask=true",
              "data.reset_position_ids=true", "train.recompute=selective", *INDEXER_LOSS]
    records = {}
    for nproc, extra in ((1, []), (2, ["parallel.cp=2"])):
        run_pretrain(str(tmp_path / f"run{nproc}"), [*common, *extra], nproc=nproc)
        records[nproc] = [r for r in read_metrics(str(tmp_path / f"run{nproc}")) if "loss" in r]
    plain = str(tmp_path / "plain")
    run_pretrain(plain, [f"checkpoint.load={imported[2]}", "train.iters=1", "train.eval_iters=0"])
    assert records[1][0]["loss"] != read_metrics(plain)[0]["loss"]  # the documents change the model's input
    # the protocol's tolerances: step 1 1e-5, later steps 1e-4 (Adam's first update turns fp32 noise in the
    # indexer's near-zero gradients into ~3e-5 of the second step's tiny indexer loss, on either attention path)
    for tol, one, cp in zip((1e-5, 1e-4), records[1], records[2]):
        for key in ("loss", "indexer_loss", "grad_norm"):
            assert abs(cp[key] - one[key]) <= tol * abs(one[key]), (key, cp[key], one[key])


@pytest.mark.slow
def test_indexer_loss_under_uneven_batch_shares_equals_one_process(imported, tmp_path):
    """Replicas taking 1 and 3 micro-batches (``parallel.dp_microbatches``): the indexer loss is the mean over
    every replica's micro-batches, as on one process (the metric once counted only the first replica's)."""
    common = [f"checkpoint.load={imported[2]}", "train.iters=1", "train.eval_iters=0", "train.global_batch_size=4",
              "train.micro_batch_size=1", *INDEXER_LOSS]
    run_pretrain(str(tmp_path / "one"), common)
    run_pretrain(str(tmp_path / "shares"), [*common, "parallel.dp_microbatches=[1,3]"], nproc=2)
    one, ours = (read_metrics(str(tmp_path / d))[0] for d in ("one", "shares"))
    for key in ("loss", "indexer_loss", "grad_norm"):
        assert abs(ours[key] - one[key]) <= 1e-5 * abs(one[key]), (key, ours[key], one[key])
