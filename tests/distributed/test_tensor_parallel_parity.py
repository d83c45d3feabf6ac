"""Tensor, sequence and data parallelism reproduce the one-process run (the parity tolerances of tests/harness.py)."""

import pytest

from tests.harness import assert_parity

LAYOUTS = {
    "tp2": (2, ["parallel.tp=2"]),
    "dp2": (2, []),
    "tp2_sp": (2, ["parallel.tp=2", "parallel.sequence_parallel=true"]),
    "tp2_dp2_sp": (4, ["parallel.tp=2", "parallel.sequence_parallel=true"]),
}


@pytest.mark.parametrize("experiment", ["tiny_gpt", "tiny_llama"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_layout_matches_one_process(reference, launch, experiment, layout):
    nproc, overrides = LAYOUTS[layout]
    assert_parity(reference(experiment), launch(experiment, nproc, *overrides))
