"""Shared fixtures: the one-process fp32 reference run of each tiny experiment, computed once per session."""

import pytest

from tests.harness import read_metrics, run_pretrain


@pytest.fixture(scope="session")
def reference_dir(tmp_path_factory):
    """``reference_dir(experiment, *overrides)`` -> the run directory of the one-process run (cached)."""
    cache = {}

    def get(experiment, *overrides):
        key = (experiment, *overrides)
        if key not in cache:
            run_dir = tmp_path_factory.mktemp(f"ref_{experiment}")
            run_pretrain(run_dir, [f"+experiment={experiment}", *overrides], nproc=1, reference=True)
            cache[key] = run_dir
        return cache[key]

    return get


@pytest.fixture(scope="session")
def reference(reference_dir):
    """``reference(experiment, *overrides)`` -> the training metrics of the one-process run (cached)."""
    return lambda experiment, *overrides: read_metrics(reference_dir(experiment, *overrides))


@pytest.fixture
def launch(tmp_path):
    """``launch(experiment, nproc, *overrides)`` -> the metrics of a torchrun run in a fresh run_dir."""

    def run(experiment, nproc, *overrides):
        run_pretrain(tmp_path, [f"+experiment={experiment}", *overrides], nproc=nproc)
        return read_metrics(tmp_path)

    return run
