"""Hugging Face interoperability of trained checkpoints: a tiny llama and a tiny gpt trained at tp=2,
exported in fp32, loaded by transformers: same logits (max abs diff <= 1e-4); imported back: identical
megand logits; greedy tools/generate.py (with and without the KV cache) == transformers' greedy generate
for 20 tokens; the same for tiny MoE models (Mixtral and Qwen2-MoE families) trained at tp=2 with sequence
parallelism. A llama exported in bf16 (the default) and imported trains at tp=2. Each test converts
what it needs itself; the trained checkpoints are shared fixtures."""

import os

import pytest
import torch
import transformers

from megand.core.checkpointing import offline
from megand.models import full
from megand.tools import convert_checkpoint, generate
from tests.harness import read_metrics, run_pretrain


@pytest.fixture(scope="module")
def topo():
    return offline.single_process_topology()


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """``trained(name)``: the root of a checkpoint of experiment ``name`` trained 3 steps at tp=2 (vocab 251:
    uneven, padded shards), trained once per module."""
    roots = {}

    def get(name):
        if name not in roots:
            root = tmp_path_factory.mktemp(name)
            run_pretrain(str(root / "run"), [f"+experiment={name}", "parallel.tp=2", "train.iters=3",
                                             f"checkpoint.save={root}/ckpt"], nproc=2)
            roots[name] = root
        return roots[name]

    return get


def megand_logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids)


@pytest.mark.parametrize("name", ["tiny_llama", pytest.param("tiny_gpt", marks=pytest.mark.slow)])
def test_export_import_generate(name, trained, topo, tmp_path, capsys):
    root = trained(name)
    model, _ = full.load_model(f"{root}/ckpt", topo)
    vocab = model.cfg.vocab_size
    ids = torch.randint(0, vocab, (2, model.cfg.seq_length), generator=torch.Generator().manual_seed(0))
    ours = megand_logits(model, ids)

    hf_dir, imported = str(tmp_path / "hf"), str(tmp_path / "imported")
    assert convert_checkpoint.main(["export", "--load", f"{root}/ckpt", "--out", hf_dir, "--dtype", "fp32"]) == 0
    assert os.path.isfile(f"{hf_dir}/model.safetensors") and os.path.isfile(f"{hf_dir}/config.json")
    theirs_model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    expected_cls = "LlamaForCausalLM" if name == "tiny_llama" else "GPT2LMHeadModel"
    assert type(theirs_model).__name__ == expected_cls
    with torch.no_grad():
        theirs = theirs_model(input_ids=ids).logits
    assert (ours - theirs).abs().max().item() <= 1e-4

    assert convert_checkpoint.main(["import", "--hf", hf_dir, "--save", imported]) == 0
    back, _ = full.load_model(imported, topo)
    assert torch.equal(megand_logits(back, ids), ours)

    prompt = ids[0, :8].tolist()
    with torch.no_grad():
        hf_out = theirs_model.generate(torch.tensor([prompt]), max_new_tokens=20, min_new_tokens=20, do_sample=False,
                                       pad_token_id=0)[0].tolist()
    assert len(hf_out) == len(prompt) + 20
    for cache_flag in ([], ["--no-kv-cache"]):
        capsys.readouterr()
        assert generate.main(["--load", f"{root}/ckpt", "--ids", *map(str, prompt), "--max-new-tokens", "20",
                              *cache_flag]) == 0
        assert capsys.readouterr().out.split() == [str(t) for t in hf_out]

    if name == "tiny_llama":  # a text prompt through a sentencepiece tokenizer (vocab 200 <= 251), sampled
        from megand.data.tokenizer import SentencePieceTokenizer
        from tests.unit.data_helpers import train_small_tokenizer

        tok_path = train_small_tokenizer(tmp_path, vocab_size=200)
        args = ["--load", f"{root}/ckpt", "--prompt", "The data", "--tokenizer", tok_path, "--max-new-tokens", "5",
                "--temperature", "0.8", "--top-k", "20", "--seed", "3"]
        outputs = []
        for _ in range(2):
            assert generate.main(args) == 0
            outputs.append(capsys.readouterr().out.strip())
        assert outputs[0] == outputs[1] and outputs[0].startswith("The data")  # seeded sampling is reproducible
        assert len(SentencePieceTokenizer(tok_path).encode(outputs[0])) > len(SentencePieceTokenizer(tok_path).encode("The data"))


