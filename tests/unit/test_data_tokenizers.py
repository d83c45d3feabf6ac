"""Hugging Face tokenizer.json and tiktoken files behind the Tokenizer interface, and preprocessing with them."""

import base64
import pickle

import pytest
import sentencepiece as spm
import tiktoken
import tiktoken.load
from tokenizers import Tokenizer as HFTokenizer

from megand.data.errors import DataError
from megand.data.indexed_dataset import IndexedDataset
from megand.data.preprocess import preprocess_jsonl
from megand.data.quickstart import quickstart_documents
from megand.data.tokenizer import (TIKTOKEN_PATTERN, HuggingFaceTokenizer, TiktokenTokenizer, build_tokenizer,
                                   infer_tokenizer_type, load_tokenizer)

from tests.unit.data_helpers import (train_small_hf_tokenizer, train_small_tokenizer, write_jsonl,
                                     write_small_tiktoken_file)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("toks")
    return {"sentencepiece": train_small_tokenizer(d), "huggingface": train_small_hf_tokenizer(d),
            "tiktoken": write_small_tiktoken_file(d)}


def library_encoder(kind, path):
    """The library's own encoding of a text and its end-of-document id, independent of megand."""
    if kind == "sentencepiece":
        sp = spm.SentencePieceProcessor(model_file=path)
        return sp.encode, sp.eos_id()
    if kind == "huggingface":
        tok = HFTokenizer.from_file(path)
        return (lambda t: tok.encode(t, add_special_tokens=False).ids), tok.token_to_id("<|endoftext|>")
    ranks = tiktoken.load.load_tiktoken_bpe(path)
    enc = tiktoken.Encoding("t", pat_str=TIKTOKEN_PATTERN, mergeable_ranks=ranks,
                            special_tokens={"<|endoftext|>": len(ranks)})
    return enc.encode_ordinary, len(ranks)


# Real text with what trips tokenizers up: unicode, emoji, tabs, runs of spaces and newlines, digits.
SAMPLES = quickstart_documents()[600:640] + ["naïve café — 日本語 😀\tx  y\n\n\n 12345 don't", " leading", "trailing  "]


@pytest.mark.parametrize("kind", ["sentencepiece", "huggingface", "tiktoken"])
def test_preprocessing_equals_the_library_encoding_plus_eod(tmp_path, files, kind, monkeypatch):
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", "")  # tiktoken's own loader: read the file, cache nothing
    path = files[kind]
    assert infer_tokenizer_type(path) == kind
    encode, eod = library_encoder(kind, path)
    corpus = write_jsonl(tmp_path / "c.jsonl", SAMPLES)
    preprocess_jsonl(corpus, str(tmp_path / "o"), path, append_eod=True, workers=2, progress=False)
    ds = IndexedDataset(str(tmp_path / "o_text_document"))
    expected = [encode(t) + [eod] for t in SAMPLES]
    assert [ds[i].tolist() for i in range(len(ds))] == expected
    tok = load_tokenizer(path)
    assert tok.eod_id == eod and max(max(e) for e in expected) < tok.vocab_size


@pytest.mark.parametrize("kind", ["huggingface", "tiktoken"])
def test_decode_inverts_encode_and_tokenizers_pickle(files, kind):
    tok = load_tokenizer(files[kind], kind)
    for text in SAMPLES:
        assert tok.decode(tok.encode(text)) == text
    copy = pickle.loads(pickle.dumps(tok))  # what spawned preprocessing workers receive
    assert copy.encode(SAMPLES[-3]) == tok.encode(SAMPLES[-3]) and copy.eod_id == tok.eod_id


def test_special_token_text_is_plain_text(files):
    tik = TiktokenTokenizer(files["tiktoken"])
    hf = HuggingFaceTokenizer(files["huggingface"])
    assert tik.eod_id not in tik.encode("a <|endoftext|> b")
    assert len(tik.encode("a <|endoftext|> b")) > 1 and len(hf.encode("x")) >= 1


def test_explicit_eod_id_overrides_the_tokenizer(tmp_path, files):
    for kind, path in files.items():
        assert load_tokenizer(path, kind, eod_id=5).eod_id == 5
    corpus = write_jsonl(tmp_path / "c.jsonl", ["one doc", "two docs"])
    preprocess_jsonl(corpus, str(tmp_path / "o"), files["tiktoken"], append_eod=True, eod_id=7, progress=False)
    ds = IndexedDataset(str(tmp_path / "o_text_document"))
    assert ds[0].tolist()[-1] == 7 and ds[1].tolist()[-1] == 7


def test_bad_tokenizer_input_fails_in_one_line(tmp_path, files):
    odd = tmp_path / "tok.bin"
    odd.write_bytes(b"x")
    with pytest.raises(DataError, match=r"tok\.bin: cannot tell the tokenizer kind .*sentencepiece \| huggingface"):
        load_tokenizer(str(odd))
    with pytest.raises(DataError, match=r"tokenizer type 'bpe' is not one of"):
        load_tokenizer(files["huggingface"], "bpe")
    with pytest.raises(DataError, match=r"end-of-document id 9999 is outside the vocabulary of 401"):
        load_tokenizer(files["tiktoken"], eod_id=9999)
    bad = tmp_path / "broken.tiktoken"
    bad.write_text(base64.b64encode(b"a").decode() + " 0\nnot-base64!! 1\n")
    with pytest.raises(DataError, match=r"broken\.tiktoken:2: not a 'base64-token rank' line"):
        load_tokenizer(str(bad))
    junk = tmp_path / "tokenizer.json"
    junk.write_text("{not json")
    with pytest.raises(DataError, match=r"tokenizer\.json: cannot load tokenizer\.json"):
        load_tokenizer(str(junk))
    nofile = tmp_path / "missing.json"
    with pytest.raises(DataError, match=r"missing\.json: tokenizer file not found"):
        load_tokenizer(str(nofile))


def test_vocab_larger_than_the_model_is_an_error(files):
    for kind, path in files.items():
        vocab = load_tokenizer(path).vocab_size
        assert build_tokenizer({"tokenizer": path, "tokenizer_type": kind}, vocab).vocab_size == vocab
        with pytest.raises(DataError, match=rf"tokenizer vocab size {vocab} is larger than model.vocab_size={vocab - 1}"):
            build_tokenizer({"tokenizer": path}, vocab - 1)


@pytest.mark.parametrize("overrides, message", [
    (["data.tokenizer=t.json", "data.tokenizer_type=bpe"],
     r"data.tokenizer_type='bpe': expected one of sentencepiece, huggingface, tiktoken or null"),
    (["data.tokenizer_type=tiktoken"], r"data.tokenizer_type=tiktoken needs data.tokenizer"),
    (["data.eod_id=251"], r"data.eod_id=251 is outside model.vocab_size=251"),
])
def test_tokenizer_config_is_validated(overrides, message):
    from megand.training.config import ConfigError, compose, validate

    with pytest.raises(ConfigError, match=message):
        validate(compose(overrides), 1)
