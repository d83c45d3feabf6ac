import struct

import numpy as np
import pytest

from megand.data.errors import DataError
from megand.data.indexed_dataset import IndexedDataset, merge_datasets, token_dtype

from tests.unit.data_helpers import write_indexed

DOCS = [[5, 6, 7], [1], [9, 8, 7, 6, 5]]


def test_idx_bytes_follow_megatron_layout(tmp_path):
    prefix = write_indexed(tmp_path / "d", DOCS, dtype=np.uint16)
    raw = (tmp_path / "d.idx").read_bytes()
    assert raw[:9] == b"MMIDIDX\x00\x00"
    assert struct.unpack("<Q", raw[9:17])[0] == 1          # version
    assert raw[17] == 8                                     # dtype code: uint16
    n, d = struct.unpack("<QQ", raw[18:34])
    assert (n, d) == (3, 4)                                 # document indices start with 0
    body = raw[34:]
    assert np.frombuffer(body, "<i4", 3).tolist() == [3, 1, 5]
    assert np.frombuffer(body, "<i8", 3, 12).tolist() == [0, 6, 8]   # byte offsets of uint16 tokens
    assert np.frombuffer(body, "<i8", 4, 36).tolist() == [0, 1, 2, 3]
    assert len(body) == 12 + 24 + 32
    assert np.frombuffer((tmp_path / "d.bin").read_bytes(), "<u2").tolist() == sum(DOCS, [])
    assert IndexedDataset(prefix).dtype == np.uint16


def test_large_vocab_uses_int32():
    assert token_dtype(65499) == np.uint16 and token_dtype(65500) == np.int32


def test_int32_dtype_code(tmp_path):
    write_indexed(tmp_path / "d", DOCS, dtype=np.int32)
    assert (tmp_path / "d.idx").read_bytes()[17] == 4


def test_random_access_and_merge(tmp_path):
    a = write_indexed(tmp_path / "a", DOCS)
    b = write_indexed(tmp_path / "b", [[3, 3], [4]])
    ds = IndexedDataset(a)
    assert len(ds) == 3 and ds.num_documents == 3 and ds.num_tokens == 9
    assert ds[2].tolist() == DOCS[2]
    assert ds.get(2, offset=1, length=3).tolist() == [8, 7, 6]
    merge_datasets([a, b], str(tmp_path / "m"))
    m = IndexedDataset(str(tmp_path / "m"))
    assert [m[i].tolist() for i in range(len(m))] == DOCS + [[3, 3], [4]]
    assert m.document_indices.tolist() == [0, 1, 2, 3, 4, 5]


@pytest.mark.parametrize("missing", [".bin", ".idx"])
def test_missing_file_is_named(tmp_path, missing):
    prefix = write_indexed(tmp_path / "d", DOCS)
    (tmp_path / f"d{missing}").unlink()
    with pytest.raises(DataError, match=f"d\\{missing}: missing"):
        IndexedDataset(prefix)


def test_idx_not_matching_bin(tmp_path):
    prefix = write_indexed(tmp_path / "d", DOCS)
    with open(tmp_path / "d.bin", "ab") as f:
        f.write(b"\x00" * 8)
    with pytest.raises(DataError, match="d.idx does not match .*d.bin"):
        IndexedDataset(prefix)


def test_bad_header(tmp_path):
    prefix = write_indexed(tmp_path / "d", DOCS)
    raw = bytearray((tmp_path / "d.idx").read_bytes())
    raw[0:1] = b"X"
    (tmp_path / "d.idx").write_bytes(bytes(raw))
    with pytest.raises(DataError, match="bad MMIDIDX header"):
        IndexedDataset(prefix)


def test_pickles_by_path(tmp_path):
    import pickle

    ds = pickle.loads(pickle.dumps(IndexedDataset(write_indexed(tmp_path / "d", DOCS))))
    assert ds[0].tolist() == DOCS[0]
