"""Context parallelism reproduces the one-process run (the parity tolerances of tests/harness.py), ring and all-gather."""

import pytest

from tests.harness import assert_parity

LAYOUTS = {
    "cp2_p2p": (2, ["parallel.cp=2", "parallel.cp_comm=p2p"]),
    "cp2_all_gather": (2, ["parallel.cp=2", "parallel.cp_comm=all_gather"]),
    "cp4_p2p": (4, ["parallel.cp=4"]),
    "cp2_tp2_sp": (4, ["parallel.cp=2", "parallel.tp=2", "parallel.sequence_parallel=true"]),
    "cp2_dp2": (4, ["parallel.cp=2"]),
    "cp2_pp2": (4, ["parallel.cp=2", "parallel.pp=2"]),
}


@pytest.mark.parametrize("experiment", ["tiny_gpt", "tiny_llama"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_context_parallel_matches_one_process(reference, launch, experiment, layout):
    nproc, overrides = LAYOUTS[layout]
    assert_parity(reference(experiment), launch(experiment, nproc, *overrides))


# All-to-all (Ulysses): GQA K/V heads split over cp (cp=2, cp=2 x pp=2) or are repeated first (cp=4, tp=2).
ULYSSES = {
    "cp2": (2, ["parallel.cp=2"]),
    "cp4": (4, ["parallel.cp=4"]),
    "cp2_tp2_sp": (4, ["parallel.cp=2", "parallel.tp=2", "parallel.sequence_parallel=true"]),
    "cp2_pp2": (4, ["parallel.cp=2", "parallel.pp=2"]),
}


@pytest.mark.parametrize("layout", ULYSSES)
def test_ulysses_matches_one_process(reference, launch, layout):
    nproc, overrides = ULYSSES[layout]
    assert_parity(reference("tiny_llama"), launch("tiny_llama", nproc, *overrides, "parallel.cp_comm=a2a"))
