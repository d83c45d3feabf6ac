"""Hugging Face interoperability : a tiny llama and a tiny gpt trained at tp=2, exported, loaded by
transformers: same logits (fp32, max abs diff <= 1e-4); imported back: identical megand logits; greedy
tools/generate.py == transformers' greedy generate for 20 tokens. The imported llama also trains at tp=2."""

import os
import sys

import pytest
import torch

from megand.core.checkpointing import offline
from megand.models import full
from tests.harness import read_metrics, run_pretrain

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tools"))

import convert_checkpoint  # noqa: E402
import generate  # noqa: E402

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def topo():
    return offline.single_process_topology()


@pytest.fixture(scope="module", params=["tiny_llama", "tiny_gpt"])
def trained(request, tmp_path_factory):
    """A checkpoint trained 3 steps at tp=2 (vocab 251: uneven, padded shards)."""
    root = tmp_path_factory.mktemp(request.param)
    run_pretrain(str(root / "run"), [f"+experiment={request.param}", "parallel.tp=2", "train.iters=3",
                                     f"checkpoint.save={root}/ckpt"], nproc=2)
    return request.param, root


def megand_logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids)


def test_export_import_generate(trained, topo, capsys):
    name, root = trained
    model, _ = full.load_model(f"{root}/ckpt", topo)
    vocab = model.cfg.vocab_size
    ids = torch.randint(0, vocab, (2, model.cfg.seq_length), generator=torch.Generator().manual_seed(0))
    ours = megand_logits(model, ids)

    assert convert_checkpoint.main(["export", "--load", f"{root}/ckpt", "--out", f"{root}/hf"]) == 0
    assert os.path.isfile(f"{root}/hf/model.safetensors") and os.path.isfile(f"{root}/hf/config.json")
    theirs_model = transformers.AutoModelForCausalLM.from_pretrained(f"{root}/hf", dtype=torch.float32).eval()
    expected_cls = "LlamaForCausalLM" if name == "tiny_llama" else "GPT2LMHeadModel"
    assert type(theirs_model).__name__ == expected_cls
    with torch.no_grad():
        theirs = theirs_model(input_ids=ids).logits
    assert (ours - theirs).abs().max().item() <= 1e-4

    assert convert_checkpoint.main(["import", "--hf", f"{root}/hf", "--save", f"{root}/imported"]) == 0
    back, _ = full.load_model(f"{root}/imported", topo)
    assert torch.equal(megand_logits(back, ids), ours)

    prompt = ids[0, :8].tolist()
    with torch.no_grad():
        hf_out = theirs_model.generate(torch.tensor([prompt]), max_new_tokens=20, min_new_tokens=20, do_sample=False,
                                       pad_token_id=0)[0].tolist()
    capsys.readouterr()
    assert generate.main(["--load", f"{root}/ckpt", "--ids", *map(str, prompt), "--max-new-tokens", "20"]) == 0
    assert capsys.readouterr().out.split() == [str(t) for t in hf_out]
    assert len(hf_out) == len(prompt) + 20

    if name == "tiny_llama":  # a text prompt through a sentencepiece tokenizer (vocab 200 <= 251), sampled
        from megand.data.tokenizer import SentencePieceTokenizer
        from tests.unit.data_helpers import train_small_tokenizer

        tok_path = train_small_tokenizer(root, vocab_size=200)
        args = ["--load", f"{root}/ckpt", "--prompt", "The data", "--tokenizer", tok_path, "--max-new-tokens", "5",
                "--temperature", "0.8", "--top-k", "20", "--seed", "3"]
        outputs = []
        for _ in range(2):
            assert generate.main(args) == 0
            outputs.append(capsys.readouterr().out.strip())
        assert outputs[0] == outputs[1] and outputs[0].startswith("The data")  # seeded sampling is reproducible
        assert len(SentencePieceTokenizer(tok_path).encode(outputs[0])) > len(SentencePieceTokenizer(tok_path).encode("The data"))


def test_imported_model_trains_at_another_layout(trained, topo, tmp_path):
    """The imported checkpoint (no optimizer state) loads at tp=2 and step 1's loss is the loss of its weights."""
    name, root = trained
    if name != "tiny_llama":
        pytest.skip("one training launch is enough")
    if not os.path.isdir(f"{root}/imported"):
        pytest.skip("needs test_export_import_generate's import")
    run_dir = str(tmp_path / "run")
    proc = run_pretrain(run_dir, [f"+experiment={name}", "parallel.tp=2", "train.iters=1",
                                  f"checkpoint.load={root}/imported"], nproc=2)
    assert "optimizer state: no" in proc.stdout
    loss = read_metrics(run_dir)[0]["loss"]
    # the same first batch through the imported weights in one process
    from omegaconf import OmegaConf

    from megand.training.pretrain import build_datasets

    cfg = OmegaConf.load(f"{root}/run/config.yaml")
    train, _ = build_datasets(cfg, topo)
    model, _ = full.load_model(f"{root}/imported", topo)
    tokens = torch.stack([torch.as_tensor(train[i], dtype=torch.long) for i in range(cfg.train.global_batch_size)])
    with torch.no_grad():
        expected = model(input_ids=tokens[:, :-1], labels=tokens[:, 1:]).mean().item()
    assert abs(loss - expected) / expected <= 1e-5
