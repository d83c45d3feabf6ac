"""Hugging Face save_to_disk directories (data.kind=hf_disk), streamed: the same samples at every
data-parallel size, an exact resume, a state that identifies its Arrow files, and a bad directory named in
one line. The fixtures are written with ``datasets``; megand reads them with pyarrow only."""

import json

import numpy as np
import pytest

from megand.data.errors import DataError
from megand.data.hf_disk import HFDiskSource
from megand.data.source import data_kind
from tests.unit.test_stream import LANES, SEQ, VOCAB, doc_text, lane_documents

pytest.importorskip("datasets")


def write_hf_dataset(directory, num_docs=300, num_shards=3, first=0) -> list[str]:
    """Documents ``first..first+num_docs`` (their ids in the first two tokens) as a save_to_disk directory of
    ``num_shards`` Arrow files, with a second column the stream ignores."""
    import datasets

    datasets.disable_progress_bars()
    rng = np.random.default_rng(first)
    texts = [doc_text(d, rng) for d in range(first, first + num_docs)]
    datasets.Dataset.from_dict({"text": texts, "id": list(range(num_docs))}).save_to_disk(str(directory),
                                                                                       num_shards=num_shards)
    return texts


def source(paths, **cfg):
    return HFDiskSource({"paths": paths, "workers": 0, **cfg}, SEQ, VOCAB, seed=7)