def test_imported_model_trains_at_another_layout(trained, topo, tmp_path):
    """An imported checkpoint (bf16, as exported by default; no optimizer state) loads into fp32 training at
    tp=2 and step 1's loss is the loss of its weights."""
    name, root = "tiny_llama", trained("tiny_llama")
    hf_dir, imported = str(tmp_path / "hf"), str(tmp_path / "imported")
    assert convert_checkpoint.main(["export", "--load", f"{root}/ckpt", "--out", hf_dir]) == 0
    assert convert_checkpoint.main(["import", "--hf", hf_dir, "--save", imported]) == 0
    run_dir = str(tmp_path / "run")
    proc = run_pretrain(run_dir, [f"+experiment={name}", "parallel.tp=2", "train.iters=1",
                                  f"checkpoint.load={imported}"], nproc=2)
    assert "optimizer state: no" in proc.stdout
    assert {t.dtype for t in offline.load_full_tensors(imported).values()} == {torch.bfloat16}
    loss = read_metrics(run_dir)[0]["loss"]
    # the same first batch through the imported weights in one process
    from omegaconf import OmegaConf

    from megand.training.core_configs import dataset_plan
    from megand.training.pretrain import build_datasets

    cfg = OmegaConf.load(f"{root}/run/config.yaml")
    train, _ = build_datasets(dataset_plan(cfg), topo)
    model, _ = full.load_model(imported, topo)
    tokens = torch.stack([torch.as_tensor(train[i], dtype=torch.long) for i in range(cfg.train.global_batch_size)])
    with torch.no_grad():
        expected = model(input_ids=tokens[:, :-1], labels=tokens[:, 1:]).mean().item()
    assert abs(loss - expected) / expected <= 1e-5


MOE_FAMILIES = {
    "mixtral": ("MixtralForCausalLM", ["model=moe_tiny"]),
    # gated shared experts, q/k/v biases, a dense layer between MoE layers, Qwen's norm epsilon
    "qwen2_moe": ("Qwen2MoeForCausalLM", ["model=moe_tiny", "model.moe_shared_experts=1",
                                          "model.moe_shared_expert_gate=true", "model.qkv_bias=true",
                                          "model.moe_layer_freq=2", "model.moe_norm_topk_prob=false",
                                          "model.norm_eps=1e-6"]),
}


@pytest.mark.parametrize("family", [pytest.param(f, marks=pytest.mark.slow) if f == "mixtral" else f for f in MOE_FAMILIES])
def test_trained_moe_exports_and_generates_like_transformers(family, topo, tmp_path):
    """A MoE trained 3 steps at tp=2 with sequence parallelism (experts split over tp) exports in fp32 to
    its transformers family: same logits, same greedy tokens (with and without the KV cache); imported back,
    the same megand logits."""
    cls, overrides = MOE_FAMILIES[family]
    run_pretrain(str(tmp_path / "run"), ["+experiment=tiny_llama", *overrides, "parallel.tp=2",
                                         "parallel.sequence_parallel=true", "train.iters=3",
                                         f"checkpoint.save={tmp_path}/ckpt"], nproc=2)
    model, _ = full.load_model(f"{tmp_path}/ckpt", topo)
    ids = torch.randint(0, model.cfg.vocab_size, (2, model.cfg.seq_length), generator=torch.Generator().manual_seed(0))
    ours = megand_logits(model, ids)
    hf_dir, imported = str(tmp_path / "hf"), str(tmp_path / "imported")
    assert convert_checkpoint.main(["export", "--load", f"{tmp_path}/ckpt", "--out", hf_dir, "--dtype", "fp32"]) == 0
    theirs_model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    assert type(theirs_model).__name__ == cls
    with torch.no_grad():
        assert (ours - theirs_model(input_ids=ids).logits).abs().max().item() <= 1e-4
    assert convert_checkpoint.main(["import", "--hf", hf_dir, "--save", imported]) == 0
    assert torch.equal(megand_logits(full.load_model(imported, topo)[0], ids), ours)

    prompt = ids[0, :8].tolist()
    with torch.no_grad():
        expected = theirs_model.generate(torch.tensor([prompt]), max_new_tokens=20, min_new_tokens=20,
                                         do_sample=False, pad_token_id=0)[0].tolist()
    for kv_cache in (True, False):
        assert generate.generate(model, prompt, 20, kv_cache=kv_cache) == expected
