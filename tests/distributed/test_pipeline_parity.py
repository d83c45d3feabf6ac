"""Pipeline parallelism matches the one-process reference (the parity tolerances of tests/harness.py), fp32, gpt and llama.

Each pipeline case runs by default on one or both architectures; the rest of the
cross product is marked slow. Every run also evaluates once (the tiny experiments' eval_iters=1) (forward-only schedules) and must match
the reference's validation loss.
"""

import pytest

from tests.harness import assert_parity, read_metrics, run_pretrain

PP2 = ["parallel.pp=2"]
CASES = {  # name: (processes, overrides)
    "pp2": (2, PP2),
    "pp4": (4, ["parallel.pp=4"]),
    "pp2_vpp2": (2, PP2 + ["parallel.vpp=2"]),
    "pp2_tp2_sp": (4, PP2 + ["parallel.tp=2", "parallel.sequence_parallel=true"]),
    "pp2_dp2": (4, PP2 + ["parallel.dp=2"]),
    "pp2_uneven_3_1": (2, PP2 + ["parallel.pipeline_layout=[3,1]"]),
    "pp2_recompute_full": (2, PP2 + ["train.recompute=full"]),
    "pp2_recompute_selective": (2, PP2 + ["train.recompute=selective"]),
    "pp2_vpp2_uneven_recompute_full": (2, PP2 + ["parallel.vpp=2", "parallel.pipeline_layout=[2,1,1,0]",
                                                 "train.recompute=full"]),
    "pp2_vpp2_tp2_sp": (4, PP2 + ["parallel.vpp=2", "parallel.tp=2", "parallel.sequence_parallel=true"]),
}
# pp with dp runs in the default run of test_dp_parity (pp2 x dp2, tied embeddings); pp4 with full recompute in
# test_document_parity's, uneven stages in test_stage_recompute_parity's: the rest of this matrix is slow
DEFAULT = {("llama", "pp2_vpp2"), ("llama", "pp2_tp2_sp")}
PARAMS = [pytest.param(arch, name, id=f"{arch}-{name}", marks=() if (arch, name) in DEFAULT else pytest.mark.slow)
          for name in CASES for arch in ("gpt", "llama")]


def val_losses(run_dir):
    import json

    with open(run_dir / "metrics.jsonl") as f:
        return [r["val_loss"] for r in map(json.loads, f) if "val_loss" in r]


@pytest.mark.parametrize("arch, name", PARAMS)
def test_pipeline_matches_reference(arch, name, reference_dir, tmp_path):
    reference = reference_dir(f"tiny_{arch}")
    nproc, overrides = CASES[name]
    run_pretrain(tmp_path, [f"+experiment=tiny_{arch}", *overrides], nproc=nproc)
    run, ref = read_metrics(tmp_path), read_metrics(reference)
    assert len(run) == 10, "metrics.jsonl must be written by the logging rank only, once per iteration"
    assert_parity(ref, run)
    (val,), (ref_val,) = val_losses(tmp_path), val_losses(reference)
    assert abs(val - ref_val) <= 1e-5 * abs(ref_val), f"val_loss {val} vs reference {ref_val}"
