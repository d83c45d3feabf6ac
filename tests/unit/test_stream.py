"""The streaming source (data.kind=stream): the same samples at every data-parallel size, a state that
resumes exactly and reshards (dp=2 -> dp=4) without a document seen twice or lost over an epoch, weighted
mixtures, and bad input named with file:row."""

import gzip
import json

import numpy as np
import pytest

from megand.data.errors import DataError
from megand.data.stream import StreamSource

SEQ, LANES, VOCAB = 16, 8, 1000
EOD = VOCAB - 1  # the null tokenizer's (text: whitespace-separated ids)


def doc_text(d: int, rng) -> str:
    """Document ``d``: its id in two tokens, then filler; 2..40 tokens in all."""
    return " ".join(map(str, [d // 100, 100 + d % 100, *rng.integers(200, 900, rng.integers(0, 39))]))


def write_corpus(directory, num_docs=300) -> list[int]:
    """The documents over two .jsonl files, one .jsonl.gz and a Parquet file of three row groups."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(0)
    texts = [doc_text(d, rng) for d in range(num_docs)]
    parts = np.array_split(np.arange(num_docs), 4)
    directory.mkdir(exist_ok=True)
    for name, ids in (("a.jsonl", parts[0]), ("b.jsonl", parts[1])):
        (directory / name).write_text("".join(json.dumps({"text": texts[i]}) + "\n" for i in ids))
    with gzip.open(directory / "c.jsonl.gz", "wt") as f:
        f.write("".join(json.dumps({"text": texts[i]}) + "\n" for i in parts[2]))
    pq.write_table(pa.table({"text": [texts[i] for i in parts[3]]}), directory / "d.parquet",
                   row_group_size=len(parts[3]) // 3 + 1)
    return list(range(num_docs))


def stream(paths, **cfg) -> StreamSource:
    return StreamSource({"paths": paths, "workers": 0, **cfg}, SEQ, VOCAB, seed=7)


def read(sources, steps):
    """``steps`` global batches from readers that together hold every lane (in lane order)."""
    return [np.concatenate([s.next_samples() for s in sources]) for _ in range(steps)]


def readers(paths, dp, state=None):
    out = []
    for r in range(dp):
        s = stream(paths).open(LANES, r * LANES // dp, LANES // dp)
        if state is not None:
            s.load_state_dict(state)
        out.append(s)
    return out


def merged_state(sources):
    state = sources[0].state_dict()
    state["lane_states"] = {str(k): v for s in sources for k, v in s.state_dict()["lane_states"].items()}
    return json.loads(json.dumps(state))  # plain values: what a checkpoint keeps


def lane_documents(batches, lane):
    """The ids of the whole documents a lane trained on, in order (its samples overlap by one token)."""
    tokens = np.concatenate([batches[0][lane]] + [b[lane][1:] for b in batches[1:]])
    ends = np.flatnonzero(tokens == EOD)
    starts = np.concatenate([[0], ends[:-1] + 1])
    return [int(tokens[a]) * 100 + int(tokens[a + 1]) - 100 for a in starts[:len(ends)]]


def test_every_dp_reads_the_same_stream_and_a_reshard_loses_and_repeats_nothing(tmp_path):
    docs = write_corpus(tmp_path / "corpus")
    paths = [[1.0, str(tmp_path / "corpus")]]
    steps = 120  # more than one epoch of every lane (its share: up to 2 pieces of 12, about 80 docs * 20 tokens / 16)
    whole = read(readers(paths, 1), steps)
    assert all(np.array_equal(a, b) for a, b in zip(whole, read(readers(paths, 2), steps)))  # dp-independent
    # dp=2 for 13 steps, checkpoint, resume at dp=4: the same batches as the uninterrupted run
    first = readers(paths, 2)
    part = read(first, 13)
    rest = read(readers(paths, 4, merged_state(first)), steps - 13)
    assert all(np.array_equal(a, b) for a, b in zip(whole, part + rest))
    # count the documents of the first epoch the resumed run trained on (their epoch from the readers' record)
    resumed = readers(paths, 4, merged_state(first))
    for r in resumed:
        r.history = {}
    rest = read(resumed, steps - 13)
    taken = {k: v for r in resumed for k, v in r.history.items()}
    before = {int(k): v for k, v in merged_state(first)["lane_states"].items()}
    seen = []
    for lane in range(LANES):
        trained = lane_documents(part + rest, lane)
        # the documents before the reshard, then those the resumed reader took (the first one again when
        # the lane stood inside it)
        record = [(d.epoch, int(d.tokens[0]) * 100 + int(d.tokens[1]) - 100) for d in taken[lane]]
        epochs = [e for e, _ in record]
        assert max(epochs) >= 1, f"lane {lane} did not finish its first epoch in {steps} steps"
        resumed_docs = [d for _, d in record]
        # trained = (documents before the reshard, whole or the one the lane stood in) + resumed_docs prefix
        for n_before in range(len(trained) + 1):
            if trained[n_before:] == resumed_docs[:len(trained) - n_before]:
                break
        else:
            raise AssertionError(f"lane {lane}: the resumed reader's documents do not continue the lane")
        seen += trained[:n_before] + [d for e, d in record[:len(trained) - n_before] if e == 0]
        assert before[lane]["cursors"][0][0] == 0  # the reshard happened in the first epoch
    assert sorted(seen) == docs  # each document of the epoch exactly once, none lost


def test_a_mixture_follows_its_weights_in_text(tmp_path):
    write_corpus(tmp_path / "x", 200)
    write_corpus(tmp_path / "y", 200)
    s = stream([[3.0, str(tmp_path / "x")], [1.0, str(tmp_path / "y/*.jsonl*")]]).open(LANES, 0, LANES)
    read([s], 30)
    chars = np.array([lane.chars for lane in s.mine]).sum(axis=0)
    assert abs(chars[0] / chars.sum() - 0.75) < 0.02


def test_bad_rows_are_named_or_skipped(tmp_path):
    write_corpus(tmp_path / "c", 100)
    with open(tmp_path / "c" / "a.jsonl", "a") as f:
        f.write('{"text": "1 2 3"\n')  # malformed (line 26)
    with pytest.raises(DataError, match=r"a.jsonl:26: invalid JSON"):
        read(readers([[1.0, str(tmp_path / "c")]], 1), 40)
    s = stream([[1.0, str(tmp_path / "c")]], on_error="skip").open(LANES, 0, LANES)
    read([s], 40)
    assert s.skipped >= 1 and "a.jsonl:26: invalid JSON" in s.notices[0]


def test_a_file_that_cannot_be_decompressed_is_named(tmp_path):
    write_corpus(tmp_path / "c", 100)
    data = (tmp_path / "c" / "c.jsonl.gz").read_bytes()
    (tmp_path / "c" / "c.jsonl.gz").write_bytes(data[:len(data) // 2])  # truncated
    with pytest.raises(DataError, match=r"c.jsonl.gz: cannot read \(EOFError"):
        read(readers([[1.0, str(tmp_path / "c")]], 1), 40)


@pytest.mark.parametrize("workers", [0, 1])
def test_raw_text_without_a_tokenizer_names_the_key(tmp_path, workers):
    """No data.tokenizer means the null tokenizer (text is token ids): words are one line naming the key, in
    the reader and from a tokenizer worker process alike (was a ValueError traceback from int())."""
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "a.jsonl").write_text("".join(json.dumps({"text": f"hello world {i}"}) + "\n" for i in range(20)))
    s = stream([[1.0, str(tmp_path / "t")]], workers=workers).open(LANES, 0, LANES)
    try:
        with pytest.raises(DataError, match=r"data.tokenizer is null, .* holds 'hello world \d+': set data.tokenizer"):
            read([s], 1)
    finally:
        s.close()


def test_empty_stream_and_foreign_tokens_fail_with_one_line(tmp_path):
    (tmp_path / "e").mkdir()
    (tmp_path / "e" / "a.jsonl").write_text("\n")
    with pytest.raises(DataError, match=r"found no document in two epochs .* the stream is empty"):
        read(readers([[1.0, str(tmp_path / "e")]], 1), 1)
    (tmp_path / "f").mkdir()
    (tmp_path / "f" / "a.jsonl").write_text("".join(json.dumps({"text": f"5 {2000 + i}"}) + "\n" for i in range(20)))
    with pytest.raises(DataError, match=r"a.jsonl:\d+: token id 20\d\d is outside model.vocab_size=1000"):
        read(readers([[1.0, str(tmp_path / "f")]], 1), 1)
    (tmp_path / "g").mkdir()
    with pytest.raises(DataError, match=r"no .jsonl, .jsonl.gz, .parquet files there"):
        stream([[1.0, str(tmp_path / "g")]])


def test_inspect_data_shows_a_stream_rank_samples_and_their_files(tmp_path, capsys):
    from megand.tools.inspect_data import main

    write_corpus(tmp_path / "c", 100)
    code = main(["data=stream", f"data.paths=[[1.0,{tmp_path / 'c'}]]", "model.vocab_size=1000", "+experiment=tiny_gpt",
                 "train.eval_iters=0", "model.seq_length=16", "--world-size", "2", "--rank", "1", "--iteration", "2"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "stream of 4 file(s), 6 unit(s)" in out and "rank 1 (dp 1/2" in out
    assert "documents from " in out and (".jsonl" in out or ".parquet:" in out)


def test_a_killed_tokenizer_worker_is_an_error_not_a_hang(tmp_path):
    import os
    import signal

    write_corpus(tmp_path / "c", 300)
    s = StreamSource({"paths": [[1.0, str(tmp_path / "c")]], "workers": 1}, SEQ, VOCAB, seed=7).open(LANES, 0, LANES)
    try:
        s.next_samples()  # starts the worker
        for pid in list(s._pool._processes):
            os.kill(pid, signal.SIGKILL)
        with pytest.raises(DataError, match=r"a tokenizer worker process of the stream's reader died"):
            read([s], 60)
    finally:
        s.close()


def test_a_reader_reads_only_the_units_of_its_lanes(tmp_path, monkeypatch):
    """.jsonl files cut into byte chunks at line starts hold each line once; each of dp readers reads about
    1/dp of the bytes a single reader reads, and together they read each unit once."""
    import megand.data.stream as stream_module

    monkeypatch.setattr(stream_module, "CHUNK_BYTES", 1500)
    rng = np.random.default_rng(1)
    texts = [doc_text(d, rng) for d in range(600)]
    (tmp_path / "c").mkdir()
    for k in range(2):
        (tmp_path / "c" / f"{k}.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts[k::2]))
    paths = [[1.0, str(tmp_path / "c")]]
    units = stream_module.list_units(paths[0][1])
    assert len(units) > 2 * LANES  # whole units per lane
    rows = [json.loads(line)["text"] for u in units for _, line in stream_module.read_unit(u)]
    assert sorted(rows) == sorted(texts)  # every line in exactly one chunk
    total = sum(u.size for u in units)
    assert total == sum((tmp_path / "c" / f"{k}.jsonl").stat().st_size for k in range(2))
    steps = 40  # about 40% of an epoch (600 docs * ~21 tokens / (8 lanes * 16 tokens a step)): no lane finishes it
    read_bytes = {}
    for dp in (1, 2, 4):
        sources = readers(paths, dp)
        batches = read(sources, steps)
        read_bytes[dp] = [s.bytes_read for s in sources]
        if dp == 1:
            whole = batches
        assert all(np.array_equal(a, b) for a, b in zip(whole, batches))
    assert total * 0.3 < read_bytes[1][0] <= total * 0.7
    assert sum(read_bytes[2]) == sum(read_bytes[4]) == read_bytes[1][0]  # no unit read twice
    for dp in (2, 4):
        assert max(read_bytes[dp]) < 1.5 * read_bytes[1][0] / dp, (dp, read_bytes)


def test_a_malformed_row_inside_a_file_chunk_is_named_by_its_byte_offset(tmp_path, monkeypatch):
    import megand.data.stream as stream_module

    monkeypatch.setattr(stream_module, "CHUNK_BYTES", 1000)
    (tmp_path / "c").mkdir()
    lines = [json.dumps({"text": f"{i} 7 7 7"}) + "\n" for i in range(400)]
    lines[300] = '{"text": "1 2 3"\n'
    (tmp_path / "c" / "a.jsonl").write_text("".join(lines))
    offset = sum(len(x) for x in lines[:300])
    with pytest.raises(DataError, match=rf"a.jsonl:byte {offset}: invalid JSON"):
        read(readers([[1.0, str(tmp_path / "c")]], 1), 40)


def test_a_state_of_another_seed_batch_or_format_is_refused_in_one_line(tmp_path):
    write_corpus(tmp_path / "c", 100)
    paths = [[1.0, str(tmp_path / "c")]]
    state = merged_state(readers(paths, 1))
    s = readers(paths, 2)[0]
    for change, message in (({"seed": 8}, r"shuffled with train.seed=8, this run's is 7"),
                            ({"lanes": 16}, r"has 16 lanes .* this run 8"),
                            ({"version": 1}, r"stream state is of version 1")):
        with pytest.raises(DataError, match=message):
            s.load_state_dict({**state, **change})
    s.load_state_dict({**state, "lane_states": {}})  # lanes the state does not hold were never read
    assert [lane.cursors for lane in s.mine] == [[[0, lane.index, 0]] for lane in s.mine]


def test_a_changed_corpus_is_refused_on_resume_naming_the_file(tmp_path):
    """The state identifies the files: appending documents to a file, adding or removing a file, or
    rewriting what was read is refused in one line naming the file (such a resume used to repeat documents:
    the lanes' positions then point into another order of units and rows)."""
    write_corpus(tmp_path / "c", 120)
    paths = [[1.0, str(tmp_path / "c")]]
    first = readers(paths, 1)
    read(first, 6)
    state = merged_state(first)
    a = tmp_path / "c" / "a.jsonl"
    original = a.read_bytes()
    with open(a, "a") as f:  # 20 more documents in one file
        f.writelines(json.dumps({"text": f"7 {i} 7"}) + "\n" for i in range(20))
    with pytest.raises(DataError, match=rf"^{a}: changed since the checkpoint: {len(original)} bytes then, \d+ now"):
        readers(paths, 2, state)
    a.write_bytes(original)
    (tmp_path / "c" / "e.jsonl").write_text(json.dumps({"text": "5 6 7"}) + "\n")  # a file more
    with pytest.raises(DataError, match=r"e.jsonl was added since the checkpoint \(4 file\(s\) then, 5 now\)"):
        readers(paths, 2, state)
    (tmp_path / "c" / "e.jsonl").unlink()
    (tmp_path / "c" / "b.jsonl").rename(tmp_path / "b.jsonl")
    with pytest.raises(DataError, match=r"b.jsonl is gone since the checkpoint"):
        readers(paths, 2, state)
    (tmp_path / "b.jsonl").rename(tmp_path / "c" / "b.jsonl")
    # the same rows rewritten (a new modification time): the rows read hash the same, the resume goes on
    a.write_bytes(original)
    whole = read(readers(paths, 1), 10)
    assert all(np.array_equal(x, y) for x, y in zip(whole[6:], read(readers(paths, 2, state), 4)))
    # other rows of the same size where the stream read: refused
    a.write_bytes(original.replace(b'"text": "0 ', b'"text": "9 ', 1))
    assert len(a.read_bytes()) == len(original)
    with pytest.raises(DataError, match=rf"^{a}: changed since the checkpoint: modified, and the rows read from it differ"):
        readers(paths, 1, state)


def test_two_in_process_streams_tokenize_each_with_its_own_tokenizer(tmp_path):
    """Without worker processes (data.workers=0) each stream tokenizes with its own tokenizer: a second stream
    of another vocabulary (here the null tokenizer's EOD, its last id) does not reuse the first's."""
    write_corpus(tmp_path / "c")
    paths = [[1.0, str(tmp_path / "c")]]
    first = StreamSource({"paths": paths, "workers": 0}, SEQ, VOCAB, seed=7).open(LANES, 0, LANES)
    assert (first.next_samples() == EOD).any()
    second = StreamSource({"paths": paths, "workers": 0}, SEQ, 2 * VOCAB, seed=7).open(LANES, 0, LANES)
    samples = second.next_samples()
    assert (samples == 2 * VOCAB - 1).any() and not (samples == EOD).any()
