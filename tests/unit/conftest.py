import pytest
import torch.distributed as dist


@pytest.fixture(autouse=True, scope="module")
def no_process_group_leaks_out_of_a_module():
    """Some helpers (e.g. ``single_process_topology``) keep the one-process group they create; tests that
    create their own must not find it there from another module."""
    yield
    if dist.is_initialized():
        dist.destroy_process_group()
