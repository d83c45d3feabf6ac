"""The README's first command (`make quickstart`): the quickstart trains on real text with falling loss and writes metrics.jsonl."""

import json

from tests.harness import read_metrics, run_pretrain


def test_quickstart_trains(tmp_path):
    proc = run_pretrain(tmp_path, ["+experiment=quickstart"], nproc=4, torchrun=True)  # as `make quickstart` runs it
    metrics = read_metrics(tmp_path)
    assert [m["iter"] for m in metrics] == [10, 20, 30, 40, 50, 60]
    assert metrics[-1]["loss"] < metrics[0]["loss"] - 0.8, [m["loss"] for m in metrics]
    assert " iteration 60/60 |" in proc.stdout and "| lm loss " in proc.stdout
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["iter"] for r in lines if "val_loss" in r] == [30, 60]
    assert (tmp_path / "config.yaml").exists()
