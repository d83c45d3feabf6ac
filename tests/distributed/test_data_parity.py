"""On an indexed dataset (the offline quickstart corpus), a tp=2 x dp=2 run and the one-process run see
identical global batches (token checksums per step) and match losses within the parity tolerances."""

from tests.harness import assert_parity

DATA = ["data=quickstart", "model.vocab_size=2048", "model.seq_length=64", "train.batch_checksum=true"]


def test_indexed_data_identical_batches_across_layouts(reference, launch):
    ref = reference("tiny_llama", *DATA)
    run = launch("tiny_llama", 4, *DATA, "parallel.tp=2", "parallel.sequence_parallel=true")
    assert [r["batch_checksum"] for r in run] == [r["batch_checksum"] for r in ref]
    assert len({r["batch_checksum"] for r in ref}) == len(ref)  # every step a different batch
    assert_parity(ref, run)
