"""Host work per iteration outside the step: the benchmark times it as a user's run has it, and the stop
decision costs no collective of its own (it rides on the step's all-reduce)."""

import importlib.util
import json
import re
from pathlib import Path

import pytest
import torch.distributed as dist

from megand.core.checkpointing import StopOnSignal
from megand.training import peak
from megand.training.config import compose

DIST_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")
TINY = ["model=llama_tiny", "model.num_layers=1", "model.ffn_hidden_size=96", "model.vocab_size=256"]


@pytest.fixture
def one_process_world(tmp_path, monkeypatch):
    for name in DIST_ENV:  # init_distributed sets these for a one-process world: restore them afterwards
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(peak, "measure_matmul_flops", lambda *a, **k: 50e9)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # not the machine's measured peak
    yield tmp_path
    if dist.is_initialized():
        dist.destroy_process_group()


def test_benchmark_times_the_iterations_of_a_run_with_their_log_lines(one_process_world, capsys):
    path = Path(__file__).resolve().parents[2] / "tools" / "benchmark.py"
    spec = importlib.util.spec_from_file_location("benchmark_tool", path)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    run_dir = one_process_world / "run"
    tool.main(TINY + ["--mode", "megand", "--steps", "3", "--warmup", "1", f"run_dir={run_dir}"])
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1 and json.loads(lines[0])["steps"] == 3  # stdout: the JSON line only
    # every iteration logged, as a run with the default train.log_interval=1 does
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["iter"] for r in records] == [1, 2, 3, 4]
    assert re.findall(r" iteration (\d+)/4 ", (run_dir / "console.log").read_text()) == ["1", "2", "3", "4"]


def test_stop_decision_needs_no_collective_of_its_own(one_process_world, monkeypatch):
    from megand.training.pretrain import Trainer

    calls = []
    monkeypatch.setattr(StopOnSignal, "agreed", lambda self, limit_reached=False: calls.append(1) or 0)
    trainer = Trainer(compose(["+experiment=tiny_gpt", "model.num_layers=1", "train.iters=5", "train.eval_iters=0",
                               "train.exit_interval=3", f"run_dir={one_process_world / 'run'}"]))
    trainer.run()
    assert calls == [] and trainer.iteration == 3  # train.exit_interval still stops the run, at iteration 3
