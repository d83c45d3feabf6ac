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


# the default run: every layout once, on one of the two models (both models run cp in it); the rest slow
DEFAULT = {("cp2_p2p", "tiny_llama"), ("cp2_all_gather", "tiny_gpt"), ("cp2_tp2_sp", "tiny_llama")}


@pytest.mark.parametrize("layout, experiment", [
    pytest.param(layout, exp, id=f"{layout}-{exp}", marks=() if (layout, exp) in DEFAULT else pytest.mark.slow)
    for layout in LAYOUTS for exp in ("tiny_gpt", "tiny_llama")])
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


@pytest.mark.parametrize("layout", [pytest.param(n, marks=() if n == "cp2" else pytest.mark.slow)
                                    for n in ULYSSES])
def test_ulysses_matches_one_process(reference, launch, layout):
    nproc, overrides = ULYSSES[layout]
    assert_parity(reference("tiny_llama"), launch("tiny_llama", nproc, *overrides, "parallel.cp_comm=a2a"))
