"""Parquet (and .jsonl.gz, directory, glob) input for preprocessing: the same bytes as JSON lines of the same text."""

import gzip
import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import megand.data.preprocess as preprocess
from megand.data.errors import DataError
from megand.data.indexed_dataset import IndexedDataset
from megand.data.preprocess import preprocess_jsonl
from megand.data.quickstart import quickstart_documents

from tests.unit.data_helpers import train_small_hf_tokenizer, write_jsonl

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return train_small_hf_tokenizer(tmp_path_factory.mktemp("tok"))


def write_parquet(path, columns: dict, row_group_size=37) -> str:
    pq.write_table(pa.table(columns), str(path), row_group_size=row_group_size)
    return str(path)


def output_bytes(prefix):
    return [Path(f"{prefix}_text_document{e}").read_bytes() for e in (".bin", ".idx")]


@pytest.fixture
def docs(monkeypatch):
    monkeypatch.setattr(preprocess, "CHUNK_BYTES", 4096)  # many chunks through the pool
    monkeypatch.setattr(preprocess, "PARQUET_BATCH_ROWS", 16)  # several batches per row group
    d = quickstart_documents()[:240]
    d.insert(5, "")  # tokenizes to nothing: skipped in both
    return d


def test_parquet_gives_the_same_bytes_as_json_lines(tmp_path, tok, docs):
    write_jsonl(tmp_path / "c.jsonl", docs)
    write_parquet(tmp_path / "c.parquet", {"id": list(range(len(docs))), "text": docs})
    a = preprocess_jsonl(str(tmp_path / "c.jsonl"), str(tmp_path / "j"), tok, append_eod=True, workers=2, progress=False)
    b = preprocess_jsonl(str(tmp_path / "c.parquet"), str(tmp_path / "p"), tok, append_eod=True, workers=2,
                         progress=False)
    assert output_bytes(tmp_path / "j") == output_bytes(tmp_path / "p")
    assert (a.documents, a.tokens, a.empty) == (b.documents, b.tokens, b.empty) == (240, a.tokens, 1)
    assert len(IndexedDataset(str(tmp_path / "p_text_document"))) == 240


def test_directory_glob_and_gzip_inputs_are_read_in_name_order(tmp_path, tok, docs):
    write_jsonl(tmp_path / "all.jsonl", docs)
    shards = tmp_path / "shards"
    shards.mkdir()
    write_parquet(shards / "part-000.parquet", {"text": docs[:100]})
    with gzip.open(shards / "part-001.jsonl.gz", "wt") as f:  # mixed kinds in one directory
        f.writelines(line + "\n" for line in (tmp_path / "all.jsonl").read_text().splitlines()[100:200])
    write_parquet(shards / "part-002.parquet", {"text": docs[200:]}, row_group_size=5)
    (shards / "README.md").write_text("not an input")
    preprocess_jsonl(str(tmp_path / "all.jsonl"), str(tmp_path / "one"), tok, append_eod=True, progress=False)
    preprocess_jsonl(str(shards), str(tmp_path / "dir"), tok, append_eod=True, workers=2, progress=False)
    preprocess_jsonl(str(shards / "part-*"), str(tmp_path / "glob"), tok, append_eod=True, progress=False)
    assert output_bytes(tmp_path / "one") == output_bytes(tmp_path / "dir") == output_bytes(tmp_path / "glob")


@pytest.mark.parametrize("columns, reason", [
    ({"text": ["first", None, "third"]}, r"c\.parquet:2: column 'text' is null"),
    ({"text": ["a", "b", "c"], "title": ["x", "y", None]}, r"c\.parquet:3: column 'title' is null"),
    ({"text": [1, 2, 3]}, r"c\.parquet:1: column 'text' is int, not a string"),
])
def test_malformed_rows_are_reported_with_file_and_row(tmp_path, tok, columns, reason):
    path = write_parquet(tmp_path / "c.parquet", columns)
    keys = list(columns)
    with pytest.raises(DataError, match=reason):
        preprocess_jsonl(path, str(tmp_path / "o"), tok, json_keys=keys, workers=2, progress=False)
    assert not (tmp_path / "o_text_document.bin").exists()  # no half-written output
    if columns["text"][0] == 1:  # every row malformed: skipping them all leaves nothing, which is refused
        with pytest.raises(DataError, match=r"no documents to write \(0 empty, 3 malformed skipped\)"):
            preprocess_jsonl(path, str(tmp_path / "o"), tok, json_keys=keys, on_error="skip", progress=False)
        return
    summary = preprocess_jsonl(path, str(tmp_path / "o"), tok, json_keys=keys, on_error="skip", progress=False)
    assert summary.bad_lines == 1


def test_bad_parquet_input_fails_in_one_line(tmp_path, tok):
    path = write_parquet(tmp_path / "c.parquet", {"body": ["a"]})
    with pytest.raises(DataError, match=r"c\.parquet: no column 'text' \(columns: body\)"):
        preprocess_jsonl(path, str(tmp_path / "o"), tok, progress=False)
    junk = tmp_path / "junk.parquet"
    junk.write_bytes(b"not parquet at all")
    with pytest.raises(DataError, match=r"junk\.parquet: cannot read Parquet"):
        preprocess_jsonl(str(junk), str(tmp_path / "o"), tok, progress=False)
    with pytest.raises(DataError, match=r"nothing-\*\.parquet: no \.jsonl, \.jsonl\.gz, \.parquet files there"):
        preprocess_jsonl(str(tmp_path / "nothing-*.parquet"), str(tmp_path / "o"), tok, progress=False)
    with pytest.raises(DataError, match=r"--partitions 2 needs a single uncompressed JSON lines input"):
        preprocess_jsonl(path, str(tmp_path / "o"), tok, partitions=2, progress=False)


def test_cli_parquet_with_tokenizer_type(tmp_path, tok):
    path = write_parquet(tmp_path / "c.parquet", {"text": ["hello world", "second document"]})
    renamed = tmp_path / "tok.bin"  # a name that says nothing: the type is given
    renamed.write_bytes(Path(tok).read_bytes())
    r = subprocess.run([sys.executable, str(ROOT / "tools/preprocess_data.py"), "--input", path, "--output-prefix",
                        str(tmp_path / "o"), "--tokenizer-model", str(renamed), "--tokenizer-type", "huggingface",
                        "--append-eod", "--no-progress"],
                       capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stderr
    assert "2 documents" in r.stdout and len(IndexedDataset(str(tmp_path / "o_text_document"))) == 2
