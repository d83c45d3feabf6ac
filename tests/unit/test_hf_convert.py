"""Hugging Face conversion without training: random megand checkpoints (bf16) exported to several
safetensors shards, loaded by transformers (same logits), imported back bit-identical, streaming (no
model built on either side), and every bad input refused up front with exit code 2 and one line."""

import json
import os

import pytest
import torch
import torch.distributed as dist
import transformers
from safetensors import safe_open

from megand.core.checkpointing import offline
from megand.models import full, hf, hf_families
from megand.tools import convert_checkpoint

LLAMA = dict(arch="llama", num_layers=2, hidden_size=64, ffn_hidden_size=96, num_attention_heads=4, num_query_groups=2,
             seq_length=32, vocab_size=251, norm="rmsnorm", activation="swiglu", position_embedding="rope",
             rope_theta=10000.0, tie_embeddings=False, init_std=0.02, hidden_dropout=0.0, attention_dropout=0.0)
GPT = dict(LLAMA, arch="gpt", num_query_groups=None, ffn_hidden_size=256, norm="layernorm", activation="gelu",
           position_embedding="learned", tie_embeddings=True)
MODELS = {"llama": LLAMA, "gpt": GPT}


@pytest.fixture(scope="module")
def topo():
    yield offline.single_process_topology()
    dist.destroy_process_group()  # leave no process group to the next module


def run(capsys, *argv):
    """(exit code, stderr lines) of the converter."""
    capsys.readouterr()
    rc = convert_checkpoint.main(list(argv))
    return rc, [line for line in capsys.readouterr().err.splitlines() if line.strip()]


