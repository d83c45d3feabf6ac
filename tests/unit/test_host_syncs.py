"""A training step reads device values to the host at most once (the agreed skip decision) between log
lines: no per-step `.item()` for the loss, the gradient norm or the batch checksum."""

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from megand.training.config import compose
from tests.unit.test_trainer_wandb import one_process_world  # noqa: F401  (fixture)

# Tensor methods that copy a value to the host (on a GPU: wait for the device)
READS = {"item", "tolist", "numpy", "__bool__", "__int__", "__float__", "__index__", "__format__", "__repr__"}


class HostReads(TorchFunctionMode):
    """Counts the host reads of tensor values while active: the Tensor methods above, and any other read of
    a scalar from inside an op (``aten._local_scalar_dense``, seen by the dispatch mode)."""

    def __init__(self, host_tensors=()):
        super().__init__()
        self.host_ids = {id(t) for t in host_tensors}  # tensors that live on the host by design: not counted
        self.reads, self._inside = [], 0
        self._dispatch = _ScalarReads(self)

    def __enter__(self):
        self._dispatch.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        super().__exit__(*exc)
        return self._dispatch.__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name not in READS:
            return func(*args, **(kwargs or {}))
        if not (args and id(args[0]) in self.host_ids):
            self.reads.append(name)
        self._inside += 1
        try:
            return func(*args, **(kwargs or {}))
        finally:
            self._inside -= 1


class _ScalarReads(TorchDispatchMode):
    def __init__(self, owner):
        super().__init__()
        self.owner = owner

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default and not self.owner._inside:
            self.owner.reads.append("_local_scalar_dense")
        return func(*args, **(kwargs or {}))


def test_host_read_counter_sees_reads():
    x = torch.ones(3)
    with HostReads() as counter:
        x.sum().item()
        bool(x.all())
        x.tolist()
        torch.ones(2, 2).nonzero()  # no scalar read on CPU: not counted
    assert counter.reads == ["item", "__bool__", "tolist"]


# MoE: every routing path (capacity, the sigmoid router's bias update, shared experts) keeps its
# statistics on the device
MOE = ["model=moe_tiny", "model.moe_router=sigmoid", "model.moe_capacity_factor=1.0", "model.moe_shared_experts=1"]


@pytest.mark.parametrize("experiment, extra", [("tiny_llama", []), ("tiny_gpt", []), ("tiny_llama", MOE)],
                         ids=["tiny_llama", "tiny_gpt", "moe"])
def test_one_host_read_per_step_between_log_lines(one_process_world, experiment, extra):  # noqa: F811
    from megand.training.pretrain import Trainer

    cfg = compose([f"+experiment={experiment}", *extra, "model.num_layers=2", "train.iters=8", "train.log_interval=4",
                   "train.eval_iters=0", "train.global_batch_size=4", "train.micro_batch_size=2",
                   f"run_dir={one_process_world / 'run'}"])
    trainer = Trainer(cfg)
    trainer.step()  # first step: lazy initialisation is not the steady state
    # AdamW's step counters are host tensors here (torch's foreach AdamW reads them for its bias
    # corrections); reading host memory waits for no device
    counters = [x.step for x in trainer.optimizer.pieces if x.step.device.type == "cpu"]
    per_step = []
    for _ in range(2):
        with HostReads(host_tensors=counters) as counter:
            loss, result = trainer.step()
        per_step.append(counter.reads)
    assert per_step == [["tolist"], ["tolist"]], per_step  # the agreed loss, grad norm and skip flags
    assert loss > 0 and result.grad_norm > 0 and not result.skipped
