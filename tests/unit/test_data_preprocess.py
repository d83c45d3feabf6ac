import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import sentencepiece as spm

import megand.data.preprocess as preprocess
from megand.data.errors import DataError
from megand.data.indexed_dataset import IndexedDataset
from megand.data.preprocess import preprocess_jsonl
from megand.data.quickstart import quickstart_documents
from megand.data.tokenizer import NullTokenizer, SentencePieceTokenizer, build_tokenizer

from tests.unit.data_helpers import train_small_tokenizer, write_jsonl

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tok_model(tmp_path_factory):
    return train_small_tokenizer(tmp_path_factory.mktemp("tok"))


def test_tokenizer_reads_ids_from_model(tok_model):
    tok = SentencePieceTokenizer(tok_model)
    sp = spm.SentencePieceProcessor(model_file=tok_model)
    assert (tok.vocab_size, tok.bos_id, tok.eos_id, tok.eod_id) == (sp.vocab_size(), 1, 2, 2)
    assert tok.decode(tok.encode("hello world")) == "hello world"
    assert isinstance(build_tokenizer({"tokenizer": None}, 128), NullTokenizer)
    assert build_tokenizer({"tokenizer": tok_model}, 4096).vocab_size == tok.vocab_size


def test_round_trip_two_workers(tmp_path, tok_model, monkeypatch):
    monkeypatch.setattr(preprocess, "CHUNK_BYTES", 4096)  # many chunks through the pool
    docs = quickstart_documents()[:300]
    docs.insert(7, "")  # empty: skipped and counted
    path = write_jsonl(tmp_path / "c.jsonl", docs)
    summary = preprocess_jsonl(path, str(tmp_path / "out"), tok_model, append_eod=True, workers=2, progress=False)
    assert summary.empty == 1 and summary.documents == 300 and summary.bad_lines == 0
    ds = IndexedDataset(str(tmp_path / "out_text_document"))
    sp = spm.SentencePieceProcessor(model_file=tok_model)
    expected = [sp.encode(d) + [sp.eos_id()] for d in docs if d]
    assert len(ds) == len(expected)
    assert all(ds[i].tolist() == e for i, e in enumerate(expected))
    assert summary.tokens == ds.num_tokens


def test_partitions_give_the_same_bytes(tmp_path, tok_model):
    path = write_jsonl(tmp_path / "c.jsonl", quickstart_documents()[:200])
    preprocess_jsonl(path, str(tmp_path / "one"), tok_model, workers=1, progress=False)
    preprocess_jsonl(path, str(tmp_path / "three"), tok_model, workers=2, partitions=3, progress=False)
    for ext in (".bin", ".idx"):
        assert (tmp_path / f"one_text_document{ext}").read_bytes() == (tmp_path / f"three_text_document{ext}").read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["c.jsonl"] + [f"{n}_text_document{e}" for n in ("one", "three") for e in (".bin", ".idx")])


def test_one_dataset_per_json_key(tmp_path, tok_model):
    path = tmp_path / "c.jsonl"
    path.write_text("\n".join(json.dumps({"text": f"text {i}", "title": f"title {i}"}) for i in range(5)))
    preprocess_jsonl(str(path), str(tmp_path / "o"), tok_model, json_keys=["text", "title"], progress=False)
    assert len(IndexedDataset(str(tmp_path / "o_title_document"))) == 5
    assert len(IndexedDataset(str(tmp_path / "o_text_document"))) == 5


@pytest.mark.parametrize("line,reason", [('{"text": "broken', "invalid JSON"),
                                          ('{"title": "no text"}', "missing key 'text'"),
                                          ('{"text": 3}', "key 'text' is int, not a string")])
def test_malformed_line_is_reported_with_file_and_line(tmp_path, tok_model, line, reason):
    path = tmp_path / "c.jsonl"
    path.write_text('{"text": "first"}\n' + line + '\n{"text": "third"}\n')
    with pytest.raises(DataError, match=rf"c\.jsonl:2: {reason}"):
        preprocess_jsonl(str(path), str(tmp_path / "o"), tok_model, workers=2, progress=False)
    assert not (tmp_path / "o_text_document.bin").exists()  # no half-written output
    summary = preprocess_jsonl(str(path), str(tmp_path / "o"), tok_model, on_error="skip", progress=False)
    assert summary.bad_lines == 1 and len(IndexedDataset(str(tmp_path / "o_text_document"))) == 2


def test_cli_fails_with_file_line(tmp_path, tok_model):
    path = tmp_path / "c.jsonl"
    path.write_text('{"text": "a"}\n{bad\n{"text": "c"}\n')
    r = subprocess.run([sys.executable, str(ROOT / "tools/preprocess_data.py"), "--input", str(path),
                        "--output-prefix", str(tmp_path / "o"), "--tokenizer-model", tok_model, "--no-progress"],
                       capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 2 and f"{path}:2: invalid JSON" in r.stderr


def test_train_tokenizer_cli(tmp_path):
    path = write_jsonl(tmp_path / "c.jsonl", quickstart_documents()[:300])
    r = subprocess.run([sys.executable, str(ROOT / "tools/train_tokenizer.py"), "--input", path,
                        "--model-prefix", str(tmp_path / "t"), "--vocab-size", "500", "--model-type", "unigram",
                        "--byte-fallback", "--num-threads", "1"], capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stderr
    assert SentencePieceTokenizer(str(tmp_path / "t.model")).vocab_size <= 500
