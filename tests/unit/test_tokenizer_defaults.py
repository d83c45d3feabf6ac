"""Tokenizer training keeps the text by default, reads Parquet by column, refuses binary input and empty
corpora in one line; preprocessing refuses them the same way (every case a run of the command)."""

import inspect
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import megand.data.preprocess as preprocess_module
from megand.data.tokenizer import SentencePieceTokenizer
from tests.unit.test_bad_tool_input import one_line_exit_2, tool, train_small_tokenizer

SOURCE = inspect.getsource(preprocess_module)  # Python source: indentation, blank lines, runs of spaces
EXTRA = "def f(x):\n    return x\n\n\tüñí ✓ 漢字 \r\n  trailing  \n"


def train(tmp_path, *inputs, extra=()):
    return tool("train_tokenizer", "--input", *inputs, "--model-prefix", tmp_path / "tok", "--vocab-size", 400,
                "--num-threads", 1, *extra)


def code_jsonl(path):
    with open(path, "w") as f:
        for i in range(0, len(SOURCE), 2000):
            f.write(json.dumps({"text": SOURCE[i:i + 2000]}) + "\n")
    return path


def test_python_source_round_trips_exactly_through_the_default_tokenizer(tmp_path):
    proc = train(tmp_path, code_jsonl(tmp_path / "code.jsonl"))
    assert proc.returncode == 0, proc.stderr
    tok = SentencePieceTokenizer(str(tmp_path / "tok.model"))
    for text in (SOURCE, EXTRA):
        assert tok.decode(tok.encode(text)) == text


def test_parquet_is_read_by_column(tmp_path):
    path = tmp_path / "code.parquet"
    chunks = [SOURCE[i:i + 2000] for i in range(0, len(SOURCE), 2000)]
    pq.write_table(pa.table({"id": list(range(len(chunks))), "content": chunks}), path)
    proc = train(tmp_path, path)  # no column "text": named, with the columns there are
    one_line_exit_2(proc, str(path), "no column 'text'", "content")
    proc = train(tmp_path, path, extra=("--json-keys", "content"))
    assert proc.returncode == 0, proc.stderr
    from_parquet = (tmp_path / "tok.vocab").read_text()
    # trained on the column's text, not on the file's compressed bytes: the same pieces as from JSON lines
    proc = train(tmp_path, code_jsonl(tmp_path / "code.jsonl"))
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "tok.vocab").read_text() == from_parquet


@pytest.mark.parametrize("content, named", [
    (bytes(range(256)) * 8, "binary file"),
    ("café crème\n".encode("latin-1") * 50, "not UTF-8 text"),
])
def test_binary_input_is_one_line(tmp_path, content, named):
    path = tmp_path / "corpus.dat"
    path.write_bytes(content)
    one_line_exit_2(train(tmp_path, path), str(path), named)
    assert not (tmp_path / "tok.model").exists()


def test_empty_corpus_is_one_line_in_both_tools(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    one_line_exit_2(train(tmp_path, empty), str(empty), "no text to train on")
    blank = tmp_path / "blank.jsonl"
    blank.write_text(json.dumps({"text": ""}) + "\n\n")
    model = train_small_tokenizer(tmp_path)
    for path in (empty, blank):
        proc = tool("preprocess_data", "--input", path, "--output-prefix", tmp_path / "out",
                    "--tokenizer-model", model, "--no-progress")
        one_line_exit_2(proc, str(path), "no documents")
        assert not list(tmp_path.glob("out*"))


def test_preprocess_refuses_binary_input(tmp_path):
    path = tmp_path / "corpus.jsonl"
    path.write_bytes(bytes(range(256)) * 8)
    model = train_small_tokenizer(tmp_path)
    proc = tool("preprocess_data", "--input", path, "--output-prefix", tmp_path / "out", "--tokenizer-model",
                model, "--no-progress")
    one_line_exit_2(proc, str(path), "binary file")


def test_old_lossy_settings_still_available(tmp_path):
    """--normalization nmt_nfkc --no-byte-fallback: sentencepiece's own defaults, which fold whitespace."""
    proc = train(tmp_path, code_jsonl(tmp_path / "code.jsonl"),
                 extra=("--normalization", "nmt_nfkc", "--no-byte-fallback"))
    assert proc.returncode == 0, proc.stderr
    tok = SentencePieceTokenizer(str(tmp_path / "tok.model"))
    assert tok.decode(tok.encode("def f(x):\n    return x")) != "def f(x):\n    return x"


def test_truncated_gzip_names_the_file(tmp_path):
    import gzip

    data = gzip.compress("".join(json.dumps({"text": f"hello world {i}"}) + "\n" for i in range(5000)).encode())
    path = tmp_path / "corpus.jsonl.gz"
    path.write_bytes(data[:len(data) // 2])
    proc = tool("preprocess_data", "--input", path, "--output-prefix", tmp_path / "out", "--tokenizer-model",
                train_small_tokenizer(tmp_path), "--no-progress")
    one_line_exit_2(proc, str(path), "cannot decompress after line", "EOFError")
    one_line_exit_2(train(tmp_path, path), str(path), "cannot read")
