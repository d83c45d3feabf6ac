"""tools/plan.py end to end: the table, the JSON plans, --help, one-line errors."""

import json
import os
import subprocess
import sys
from pathlib import Path

from megand.training.config import compose, validate

ROOT = Path(__file__).resolve().parents[2]
CLUSTER = """\
groups:
  - name: cpu
    nodes: 1
    devices_per_node: 2
    device: cpu
"""


def _run(*args):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, str(ROOT / "tools" / "plan.py"), *args], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=300)


def test_plan_prints_a_table_and_writes_the_plans(tmp_path):
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text(CLUSTER)
    out = tmp_path / "plans.json"
    overrides = ["+experiment=tiny_llama", "train.global_batch_size=8"]
    r = _run(*overrides, "--cluster", str(cluster), "--top", "3", "--json", str(out), "--verify")
    assert r.returncode == 0, r.stderr
    assert "tokens/s" in r.stdout and "best: append to pretrain_gpt.py: parallel.tp=" in r.stdout
    verify = [line for line in r.stdout.splitlines() if line.startswith("verify: rank 0 (stage 0)")]
    ratio = float(verify[0].split("measured / predicted ")[1].split(";")[0])
    assert 0.5 < ratio < 2.0  # the rehearsal's measured peak against the estimator's prediction
    plans = json.loads(out.read_text())
    assert len(plans) == 3
    for plan in plans:
        assert set(plan) >= {"overrides", "world_size", "stage_groups", "predicted"}
        assert set(plan["predicted"]) == {"step_time_s", "tokens_per_s", "tflops_per_device", "mfu",
                                          "bubble_fraction", "mem_peak_gib"}
        assert plan["stage_groups"]["nodes"] == ["cpu:0"]
        validate(compose(overrides + plan["overrides"]), plan["world_size"])
    assert plans[0]["predicted"]["step_time_s"] <= plans[-1]["predicted"]["step_time_s"]


def test_help_documents_the_cluster_file():
    r = _run("--help")
    assert r.returncode == 0
    for key in ("groups:", "devices_per_node", "peak_tflops", "memory_gib", "intra_node_gbps", "inter_node_gbps",
                "device:"):
        assert key in r.stdout


def test_bad_input_is_one_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("groups:\n  - name: x\n    nodes: 1\n    devices_per_node: 8\n    device: tpu\n")
    r = _run("+experiment=tiny_llama", "--cluster", str(bad))
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "device='tpu'" in r.stderr
    r = _run("+experiment=tiny_llama", "--cluster", str(tmp_path / "missing.yaml"))
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "missing.yaml" in r.stderr


def test_impossible_request_is_one_line(tmp_path):
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text(CLUSTER)
    # 4k tokens: at 8k the last stage (fp32 logits and their fp32 softmax, 4.2 GB at tp=2) fits no 8 GiB device
    r = _run("model=llama_8b", "train.global_batch_size=8", "model.seq_length=4096", "--cluster", str(cluster))
    assert r.returncode == 2 and r.stderr.count("\n") == 1
    assert "the smallest layout that fits needs" in r.stderr and "devices of 8 GiB" in r.stderr



def test_time_budget_prints_the_best_plans_so_far_and_says_the_search_was_cut(tmp_path, capsys):
    from megand.tools.plan import main  # in this process: the command line is the same

    cluster = tmp_path / "cluster.yaml"
    cluster.write_text(CLUSTER)
    assert main(["+experiment=tiny_llama", "train.global_batch_size=8", "--cluster", str(cluster),
                 "--time-budget", "1e-6"]) == 0
    out = capsys.readouterr().out
    assert "the search was cut at the time budget (--time-budget 1e-06 s)" in out
    assert "best: append to pretrain_gpt.py: parallel.tp=" in out
    assert main(["+experiment=tiny_llama", "--cluster", str(cluster), "--time-budget", "0"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--time-budget 0" in err