def readers(paths, dp, state=None):
    out = []
    for r in range(dp):
        s = source(paths).open(LANES, r * LANES // dp, LANES // dp)
        if state is not None:
            s.load_state_dict(state)
        out.append(s)
    return out


def read(sources, steps):
    return [np.concatenate([s.next_samples() for s in sources]) for _ in range(steps)]


def merged(sources):
    from megand.data.stream import merge_states

    return json.loads(json.dumps(merge_states([s.state_dict() for s in sources])))


def test_the_registry_reads_save_to_disk_directories_as_a_stream(tmp_path):
    write_hf_dataset(tmp_path / "d", 100)
    train, valid, _ = data_kind("hf_disk").build({"paths": [[1.0, str(tmp_path / "d")]], "workers": 0}, SEQ, VOCAB,
                                                 7, (10, 0, 0))
    assert isinstance(train, HFDiskSource) and valid is None
    assert len(train.sources[0]) == 3 and {u.path.rsplit("/", 1)[1] for u in train.sources[0]} == {
        "data-00000-of-00003.arrow", "data-00001-of-00003.arrow", "data-00002-of-00003.arrow"}


def test_every_dp_reads_the_same_documents_and_a_resume_is_exact(tmp_path):
    write_hf_dataset(tmp_path / "d", 300)
    paths = [[1.0, str(tmp_path / "d")]]
    steps = 160  # past the first epoch of every lane (lane 0 reads two of the 9 pieces)
    whole = read(readers(paths, 1), steps)
    assert all(np.array_equal(a, b) for a, b in zip(whole, read(readers(paths, 2), steps)))
    first = readers(paths, 2)
    part = read(first, 11)
    rest = read(readers(paths, 4, merged(first)), steps - 11)
    assert all(np.array_equal(a, b) for a, b in zip(whole, part + rest))
    # every document of the directory reaches the lanes (ids from the tokens)
    trained = [d for lane in range(LANES) for d in lane_documents(whole, lane)]
    assert set(trained) == set(range(300))


def test_a_mixture_of_two_directories_and_a_held_out_one(tmp_path):
    write_hf_dataset(tmp_path / "x", 200, first=0)
    write_hf_dataset(tmp_path / "y", 200, first=1000, num_shards=1)
    write_hf_dataset(tmp_path / "v", 50, first=2000, num_shards=1)
    cfg = {"paths": [[3.0, str(tmp_path / "x")], [1.0, str(tmp_path / "y")]], "workers": 0,
           "valid_paths": [[1.0, str(tmp_path / "v")]]}
    train, valid, _ = data_kind("hf_disk").build(cfg, SEQ, VOCAB, 7, (10, 10, 0))
    train.open(LANES, 0, LANES)
    read([train], 80)
    chars = np.array([lane.chars for lane in train.mine]).sum(axis=0)
    assert abs(chars[0] / chars.sum() - 0.75) < 0.02
    assert {u.path for units in valid.sources for u in units} <= {str(p) for p in (tmp_path / "v").iterdir()}


def test_a_changed_directory_is_refused_on_resume(tmp_path):
    write_hf_dataset(tmp_path / "d", 200)
    paths = [[1.0, str(tmp_path / "d")]]
    first = readers(paths, 1)
    read(first, 5)
    state = merged(first)
    write_hf_dataset(tmp_path / "d2", 220)  # the dataset saved again with 20 documents more
    for f in ("data-00000-of-00003.arrow", "state.json"):
        (tmp_path / "d" / f).write_bytes((tmp_path / "d2" / f).read_bytes())
    with pytest.raises(DataError, match=r"data-00000-of-00003.arrow: changed since the checkpoint: \d+ bytes then"):
        readers(paths, 2, state)


def test_data_text_key_names_the_column_of_the_text(tmp_path):
    """``data.text_key``: the Arrow column (hf_disk) or JSON field (stream) read; a resume with another one is
    refused."""
    import datasets

    from megand.data.stream import StreamSource

    datasets.disable_progress_bars()
    texts = write_hf_dataset(tmp_path / "t", 100, num_shards=1)
    datasets.Dataset.from_dict({"content": texts, "text": ["1 2"] * 100}).save_to_disk(str(tmp_path / "c"))
    (tmp_path / "j").mkdir()
    (tmp_path / "j" / "a.jsonl").write_text("".join(json.dumps({"body": t}) + "\n" for t in texts))
    expected = read(readers([[1.0, str(tmp_path / "t")]], 1), 5)
    by_key = source([[1.0, str(tmp_path / "c")]], text_key="content").open(LANES, 0, LANES)
    assert all(np.array_equal(a, b) for a, b in zip(expected, read([by_key], 5)))
    jsonl = StreamSource({"paths": [[1.0, str(tmp_path / "j")]], "workers": 0, "text_key": "body"}, SEQ, VOCAB,
                         seed=7).open(LANES, 0, LANES)
    assert sum(len(lane_documents(read([jsonl], 5), lane)) for lane in range(LANES)) > LANES
    with pytest.raises(DataError, match=r"read the texts of data.text_key='content', this run 'text'"):
        source([[1.0, str(tmp_path / "c")]]).open(LANES, 0, LANES).load_state_dict(merged([by_key]))


@pytest.mark.parametrize("make, message", [
    (lambda d: None, r"not a directory \(data.kind=hf_disk reads a directory written by datasets' save_to_disk\)"),
    (lambda d: d.mkdir(), r"no state.json"),
    (lambda d: write_dict(d), r"a DatasetDict of splits test, train: give one split's directory, e.g. .*/train$"),
    (lambda d: write_other_column(d), r"data-00000-of-00001.arrow: no column 'text' \(columns: body; data.text_key names it\)"),
    (lambda d: truncate(d), r"data-00000-of-00001.arrow: cannot read Arrow"),
])
def test_a_bad_directory_is_refused_in_one_line(tmp_path, make, message):
    d = tmp_path / "d"
    make(d)
    with pytest.raises(DataError, match=message) as e:
        source([[1.0, str(d)]])
    assert "\n" not in str(e.value)


def write_dict(d):
    import datasets

    datasets.disable_progress_bars()
    part = datasets.Dataset.from_dict({"text": ["1 2 3"] * 20})
    datasets.DatasetDict({"train": part, "test": part}).save_to_disk(str(d))


def write_other_column(d):
    import datasets

    datasets.disable_progress_bars()
    datasets.Dataset.from_dict({"body": ["1 2 3"] * 20}).save_to_disk(str(d))


def truncate(d):
    write_hf_dataset(d, 50, num_shards=1)
    arrow = d / "data-00000-of-00001.arrow"
    arrow.write_bytes(arrow.read_bytes()[:100])
