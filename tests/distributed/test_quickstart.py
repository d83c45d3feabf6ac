"""The README's first command: the quickstart trains with falling loss and writes metrics.jsonl."""

from megand.testing import read_metrics, run_pretrain


def test_quickstart_trains(tmp_path):
    proc = run_pretrain(tmp_path, ["+experiment=quickstart"], nproc=4)
    metrics = read_metrics(tmp_path)
    assert len(metrics) == 60
    first, last = metrics[0]["loss"], sum(m["loss"] for m in metrics[-5:]) / 5
    assert last < 0.7 * first, (first, last)
    assert " iteration 60/60 |" in proc.stdout and "| lm loss " in proc.stdout
    assert (tmp_path / "config.yaml").exists()
