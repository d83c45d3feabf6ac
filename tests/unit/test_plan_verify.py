"""``tools/plan.py --verify``: the top plan's most loaded rank rehearsed on this CPU, its measured peak
memory next to the plan's prediction.

Tolerance on measured / predicted: the rehearsal's forward+backward peak is 1.0x to 1.35x the estimator's
(tests/unit/test_rehearse.py: our unfused layers store more than the Megatron-like implementation the
estimator describes), and no phase may peak above that.
"""

import json

import pytest

from megand.tools.plan import main

CLUSTER = """groups:
  - name: cpu
    nodes: 1
    devices_per_node: 4
    device: cpu
    memory_gib: 1
"""


@pytest.mark.parametrize("pinned,stage", [
    # the first stage holds the most micro-batches in flight (1F1B): the fullest
    (["parallel.tp=2", "parallel.pp=2", "train.micro_batch_size=1"], 0),
    (["parallel.tp=1", "parallel.pp=1", "parallel.dp=4", "optim.sharding=optim_grads_params"], 0),
])
def test_verify_reports_measured_against_predicted_peak(tmp_path, capsys, pinned, stage):
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text(CLUSTER)
    plans = tmp_path / "plans.json"
    assert main(["+experiment=tiny_llama", *pinned, "--cluster", str(cluster), "--top", "1", "--verify",
                 "--json", str(plans)]) == 0
    out = capsys.readouterr().out
    checked = json.loads(plans.read_text())[0]["verify"]
    assert checked["stage"] == stage and checked["rank"] == stage * 2
    line = next(line for line in out.splitlines() if line.startswith("verify:"))
    ratio = checked["measured_peak_bytes"] / checked["predicted_peak_bytes"]
    assert f"rank {checked['rank']} (stage {stage})" in line and f"measured / predicted {ratio:.2f}" in line, line
    assert "measured" in line and "predicted" in line, line
    assert 1.0 <= ratio <= 1.35, checked
    assert checked["measured_peak_bytes"] == max(checked["phases_peak_bytes"].values())
