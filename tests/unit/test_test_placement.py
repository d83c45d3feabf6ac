"""Where the test harness places the ranks of a test run, on machines with 0, 1, 2 and 8 GPUs: never two
ranks on one GPU (NCCL refuses it), and a parity reference where the runs it is compared with are."""

import pytest
import torch

from tests.harness import GPUS_FOR_MULTI_RANK_TESTS, ranks_device, ranks_env


@pytest.fixture
def gpus(monkeypatch):
    def set_count(n):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
    return set_count


@pytest.mark.parametrize("count, one, reference, two, four", [
    (0, "cpu", "cpu", "cpu", "cpu"),
    (1, "cuda", "cpu", "cpu", "cpu"),  # one GPU: single-process tests on it, multi-rank ones on the CPU
    (2, "cuda", "cpu", "cpu", "cpu"),  # a 4-rank test cannot: no parity test mixes devices
    (GPUS_FOR_MULTI_RANK_TESTS, "cuda", "cuda", "cuda", "cuda"),
])
def test_ranks_get_a_gpu_each_or_run_on_the_cpu(gpus, count, one, reference, two, four):
    gpus(count)
    assert ranks_device(1) == one and ranks_device(1, reference=True) == reference
    assert ranks_device(2) == two and ranks_device(4) == four
    for nproc in (1, 2, 4):  # a run kept on the CPU sees no CUDA device, so megand picks the CPU and gloo
        assert ranks_env(nproc) == ({} if ranks_device(nproc) == "cuda" else {"CUDA_VISIBLE_DEVICES": ""})
