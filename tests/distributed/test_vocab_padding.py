"""The vocabulary padded to a multiple of ``model.make_vocab_size_divisible_by`` x tp: vocab 250 with the
multiple 12 is 252 rows at tp=1 and 264 at tp=2 (132 per rank: 132 and 118 real rows), so the padding
differs per layout. Parity with the one-process run (tied and untied output layers; tp ranks that hold
only padding rows), a checkpoint saved
at tp=2 resumed at tp=1 and exported to Hugging Face with unpadded shapes, and generation never choosing
a padding column."""

import pytest
import torch
import transformers

from megand.core.checkpointing import offline
from megand.models import full
from megand.tools import convert_checkpoint, generate
from tests.harness import assert_parity, read_metrics, run_pretrain

PADDED = ["model.vocab_size=250", "model.make_vocab_size_divisible_by=12"]


@pytest.mark.parametrize("experiment", [pytest.param("tiny_gpt", marks=pytest.mark.slow), "tiny_llama"])  # tied / untied output layer
def test_padded_vocab_tp2_matches_one_process(reference, launch, experiment):
    assert_parity(reference(experiment, *PADDED), launch(experiment, 2, "parallel.tp=2", *PADDED))


@pytest.mark.slow
def test_ranks_holding_only_padding_match_one_process(reference, launch):
    """Vocab 250 with the default multiple (128) at tp=4: 512 rows, ranks 2 and 3 hold padding only."""
    assert_parity(reference("tiny_gpt", "model.vocab_size=250"), launch("tiny_gpt", 4, "parallel.tp=4", "model.vocab_size=250"))


def test_checkpoint_saved_at_tp2_is_unpadded_and_resumes_at_tp1(tmp_path, capsys):
    model_args = ["+experiment=tiny_llama", *PADDED]
    saved = run_pretrain(str(tmp_path / "tp2"), [*model_args, "parallel.tp=2", f"checkpoint.save={tmp_path}/ckpt",
                                                 "checkpoint.interval=5"], nproc=2)
    assert "saved checkpoint at iteration 5" in saved.stdout
    tensors = offline.load_full_tensors(f"{tmp_path}/ckpt/iter_0000005")
    assert tensors["embedding.word.weight"].shape == (250, 64)
    assert tensors["output_layer.weight"].shape == (250, 64)

    # resumed at tp=1 (252 rows): the continuation of the tp=2 run
    run_pretrain(str(tmp_path / "tp1"), [*model_args, f"checkpoint.load={tmp_path}/ckpt/iter_0000005"], nproc=1)
    ref, run = read_metrics(str(tmp_path / "tp2"))[5:], read_metrics(str(tmp_path / "tp1"))
    assert [r["iter"] for r in run] == [6, 7, 8, 9, 10]
    assert_parity(ref, run, steps=5)

    # Hugging Face: unpadded shapes, the same logits
    topo = offline.single_process_topology()
    model, _ = full.load_model(f"{tmp_path}/ckpt", topo)
    assert model.output_layer.weight.shape == (252, 64)  # padded at tp=1
    hf_dir = str(tmp_path / "hf")
    assert convert_checkpoint.main(["export", "--load", f"{tmp_path}/ckpt", "--out", hf_dir, "--dtype", "fp32"]) == 0
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    assert hf.config.vocab_size == 250 and hf.lm_head.weight.shape == (250, 64)
    ids = torch.randint(0, 250, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours, theirs = model(input_ids=ids), hf(input_ids=ids).logits
    assert ours.shape == theirs.shape == (2, 32, 250)
    assert (ours - theirs).abs().max().item() <= 1e-4

    # generation never picks a padding column, even one whose logit would win
    with torch.no_grad():
        model.output_layer.weight[250:] = 100.0 * model.output_layer.weight[:250].abs().max()
        assert model.logits(torch.ones(1, 1, 64)).argmax(-1).item() >= 250  # the padding would win unmasked
    out = generate.generate(model, ids[0, :4].tolist(), 8)
    assert len(out) == 12 and max(out) < 250, out
    capsys.readouterr()
    assert generate.main(["--load", f"{tmp_path}/ckpt", "--ids", "5", "17", "--max-new-tokens", "8"]) == 0
    assert all(int(t) < 250 for t in capsys.readouterr().out.split())
