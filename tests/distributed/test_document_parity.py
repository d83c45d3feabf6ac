"""Document-aware attention, positions and loss (the three data.* flags) on a corpus of many short
documents: tensor+sequence and pipeline parallel runs match the one-process run with the same flags."""

import numpy as np
import pytest

from tests.harness import assert_parity, read_metrics, run_pretrain
from tests.unit.data_helpers import write_indexed

EOD = 7
FLAGS = ["data.reset_attention_mask=true", "data.reset_position_ids=true", "data.eod_mask_loss=true"]


@pytest.fixture(scope="module")
def short_docs(tmp_path_factory):
    """~2,500 documents of 2-20 tokens (several per 32-token sample), each ending with EOD."""
    rng = np.random.default_rng(0)
    docs = []
    for _ in range(2500):
        body = rng.integers(8, 200, size=rng.integers(1, 20))
        docs.append(np.concatenate([body, [EOD]]))
    prefix = write_indexed(tmp_path_factory.mktemp("docs") / "short", docs)
    return ["data=indexed", f"data.paths=[[1.0,{prefix}]]", f"data.eod_id={EOD}", "data.split='98,2,0'",
            f"data.cache_dir={tmp_path_factory.mktemp('cache')}"]


@pytest.fixture(scope="module")
def reference_with_flags(short_docs, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("ref")
    run_pretrain(run_dir, ["+experiment=tiny_llama", *short_docs, *FLAGS], nproc=1)
    return read_metrics(run_dir)


def test_flags_change_the_loss(short_docs, reference_with_flags, tmp_path):
    run_pretrain(tmp_path, ["+experiment=tiny_llama", *short_docs], nproc=1)
    plain = read_metrics(tmp_path)
    assert abs(plain[0]["loss"] - reference_with_flags[0]["loss"]) > 1e-3


@pytest.mark.parametrize("nproc, layout", [
    (2, ["parallel.tp=2", "parallel.sequence_parallel=true"]),
    (2, ["parallel.pp=2", "parallel.vpp=2", "train.recompute=selective"]),
    (4, ["parallel.pp=4", "train.recompute=full"]),  # two middle stages: they read no tokens otherwise
    (2, ["parallel.cp=2", "parallel.cp_comm=p2p"]),
    # the other two cp paths: their document attention equals one process in the default run of
    # test_ring_attention_documents, here slow
    pytest.param(2, ["parallel.cp=2", "parallel.cp_comm=all_gather"], marks=pytest.mark.slow),
    pytest.param(2, ["parallel.cp=2", "parallel.cp_comm=a2a"], marks=pytest.mark.slow),
    pytest.param(4, ["parallel.cp=2", "parallel.tp=2", "parallel.sequence_parallel=true", "parallel.cp_comm=p2p"],
                 marks=pytest.mark.slow),
])
def test_document_flags_parity(short_docs, reference_with_flags, tmp_path, nproc, layout):
    run_pretrain(tmp_path, ["+experiment=tiny_llama", *short_docs, *FLAGS, *layout], nproc=nproc)
    assert_parity(reference_with_flags, read_metrics(tmp_path))