def snapshot(path):
    """Every file under ``path`` with its bytes: what a refused command must leave unchanged."""
    out = {}
    for root, _, names in os.walk(path):
        for n in names:
            with open(os.path.join(root, n), "rb") as f:
                out[os.path.relpath(os.path.join(root, n), path)] = f.read()
    return out


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("arch", ["llama", "gpt"])
def test_adapter_rules_cover_exactly_the_model_tensors(arch, tied):
    m = dict(MODELS[arch], tie_embeddings=tied)
    rules = hf_families.family_for_model(m).rules(m)
    assert sorted(r.megand for r in rules) == sorted(full.full_shapes(m))
    hf_names = [n for r in rules for n in r.hf]
    assert len(hf_names) == len(set(hf_names))
    # the HF names and shapes are those of the transformers model of the same config
    model = hf.build_hf_model(m)
    theirs = {k: tuple(v.shape) for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")}
    ours = {n: s for r in rules for n, s in r.hf_shapes(full.full_shapes(m)[r.megand]).items()}
    assert ours == theirs


@pytest.mark.parametrize("arch", ["llama", "gpt"])
def test_bf16_round_trip_through_sharded_safetensors(arch, topo, tmp_path, capsys, monkeypatch):
    m = MODELS[arch]
    full.save_random_model(str(tmp_path / "ckpt"), m, torch.bfloat16)
    # streaming: neither side builds a model with weights (megand's shapes come from meta tensors)
    monkeypatch.setattr(full, "build_full_model", lambda *a, **k: pytest.fail("built a full megand model"))
    monkeypatch.setattr(transformers.PreTrainedModel, "__init__", lambda *a, **k: pytest.fail("built a transformers model"))
    loads = []
    real_load = offline.load_tensors
    monkeypatch.setattr(offline, "load_tensors", lambda path, names: loads.append(list(names)) or real_load(path, names))
    assert run(capsys, "export", "--load", str(tmp_path / "ckpt"), "--out", str(tmp_path / "hf"),
               "--max-shard-size", "60KB")[0] == 0
    assert loads and all(len(names) == 1 for names in loads)  # one megand tensor at a time
    assert run(capsys, "import", "--hf", str(tmp_path / "hf"), "--save", str(tmp_path / "back"))[0] == 0
    monkeypatch.undo()

    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) >= 2
    for s in shards:
        with safe_open(str(tmp_path / "hf" / s), "pt") as f:
            assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}
            sizes = [2 * torch.Size(f.get_slice(k).get_shape()).numel() for k in f.keys()]
        assert sum(sizes) <= 60_000 or len(sizes) == 1  # a tensor larger than the limit gets a shard of its own
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config.get("dtype", config.get("torch_dtype")) == "bfloat16"

    before, after = offline.load_full_tensors(str(tmp_path / "ckpt")), offline.load_full_tensors(str(tmp_path / "back"))
    assert sorted(before) == sorted(after)
    assert all(after[k].dtype == torch.bfloat16 and torch.equal(before[k], after[k]) for k in before)

    ours_model, _ = full.load_model(str(tmp_path / "ckpt"), topo)
    theirs_model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32).eval()
    ids = torch.randint(0, m["vocab_size"], (2, m["seq_length"]), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (ours_model(input_ids=ids) - theirs_model(input_ids=ids).logits).abs().max().item() <= 1e-4


def file_dtypes(path):
    with safe_open(str(path), "pt") as f:
        return {f.get_slice(k).get_dtype() for k in f.keys()}


def test_export_writes_bf16_unless_told_and_import_keeps_or_casts(tmp_path, capsys):
    full.save_random_model(str(tmp_path / "ckpt"), LLAMA, torch.float32)  # as training saves: fp32
    assert run(capsys, "export", "--load", str(tmp_path / "ckpt"), "--out", str(tmp_path / "hf"))[0] == 0
    assert file_dtypes(tmp_path / "hf" / "model.safetensors") == {"BF16"}
    assert run(capsys, "export", "--load", str(tmp_path / "ckpt"), "--out", str(tmp_path / "hf32"), "--dtype", "fp32")[0] == 0
    assert file_dtypes(tmp_path / "hf32" / "model.safetensors") == {"F32"}
    assert run(capsys, "import", "--hf", str(tmp_path / "hf32"), "--save", str(tmp_path / "back32"))[0] == 0
    assert {t.dtype for t in offline.load_full_tensors(str(tmp_path / "back32")).values()} == {torch.float32}
    assert run(capsys, "import", "--hf", str(tmp_path / "hf"), "--save", str(tmp_path / "back"), "--dtype", "fp32")[0] == 0
    assert {t.dtype for t in offline.load_full_tensors(str(tmp_path / "back")).values()} == {torch.float32}


def test_import_refuses_a_missing_local_directory_without_downloading(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", lambda *a, **k: pytest.fail("asked transformers"))
    for source in (str(tmp_path / "nope"), "meta-llama/Llama-3.2-1B"):
        rc, err = run(capsys, "import", "--hf", source, "--save", str(tmp_path / "out"))
        assert rc == 2 and len(err) == 1 and source in err[0] and "no such local directory" in err[0]
    assert not (tmp_path / "out").exists()


def test_import_refuses_a_directory_holding_checkpoints_unless_forced(tmp_path, capsys):
    full.save_random_model(str(tmp_path / "ckpt"), LLAMA)
    assert run(capsys, "export", "--load", str(tmp_path / "ckpt"), "--out", str(tmp_path / "hf"))[0] == 0
    full.save_random_model(str(tmp_path / "existing"), GPT)
    before = snapshot(tmp_path / "existing")
    rc, err = run(capsys, "import", "--hf", str(tmp_path / "hf"), "--save", str(tmp_path / "existing"))
    assert rc == 2 and len(err) == 1 and str(tmp_path / "existing") in err[0] and "--force" in err[0]
    assert snapshot(tmp_path / "existing") == before
    assert run(capsys, "import", "--hf", str(tmp_path / "hf"), "--save", str(tmp_path / "existing"), "--force")[0] == 0
    assert full.read_config(str(tmp_path / "existing")).model.arch == "llama"


def test_export_refuses_a_non_empty_output_unless_forced(tmp_path, capsys):
    full.save_random_model(str(tmp_path / "ckpt"), LLAMA)
    out = tmp_path / "hf"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    (out / "model-00001-of-00009.safetensors").write_text("stale shard of an earlier export")
    before = snapshot(out)
    rc, err = run(capsys, "export", "--load", str(tmp_path / "ckpt"), "--out", str(out))
    assert rc == 2 and len(err) == 1 and str(out) in err[0] and "not empty" in err[0]
    assert snapshot(out) == before
    assert run(capsys, "export", "--load", str(tmp_path / "ckpt"), "--out", str(out), "--force")[0] == 0
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors", "notes.txt"]


def test_import_checks_shapes_from_the_config_before_writing(tmp_path, capsys):
    full.save_random_model(str(tmp_path / "ckpt"), LLAMA)
    assert run(capsys, "export", "--load", str(tmp_path / "ckpt"), "--out", str(tmp_path / "hf"))[0] == 0
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    config["intermediate_size"] = 128  # the files hold 96
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    rc, err = run(capsys, "import", "--hf", str(tmp_path / "hf"), "--save", str(tmp_path / "back"))
    assert rc == 2 and len(err) == 1 and "model.layers.0.mlp.gate_proj.weight" in err[0] and "(96, 64)" in err[0]
    assert not (tmp_path / "back" / "latest").exists()


def test_bad_max_shard_size_is_one_line(tmp_path, capsys):
    full.save_random_model(str(tmp_path / "ckpt"), LLAMA)
    rc, err = run(capsys, "export", "--load", str(tmp_path / "ckpt"), "--out", str(tmp_path / "hf"), "--max-shard-size", "lots")
    assert rc == 2 and len(err) == 1 and "'lots'" in err[0]
    assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize("arch", ["llama", "gpt"])
def test_import_of_a_directory_written_by_transformers(arch, topo, tmp_path, capsys):
    """Files that transformers itself wrote (its own sharding and index, bf16, tied weights omitted)."""
    m = MODELS[arch]
    torch.manual_seed(0)
    theirs = hf.build_hf_model(m).to(torch.bfloat16).eval()
    theirs.save_pretrained(str(tmp_path / "hf"), max_shard_size="100KB")
    assert (tmp_path / "hf" / "model.safetensors.index.json").exists()
    assert run(capsys, "import", "--hf", str(tmp_path / "hf"), "--save", str(tmp_path / "ckpt"))[0] == 0
    assert {t.dtype for t in offline.load_full_tensors(str(tmp_path / "ckpt")).values()} == {torch.bfloat16}
    ours, _ = full.load_model(str(tmp_path / "ckpt"), topo)
    ids = torch.randint(0, m["vocab_size"], (2, m["seq_length"]), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = theirs.float()(input_ids=ids).logits
        assert (ours(input_ids=ids) - expected).abs().max().item() <= 1e-4


def test_export_of_a_model_with_mtp_writes_the_main_model_and_says_what_it_left(tmp_path, capsys):
    """Multi-token prediction depths have no Hugging Face module in these families: the export is the main
    model (equal to the same model's export without them) and one line names what was left out."""
    with_mtp = dict(LLAMA, mtp_layers=1)
    full.save_random_model(str(tmp_path / "ckpt"), with_mtp, torch.float32)
    capsys.readouterr()
    assert convert_checkpoint.main(["export", "--load", str(tmp_path / "ckpt"), "--out", str(tmp_path / "hf")]) == 0
    assert "not exported: the 1 multi-token prediction depth(s) (mtp.*, model.mtp_layers)" in capsys.readouterr().out
    with safe_open(str(tmp_path / "hf" / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert names == {n for r in hf_families.family_for_model(LLAMA).rules(LLAMA) for n in r.hf}


@pytest.mark.parametrize("keep", [0.5, 0.001])  # cut in the tensors, and in the header
def test_import_of_a_truncated_safetensors_file_is_one_line_naming_it(tmp_path, capsys, keep):
    full.save_random_model(str(tmp_path / "ckpt"), LLAMA)
    assert run(capsys, "export", "--load", str(tmp_path / "ckpt"), "--out", str(tmp_path / "hf"))[0] == 0
    weights = tmp_path / "hf" / "model.safetensors"
    os.truncate(weights, int(weights.stat().st_size * keep))  # a download cut short
    rc, err = run(capsys, "import", "--hf", str(tmp_path / "hf"), "--save", str(tmp_path / "back"))
    assert rc == 2 and len(err) == 1, err
    assert f"{weights}: not a complete safetensors file" in err[0]
    assert not (tmp_path / "back" / "latest").exists()


def test_export_writes_the_tokenizer_and_autotokenizer_encodes_like_megand(tmp_path, capsys):
    """The exported directory's tokenizer files load with AutoTokenizer and give megand's ids: leading and
    repeated spaces, newlines, indentation, non-ASCII (byte fallback) and special-token strings as text."""
    from transformers import AutoTokenizer

    from megand.data.quickstart import quickstart_documents
    from megand.data.spm_train import train_sentencepiece
    from megand.data.tokenizer import load_tokenizer

    model = train_sentencepiece(quickstart_documents()[:300], str(tmp_path / "tok"), 400)
    full.save_random_model(str(tmp_path / "ckpt"), LLAMA)
    assert run(capsys, "export", "--load", str(tmp_path / "ckpt"), "--out", str(tmp_path / "hf"),
               "--tokenizer", model)[0] == 0
    ours, theirs = load_tokenizer(model), AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    texts = ["def f(x):\n    return x", "  two leading spaces", " one", "x  \n\t y  ", "ü ✓ 漢字 Ünïcödé",
             "a\n\nb", "</s> <s> <unk> x", ""]
    for text in texts:
        assert theirs.encode(text) == ours.encode(text), text
        assert theirs.decode(ours.encode(text)) == text
    rc, err = run(capsys, "export", "--load", str(tmp_path / "ckpt"), "--out", str(tmp_path / "hf2"),
                  "--tokenizer", str(tmp_path / "missing.model"))
    assert rc == 2 and len(err) == 1 and "missing.model: no such file" in err[0] and not (tmp_path / "hf2").exists()


def test_a_quickstart_run_exports_the_tokenizer_its_source_built(tmp_path):
    """A quickstart run sets no data.tokenizer (the source trains its own): export and generation take that one."""
    from omegaconf import OmegaConf

    from megand.data.quickstart import quickstart_tokenizer
    from megand.tools.generate import stored_tokenizer_path

    cfg = OmegaConf.create({"data": {"kind": "quickstart", "tokenizer": None, "cache_dir": str(tmp_path / "cache")},
                            "model": {"vocab_size": 2048}, "checkpoint": {"save": None}})
    built = quickstart_tokenizer(cfg.data, 2048)
    assert built.startswith(str(tmp_path / "cache")) and built.endswith("vocab2048/tokenizer.model")
    assert stored_tokenizer_path(str(tmp_path / "ckpt"), cfg) == built
    cfg.data.kind = "mock"
    assert stored_tokenizer_path(str(tmp_path / "ckpt"), cfg) is None
