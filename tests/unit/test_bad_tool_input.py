"""The tools on bad input: one line naming the value, exit code 2, and the user's files as they were."""

import hashlib
import os
import subprocess
import sys

import pytest

from megand.data.indexed_dataset import IndexedDataset
from megand.data.quickstart import quickstart_documents
from tests.unit.data_helpers import train_small_tokenizer, write_jsonl

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def tool(name, *args, cwd=ROOT):
    """Run tools/NAME.py with this checkout's megand."""
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, os.path.join(ROOT, "tools", f"{name}.py"), *map(str, args)],
                          capture_output=True, text=True, env=env, cwd=cwd, timeout=300)


def one_line_exit_2(proc, *named):
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr[-3000:]
    for value in named:
        assert value in lines[0], lines[0]


def digests(*paths):
    return {str(p): hashlib.sha256(open(p, "rb").read()).hexdigest() for p in paths}


@pytest.fixture(scope="module")
def tok_model(tmp_path_factory):
    return train_small_tokenizer(tmp_path_factory.mktemp("tok"))


def preprocess(corpus, prefix, tok_model):
    return tool("preprocess_data", "--input", corpus, "--output-prefix", prefix, "--tokenizer-model", tok_model,
                "--no-progress", "--append-eod")


def test_failed_preprocess_rerun_keeps_the_existing_dataset(tmp_path, tok_model):
    good = write_jsonl(tmp_path / "good.jsonl", quickstart_documents()[:50])
    prefix = tmp_path / "data" / "corpus"  # data/ does not exist yet: it is created
    assert preprocess(good, prefix, tok_model).returncode == 0
    out = f"{prefix}_text_document"
    before = digests(out + ".bin", out + ".idx")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(open(good).read() + "{not json\n")
    one_line_exit_2(preprocess(bad, prefix, tok_model), f"{bad}:51: invalid JSON")
    assert digests(out + ".bin", out + ".idx") == before
    assert sorted(os.listdir(tmp_path / "data")) == ["corpus_text_document.bin", "corpus_text_document.idx"]
    assert len(IndexedDataset(out)) == 50


def test_preprocess_into_a_non_directory_is_one_line(tmp_path, tok_model):
    good = write_jsonl(tmp_path / "good.jsonl", quickstart_documents()[:5])
    blocker = tmp_path / "data"
    blocker.write_text("a file, not a directory")
    one_line_exit_2(preprocess(good, blocker / "corpus", tok_model), str(blocker))
    assert blocker.read_text() == "a file, not a directory"


@pytest.mark.parametrize("case", ["missing", "empty"])
def test_train_tokenizer_without_text_is_one_line(tmp_path, case):
    path = tmp_path / "corpus.jsonl"
    if case == "empty":
        path.write_text("\n\n")
    proc = tool("train_tokenizer", "--input", path, "--model-prefix", tmp_path / "tok", "--vocab-size", 300,
                "--num-threads", 1)
    one_line_exit_2(proc, str(path), "no such file" if case == "missing" else "no text to train on")
    assert not (tmp_path / "tok.model").exists()


def test_train_tokenizer_says_when_the_vocabulary_is_smaller_than_asked(tmp_path):
    path = write_jsonl(tmp_path / "corpus.jsonl", ["hello world", "abc def"])
    # 600: more than the 256 byte pieces and 3 specials of the default byte fallback plus what 2 docs yield
    proc = tool("train_tokenizer", "--input", path, "--model-prefix", tmp_path / "tok", "--vocab-size", 600,
                "--num-threads", 1)
    assert proc.returncode == 0, proc.stderr
    assert "pieces, fewer than the 600 asked for" in proc.stdout and "(2 documents)" in proc.stdout, proc.stdout


@pytest.mark.parametrize("args, named", [
    (["model=llama_9b"], "Could not find 'model/llama_9b'"),
    (["train.micro_batch_size=0"], "train.micro_batch_size=0 must be >= 1"),
    (["--world-size", "0"], "--world-size 0 must be >= 1"),
    (["parallel.tp=3"], "parallel.tp=3"),
])
def test_estimate_bad_input_is_one_line(args, named):
    one_line_exit_2(tool("estimate", *args), named)


@pytest.mark.parametrize("args, named", [
    (["model=nope"], "Could not find 'model/nope'"),
    (["train.micro_batch_size=0"], "train.micro_batch_size=0 must be >= 1"),
    (["--steps", "0"], "--steps 0 must be >= 1"),
])
def test_benchmark_bad_input_is_one_line(tmp_path, args, named):
    one_line_exit_2(tool("benchmark", *args, f"run_dir={tmp_path / 'run'}"), named)
