"""Shared fixtures: the one-process fp32 reference run of each tiny experiment, computed once per session."""

import pytest

from megand.testing import read_metrics, run_pretrain


@pytest.fixture(scope="session")
def reference(tmp_path_factory):
    """``reference(experiment, *overrides)`` -> the metrics of the one-process run (cached)."""
    cache = {}

    def get(experiment, *overrides):
        key = (experiment, *overrides)
        if key not in cache:
            run_dir = tmp_path_factory.mktemp(f"ref_{experiment}")
            run_pretrain(run_dir, [f"+experiment={experiment}", *overrides], nproc=1)
            cache[key] = read_metrics(run_dir)
        return cache[key]

    return get


@pytest.fixture
def launch(tmp_path):
    """``launch(experiment, nproc, *overrides)`` -> the metrics of a torchrun run in a fresh run_dir."""

    def run(experiment, nproc, *overrides):
        run_pretrain(tmp_path, [f"+experiment={experiment}", *overrides], nproc=nproc)
        return read_metrics(tmp_path)

    return run
