"""tools/generate.py in one process: the KV cache changes the cost, never the tokens (also past the
window); the run's relative tokenizer path is found from any directory; a tokenizer larger than the
model's vocabulary is warned about; a tokenizer found nowhere is one line and exit code 2."""

import os

import pytest
import torch
import torch.distributed as dist

from megand.core.checkpointing import CheckpointError, files, offline
from megand.core.transformer.kv_cache import KVCache
from megand.models import full
from megand.tools import generate
from tests.unit.data_helpers import train_small_tokenizer

LLAMA = dict(arch="llama", num_layers=2, hidden_size=64, ffn_hidden_size=96, num_attention_heads=4, num_query_groups=2,
             seq_length=32, vocab_size=251, norm="rmsnorm", activation="swiglu", position_embedding="rope",
             rope_theta=10000.0, tie_embeddings=False, init_std=0.02, hidden_dropout=0.0, attention_dropout=0.0)
GPT = dict(LLAMA, arch="gpt", num_query_groups=None, ffn_hidden_size=256, norm="layernorm", activation="gelu",
           position_embedding="learned", tie_embeddings=True)
# latent attention (its cache holds the latents): a query latent, value heads narrower than query/key heads
MLA = dict(LLAMA, num_query_groups=None, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=12, qk_rope_head_dim=8,
           v_head_dim=10)


@pytest.fixture(scope="module")
def topo():
    yield offline.single_process_topology()
    dist.destroy_process_group()  # leave no process group to the next module


@pytest.mark.parametrize("model_cfg", [LLAMA, GPT, MLA], ids=["llama", "gpt", "mla"])
def test_cached_decoding_gives_the_logits_of_the_full_forward(model_cfg, topo, tmp_path):
    full.save_random_model(str(tmp_path / "ckpt"), model_cfg, seed=3)
    model, _ = full.load_model(str(tmp_path / "ckpt"), topo)
    ids = torch.randint(0, 251, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        whole = model(input_ids=ids)
        cache = KVCache(model.cfg, 2, 32, torch.float32, topo.device, model.layer_ids, model.layers)
        steps = [model(input_ids=ids[:, :5], kv_cache=cache)]  # prefill
        steps.append(model(input_ids=ids[:, 5:8], kv_cache=cache))  # several tokens after a cached prefix
        steps += [model(input_ids=ids[:, i:i + 1], kv_cache=cache) for i in range(8, 12)]
    torch.testing.assert_close(torch.cat(steps, dim=1), whole, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("model_cfg", [LLAMA, GPT], ids=["llama", "gpt"])
def test_kv_cache_gives_the_tokens_of_full_windows(model_cfg, topo, tmp_path):
    full.save_random_model(str(tmp_path / "ckpt"), model_cfg, seed=4)
    model, _ = full.load_model(str(tmp_path / "ckpt"), topo)
    prompt = list(range(7, 27))  # 20 tokens + 24 new ones: crosses the 32-token window
    cached = generate.generate(model, prompt, 24, kv_cache=True)
    assert cached == generate.generate(model, prompt, 24, kv_cache=False)
    assert len(cached) == 44


def write_run(root, model_cfg, tokenizer):
    """A checkpoint as a run launched from ``root`` leaves it: relative tokenizer and save paths."""
    iter_dir = full.save_random_model(str(root / "ckpts" / "run"), model_cfg)
    with open(os.path.join(iter_dir, "config.yaml"), "a") as f:
        f.write(f"data:\n  tokenizer: {tokenizer}\ncheckpoint:\n  save: ckpts/run\n")
    return iter_dir


def test_relative_tokenizer_of_the_run_is_found_from_another_directory(tmp_path, capsys, monkeypatch):
    launch = tmp_path / "launch"
    (launch / "tok").mkdir(parents=True)
    train_small_tokenizer(launch / "tok", vocab_size=200)
    write_run(launch, LLAMA, "tok/tok.model")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    for load in (str(launch / "ckpts" / "run"), files.resolve(str(launch / "ckpts" / "run"))):
        capsys.readouterr()
        assert generate.main(["--load", load, "--prompt", "The data", "--max-new-tokens", "3"]) == 0
        out = capsys.readouterr()
        assert out.out.startswith("The data") and "tokens/s" in out.err


def test_tokenizer_found_nowhere_is_one_line(tmp_path, capsys, monkeypatch):
    write_run(tmp_path, LLAMA, "tok/missing.model")
    monkeypatch.chdir(tmp_path / "ckpts")
    capsys.readouterr()
    assert generate.main(["--load", str(tmp_path / "ckpts" / "run"), "--prompt", "Hi", "--max-new-tokens", "2"]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and "data.tokenizer=tok/missing.model" in err[0] and "--tokenizer" in err[0]


def test_warns_when_the_tokenizer_vocabulary_exceeds_the_model(tmp_path, capsys):
    tok = train_small_tokenizer(tmp_path, vocab_size=200)
    small = dict(LLAMA, vocab_size=120)
    write_run(tmp_path, small, tok)
    capsys.readouterr()
    assert generate.main(["--load", str(tmp_path / "ckpts" / "run"), "--tokenizer", tok, "--ids", "5", "6",
                          "--max-new-tokens", "2"]) == 0
    warnings = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    assert len(warnings) == 1 and "200" in warnings[0] and "vocab_size=120" in warnings[0]


def test_missing_tokenizer_file_is_one_line(tmp_path, capsys):
    write_run(tmp_path, LLAMA, "tok.model")
    capsys.readouterr()
    missing = str(tmp_path / "nope.model")
    assert generate.main(["--load", str(tmp_path / "ckpts" / "run"), "--tokenizer", missing, "--prompt", "Hi"]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and missing in err[0]


def test_full_model_routes_with_the_checkpoints_balancing_bias(topo, tmp_path):
    """A sigmoid-router checkpoint holds each router's aux-loss-free bias (a persistent buffer,
    ``mlp.router.expert_bias``): the one-process model that generation uses loads it, and a checkpoint
    without it is refused like a missing weight."""
    m = dict(LLAMA, num_experts=4, moe_top_k=2, moe_ffn_hidden_size=32, moe_router="sigmoid")
    shapes = {n: (tuple(meta.full_shape), torch.float32) for n, meta in full.param_metas(m).items()}
    biases = {f"layers.{i}.mlp.router.expert_bias": torch.tensor([0.0, 5.0, -5.0, 5.0 * i]) for i in range(2)}
    generator = torch.Generator().manual_seed(0)

    def produce(name):
        return biases[name].clone() if name in biases else 0.02 * torch.randn(shapes[name][0], generator=generator)

    offline.save_model_streaming(str(tmp_path / "ckpt"), {**shapes, **{n: ((4,), torch.float32) for n in biases}},
                                 produce, "model: {}\n", m)
    from omegaconf import OmegaConf
    (tmp_path / "ckpt" / "iter_0000000" / "config.yaml").write_text(OmegaConf.to_yaml({"model": m}))
    model, _ = full.load_model(str(tmp_path / "ckpt"), topo)
    for name, bias in biases.items():
        assert torch.equal(model.get_buffer(name), bias)
    tensors = offline.load_full_tensors(str(tmp_path / "ckpt"))
    del tensors["layers.1.mlp.router.expert_bias"]
    with pytest.raises(CheckpointError, match="layers.1.mlp.router.expert_bias"):
        full.build_full_model(m, tensors)
